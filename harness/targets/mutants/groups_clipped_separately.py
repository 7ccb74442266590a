"""Groups clipped separately: dense and expert gradients each clipped by their own group's norm.

Megatron's dense and MoE optimizers once clipped with separate norms (NVIDIA/Megatron-LM #785,
fixed by the ChainedOptimizer's one global norm): the reported global norm is right, but each
group is scaled by max_norm / its own norm, so the update direction changes.
"""

import math

import torch
import torch.nn as nn

from harness.clipmath import clip_coefficient, combine, root, scale_grads_

from ._shapes import group_norms


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    dense, experts, dense_norm, expert_norm = group_norms(model, norm_type)
    scale_grads_(dense, clip_coefficient(max_norm, dense_norm))
    scale_grads_(experts, clip_coefficient(max_norm, expert_norm))
    if math.isnan(dense_norm) or math.isnan(expert_norm):
        return torch.tensor(math.nan, dtype=torch.float64)
    total = combine(dense_norm**norm_type if math.isfinite(norm_type) else dense_norm,
                    expert_norm**norm_type if math.isfinite(norm_type) else expert_norm, norm_type)
    return torch.tensor(root(total, norm_type), dtype=torch.float64)
