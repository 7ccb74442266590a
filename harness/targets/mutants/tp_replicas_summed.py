"""TP replicas summed: copies along ``tp`` are counted as if they were distinct shards.

Norm weights, routers and other TP-replicated parameters then count tp_size times (NeMo-RL #3788,
ROCm TransformerEngine #715, xorl's non-EP bucket): the norm comes out sqrt(tp) too high on them.
"""

import torch
import torch.nn as nn

from harness.spec.axes import MeshAxis
from harness.clipmath import reduce_root_and_clip, trainable_with_grads, weighted_partial
from harness.spec.context import CaseContext, context


def _copies_within_my_tp_slice(ctx: CaseContext, name: str) -> int:
    layout, mesh = ctx.layout, ctx.mesh_spec
    spec = layout.param(name)
    box = layout.local_box(spec, ctx.rank)
    if not mesh.has(MeshAxis.TP):
        return ctx.true_replica_count(name)
    axis = mesh.index(MeshAxis.TP)
    mine = mesh.coordinate(ctx.rank)[axis]
    assert box is not None  # the rank-local model has only the parameters this rank holds
    return sum(1 for r in layout.holders(spec, box) if mesh.coordinate(r)[axis] == mine)


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    ctx = context(model)
    params = trainable_with_grads(model)
    local = weighted_partial(params, norm_type, lambda name, _: _copies_within_my_tp_slice(ctx, name))
    return torch.tensor(reduce_root_and_clip(local, (p for _, p in params), max_norm=max_norm,
                                             norm_type=norm_type), dtype=torch.float64)
