"""Generator exhausted before the clip: the norm consumes the parameter iterator, the clip gets none.

``clip_grad_norm_(model.parameters(), ...)`` written as two passes over one generator: the first
(the norm) exhausts it, the second (``clip_grads_with_norm_``) scales nothing (pytorch/torchtitan PR
#1258; AReaL PR #335). The norm is right, no gradient is ever clipped.
"""

import torch
import torch.nn as nn

from harness.clipmath import reduce_root_and_clip, weighted_partial
from harness.cases.context import context


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    ctx = context(model)
    params = ((n, p) for n, p in model.named_parameters() if p.requires_grad and p.grad is not None)
    local = weighted_partial(params, norm_type, lambda name, _: ctx.true_replica_count(name))
    return torch.tensor(reduce_root_and_clip(local, (p for _, p in params), max_norm=max_norm,
                                             norm_type=norm_type), dtype=torch.float64)
