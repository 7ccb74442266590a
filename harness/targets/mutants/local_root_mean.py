"""Local root, then the mean of the rank-local norms over the world (DeepSpeed's fp32 clip, #8475).

Right only when every rank holds the same parameters: with experts owned by different ranks the mean
of local norms is not the norm of the unique gradients.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.clipmath import clip_coefficient, collective_scalar, combine, pow_sum, root, scale_grads_, trainable_with_grads


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    params = trainable_with_grads(model)
    local = 0.0
    for _, p in params:
        assert p.grad is not None  # trainable_with_grads
        local = combine(local, pow_sum(p.grad, norm_type), norm_type)
    mean = collective_scalar(root(local, norm_type) / dist.get_world_size())
    dist.all_reduce(mean, op=dist.ReduceOp.SUM)
    total = float(mean)
    scale_grads_((p for _, p in params), clip_coefficient(max_norm, total))
    return torch.tensor(total, dtype=torch.float64)
