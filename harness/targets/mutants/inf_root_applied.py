"""The p-th root applied to the inf norm: ``total ** (1 / inf)`` makes every inf norm 1.0.

torchrec's FSDP2 clip compared ``norm_type`` with the string ``"inf"`` and took the p-norm branch
for ``torch.inf`` (meta-pytorch/torchrec PR #3199): the maximum is reduced right, then raised to the
power 0, so it reports 1.0 and clips by max_norm / 1.0.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.clipmath import clip_coefficient, collective_scalar, is_inf_norm, reduce_op, root, scale_grads_
from harness.reference import reference_partial


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    params, local = reference_partial(model, norm_type)
    total = collective_scalar(local)
    dist.all_reduce(total, op=reduce_op(norm_type))
    norm = float(total) ** (1.0 / norm_type) if is_inf_norm(norm_type) else root(float(total), norm_type)
    scale_grads_((p for _, p in params), clip_coefficient(max_norm, norm))
    return torch.tensor(norm, dtype=torch.float64)
