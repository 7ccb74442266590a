"""Scales up: applies max_norm / (total + eps) even when it is above 1 (the min(1, .) is forgotten).

The norm is reduced and reported correctly, but the coefficient is never clamped, so whenever the
norm is already below the bound every gradient is multiplied by a factor > 1. This is the
hand-rolled ``clip_coef = max_norm / (total_norm + 1e-6); g.mul_(clip_coef)`` without torch's
``clip_coef.clamp(max=1.0)`` (or Megatron's ``if clip_coeff < 1.0`` guard): reported in
DingfanChen/GS-WGAN#5 and fixed in tinygrad's llama trainer (tinygrad PR #11761, "clamp
GRAD_CLIP_NORM"); torch's own docs omitted the clamp (pytorch#151554). Non-finite norms are handled
as the reference does (gradients left alone).
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.clipmath import EPS, collective_device, local_tensor, reduce_op, root
from harness.reference import reference_partial


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    params, local = reference_partial(model, norm_type)
    total = torch.tensor([local, float(math.isnan(local))], dtype=torch.float64, device=collective_device())
    dist.all_reduce(total, op=reduce_op(norm_type))
    norm = math.nan if total[1] > 0 else root(float(total[0]), norm_type)
    if math.isfinite(norm):
        coefficient = max_norm / (norm + EPS)  # the mistake: no min(1, .)
        for _, p in params:
            assert p.grad is not None  # reference_partial: the parameters with gradients
            local_tensor(p.grad).mul_(coefficient)
    return torch.tensor(norm, dtype=torch.float64)
