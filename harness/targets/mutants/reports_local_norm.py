"""Reports the local norm: clips with the global norm, returns (logs) this rank's own.

The norm of a sharded or Partial DTensor read before it is reduced: ``total_norm.to_local()`` or the
rank-local part (torchtitan #766 / PR #769, pytorch #170862, miles_diffusion PR #35, ms-swift PR
#8341): the clip is right, every rank reports a different, too small number.
"""

import torch
import torch.nn as nn

from harness.clipmath import combine, pow_sum, reduce_root_and_clip, root
from harness.reference import reference_partial


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    params, local = reference_partial(model, norm_type)
    own = 0.0
    for _, p in params:
        assert p.grad is not None  # reference_partial: the parameters with gradients
        own = combine(own, pow_sum(p.grad, norm_type), norm_type)
    reduce_root_and_clip(local, (p for _, p in params), max_norm=max_norm, norm_type=norm_type)
    return torch.tensor(root(own, norm_type), dtype=torch.float64)
