"""Replicated by fallback: trusts the declared plan's Replicate placements (xorl's ep_replicated group).

A parameter the plan does not enumerate gets a fallback Replicate, which is then read as proof that
every rank of that axis holds a copy; its contribution is divided by the axis size. Exact when the
plan tells the truth, 1/sqrt(k) low on whatever it forgot.
"""

import math

import torch
import torch.nn as nn

from harness.clipmath import reduce_root_and_clip, trainable_with_grads, weighted_partial
from harness.cases.context import context
from harness.cases.layout import Replicate


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    ctx = context(model)
    params = trainable_with_grads(model)

    def declared_copies(name: str, _: nn.Parameter) -> int:
        return math.prod(ctx.group_size(d) for d in ctx.mesh_spec.names
                         if isinstance(ctx.declared_placement(name, d), Replicate))

    local = weighted_partial(params, norm_type, declared_copies)
    return torch.tensor(reduce_root_and_clip(local, (p for _, p in params), max_norm=max_norm,
                                             norm_type=norm_type), dtype=torch.float64)
