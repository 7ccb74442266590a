"""Pipeline norms merged with MAX after a stage-local clip: the reported norm is the largest stage's.

xorl's ``clip_gradients`` clips each stage with its own norm before the pipeline reduction, and that
reduction is a MAX: every rank reports the same number (so ranks agree), which is the largest stage
norm, not the global one, and each stage was scaled by its own coefficient.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.clipmath import clip_coefficient, collective_device, scale_grads_
from harness.cases.axes import MeshAxis
from harness.cases.context import context

from ._shapes import stage_norm


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    params, norm = stage_norm(model, norm_type, MeshAxis.PP)
    scale_grads_(params, clip_coefficient(max_norm, norm))
    ctx = context(model)
    total = torch.tensor(norm, dtype=torch.float64, device=collective_device())
    if ctx.mesh_spec.has(MeshAxis.PP):
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=ctx.group(MeshAxis.PP))
    return total
