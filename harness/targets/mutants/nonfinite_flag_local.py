"""Non-finite flag not shared: each rank decides from its own gradients whether to give up.

The norm is reduced correctly, but the check for NaN/inf looks only at the local gradients, so the
rank that holds the bad value raises while the others carry on (xorl's and torch's
error_if_nonfinite evaluated per rank instead of on the reduced norm).
"""

from typing import cast

import torch
import torch.nn as nn

from harness.clipmath import local_tensor, reduce_root_and_clip
from harness.reference import reference_partial


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    params, local = reference_partial(model, norm_type)
    norm = reduce_root_and_clip(local, (p for _, p in params), max_norm=max_norm, norm_type=norm_type)
    if any(not bool(torch.isfinite(local_tensor(cast(torch.Tensor, p.grad))).all()) for _, p in params):
        raise RuntimeError("non-finite gradient on this rank; skipping the step")
    return torch.tensor(norm, dtype=torch.float64)
