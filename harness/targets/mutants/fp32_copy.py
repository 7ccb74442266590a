"""Clips an fp32 copy: scales ``g.float()`` in place, so non-fp32 gradients are never clipped.

The norm is right, but each gradient is clipped through ``g.float().mul_(coef)``: for an fp32
gradient ``.float()`` is the tensor itself, for bf16/fp16 (and fp64: ``.float()`` narrows, so it
is a copy too) it is a temporary that is scaled and thrown away. It models clipping the wrong
tensors: fp32 master copies while the model's fp16 gradients stay as they were (fastai2#528), or
``clip_grads_with_norm_`` handed fresh tensors instead of the parameters (huggingface/transformers
PR #46113: norm right, no clipping applied).
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.clipmath import clip_coefficient, collective_device, local_tensor, reduce_op, root
from harness.reference import reference_partial


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    params, local = reference_partial(model, norm_type)
    total = torch.tensor([local, float(math.isnan(local))], dtype=torch.float64, device=collective_device())
    dist.all_reduce(total, op=reduce_op(norm_type))
    norm = math.nan if total[1] > 0 else root(float(total[0]), norm_type)
    coefficient = clip_coefficient(max_norm, norm)
    if math.isfinite(coefficient) and coefficient < 1.0:
        for _, p in params:
            assert p.grad is not None  # reference_partial: the parameters with gradients
            local_tensor(p.grad).float().mul_(coefficient)  # the mistake: a copy unless fp32
    return torch.tensor(norm, dtype=torch.float64)
