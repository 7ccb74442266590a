"""The two shapes of mistake several mutants share, each parameterised by the mesh axis it gets wrong:
a reduction that skips one axis, and replicas along one axis counted as if they were distinct. One
implementation each, so the modules that use them differ only in the axis and the story."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.clipmath import (
    clip_coefficient,
    collective_device,
    reduce_op,
    reduce_root_and_clip,
    root,
    scale_grads_,
    trainable_with_grads,
    weighted_partial,
)
from harness.reference import reference_partial
from harness.cases.axes import MeshAxis
from harness.cases.context import CaseContext, context
from harness.cases.layout import Shard

Clip = Callable[..., torch.Tensor]


def stage_norm(model: nn.Module, norm_type: float, skipped: str) -> tuple[list[nn.Parameter], float]:
    """The correctly de-duplicated norm, except that the reduction never crosses ``skipped``: each
    coordinate of that axis (an EP rank, a pipeline stage) ends up with its own norm."""
    ctx = context(model)
    params, local = reference_partial(model, norm_type)
    # a NaN flag rides along, as in the reference: gloo's float MAX may drop a NaN (another mistake)
    total = torch.tensor([local, float(math.isnan(local))], dtype=torch.float64, device=collective_device())
    for axis in ctx.mesh_spec.names:
        if axis != skipped:
            dist.all_reduce(total, op=reduce_op(norm_type), group=ctx.group(axis))
    return [p for _, p in params], math.nan if total[1] > 0 else root(float(total[0]), norm_type)


def scales_a_copy(view: Callable[[torch.Tensor], torch.Tensor]) -> Clip:
    """A clip whose norm is the reference's, but which scales ``view(p.grad)`` in place: right only
    where the view *is* the gradient (a ``.float()`` of an fp32 gradient), a thrown-away copy
    elsewhere (of a bf16 gradient; a DTensor's ``full_tensor()``)."""

    def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        params, local = reference_partial(model, norm_type)
        norm = reduce_root_and_clip(local, (), max_norm=max_norm, norm_type=norm_type)  # the norm alone
        coefficient = clip_coefficient(max_norm, norm)
        if math.isfinite(coefficient) and coefficient < 1.0:
            for _, p in params:
                assert p.grad is not None  # reference_partial: the parameters with gradients
                view(p.grad).mul_(coefficient)  # the mistake: a copy wherever the view is one
        return torch.tensor(norm, dtype=torch.float64)

    return clip


def missing_reduction(skipped: str) -> Clip:
    """A clip whose norm is reduced over every mesh axis but ``skipped``, and clips with it."""

    def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        params, norm = stage_norm(model, norm_type, skipped)
        scale_grads_(params, clip_coefficient(max_norm, norm))
        return torch.tensor(norm, dtype=torch.float64)

    return clip


def copies_outside(ctx: CaseContext, name: str, axis: str) -> int:
    """Ranks holding this rank's slice of ``name`` that share its coordinate on ``axis``: the replica
    count a clip gets when it forgets that copies along ``axis`` are copies."""
    layout, mesh = ctx.layout, ctx.mesh_spec
    if not mesh.has(axis):
        return ctx.true_replica_count(name)
    spec = layout.param(name)
    box = layout.local_box(spec, ctx.rank)
    assert box is not None  # the rank-local model has only the parameters this rank holds
    a = mesh.index(axis)
    mine = mesh.coordinate(ctx.rank)[a]
    return sum(1 for r in layout.holders(spec, box) if mesh.coordinate(r)[a] == mine)


def replicas_summed(axis: str) -> Clip:
    """A clip that counts every copy of a gradient along ``axis`` as a distinct shard."""

    def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        ctx = context(model)
        params = trainable_with_grads(model)
        local = weighted_partial(params, norm_type, lambda name, _: copies_outside(ctx, name, axis))
        return torch.tensor(reduce_root_and_clip(local, (p for _, p in params), max_norm=max_norm,
                                                 norm_type=norm_type), dtype=torch.float64)

    return clip


def is_expert(ctx: CaseContext, name: str) -> bool:
    """An expert parameter, as a framework tells it: declared sharded over ``ep``."""
    return isinstance(ctx.declared_placement(name, MeshAxis.EP), Shard)


def group_norms(model: nn.Module, norm_type: float) -> tuple[list[nn.Parameter], list[nn.Parameter], float, float]:
    """Dense and expert parameters, each group's correct global norm: what a framework with one
    gradient store (or optimizer) per group computes before it combines them."""
    ctx = context(model)
    params = trainable_with_grads(model)
    norms = []
    groups: list[list[nn.Parameter]] = [[], []]
    for expert in (False, True):
        chosen = [(n, p) for n, p in params if is_expert(ctx, n) == expert]
        groups[expert] = [p for _, p in chosen]
        local = weighted_partial(chosen, norm_type, lambda name, _: ctx.true_replica_count(name))
        total = torch.tensor([local, float(math.isnan(local))], dtype=torch.float64, device=collective_device())
        dist.all_reduce(total, op=reduce_op(norm_type))
        norms.append(math.nan if total[1] > 0 else root(float(total[0]), norm_type))
    return groups[0], groups[1], norms[0], norms[1]
