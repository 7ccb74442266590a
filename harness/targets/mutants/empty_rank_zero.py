"""Empty rank reports zero: a rank that holds no gradient at all returns its local 0.0.

torch's ``clip_grad_norm_`` / ``_get_total_norm`` start with ``if len(grads) == 0: return
torch.tensor(0.0)``; a distributed wrapper that keeps that early return reports 0 on a rank with no
gradients (an EP rank that owns no expert, a pipeline stage with nothing trainable) while its peers
report the global norm: the torchtitan case of PRs #1541 and #2270 (``get_total_norm([])`` returns a
plain ``tensor(0.)``). Here the early return sits after the collective, so the rank still joins the
reduction and nothing hangs; only its answer is wrong.
"""

import torch
import torch.nn as nn

from harness.clipmath import reduce_root_and_clip
from harness.reference import reference_partial


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    params, local = reference_partial(model, norm_type)
    norm = reduce_root_and_clip(local, (p for _, p in params), max_norm=max_norm, norm_type=norm_type)
    if not params:  # the mistake: torch's "no gradients, norm 0" early return
        return torch.tensor(0.0)
    return torch.tensor(norm, dtype=torch.float64)
