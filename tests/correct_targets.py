"""Correct clip functions written in unusual but legitimate ways: negative controls for the judge.

Each one clips every gradient in place by min(1, max_norm / (total + 1e-6)) with the true global
norm and returns that norm, for every layout the harness can describe (plain or DTensor gradients,
None gradients, parameters present on some ranks only, ranks holding nothing, every dtype, L1, L2,
L3 and inf, NaN/inf gradients). They differ from the reference in *how*: torch's own primitives,
a different non-finite policy (skip the step, poison, leave, raise), a different reduction
(all_gather, one mesh dim at a time), a different accumulation dtype, foreach kernels. The judge
must PASS every one of them; a FAIL is either a bug here or a false FAIL of the judge.

Every rank runs the same collectives in the same order whatever it holds, and every collective
carries float64 (a rank holding nothing cannot know the gradients' dtype).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

import harness
from harness.clipmath import EPS, collective_device, local_tensor
from harness.cases.layout import Replicate

TORCH_NONFINITE_MESSAGE = (
    "The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
    "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
    "`error_if_nonfinite=False`"
)


# -- shared helpers ---------------------------------------------------------------------------------
def _held(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, rank-local gradient) for every trainable parameter with a non-empty gradient on this rank;
    the local gradient is a view of the DTensor's local shard where the gradient is a DTensor. Empty
    ones (a zero-size parameter, an empty shard) are left out: they add nothing, and torch's inf norm
    kernels refuse them."""
    held = [(n, local_tensor(p.grad)) for n, p in model.named_parameters() if p.requires_grad and p.grad is not None]
    return [(n, g) for n, g in held if g.numel() > 0]


def _f64(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, device=collective_device())


def _pow_sum(g: torch.Tensor, norm_type: float) -> torch.Tensor:
    """sum |g|^p (max |g| for inf) as a float64 0-dim tensor; NaN propagates; 0 for an empty tensor."""
    x = g.detach().to(torch.float64)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=x.device)
    if math.isinf(norm_type):
        return x.abs().amax()
    return x.abs().pow(norm_type).sum()


def _weighted_partial(model: nn.Module, norm_type: float) -> tuple[float, bool]:
    """This rank's de-duplicated share of the global pow sum (the local max for inf), and whether a
    NaN is in it."""
    ctx = harness.context(model)
    inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float64)
    for name, g in _held(model):
        part = _pow_sum(g, norm_type).cpu()
        total = torch.maximum(total, part) if inf else total + part / ctx.true_replica_count(name)
    value = float(total)
    return value, math.isnan(value)


def _all_reduce_norm(local: float, nan: bool, norm_type: float, group=None) -> float:
    """One all-reduce of [partial, NaN flag] (SUM, or MAX for inf: the flag keeps a NaN that gloo's
    float MAX would drop) and the root."""
    t = _f64([local, float(nan)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=group)
    if t[1] > 0:
        return math.nan
    total = float(t[0])
    return total if math.isinf(norm_type) else total ** (1.0 / norm_type)


def _scale(model: nn.Module, coefficient: float) -> None:
    for _, g in _held(model):
        g.mul_(coefficient)


def _clip_if_finite(model: nn.Module, max_norm: float, norm: float) -> None:
    """Scale by min(1, max_norm / (norm + eps)) when the norm is finite; leave the gradients otherwise."""
    if math.isfinite(norm):
        coefficient = _clip_coefficient(max_norm, norm)
        if coefficient < 1.0:
            _scale(model, coefficient)


def _clip_coefficient(max_norm: float, norm: float) -> float:
    return min(1.0, max_norm / (norm + EPS))


# -- 1. torch's own primitives ------------------------------------------------------------------------
def torch_primitives(model, *, max_norm, norm_type=2.0):
    """torch.nn.utils.get_total_norm per gradient on float64 copies pre-divided by
    replica_count^(1/p) (so a replica group sums to one copy), one SUM all-reduce, then
    torch.nn.utils.clip_grads_with_norm_ with the global norm on plain proxies whose .grad is the
    rank-local gradient (so DTensor gradients are clipped through their local shard). Non-finite:
    torch's own behaviour (NaN norm -> NaN coefficient, inf norm -> coefficient 0)."""
    ctx = harness.context(model)
    inf = math.isinf(norm_type)
    held = _held(model)
    if inf:
        local = torch.nn.utils.get_total_norm([g.detach().double() for _, g in held], norm_type)
    else:
        parts = [
            torch.nn.utils.get_total_norm([g.detach().double() / ctx.true_replica_count(n) ** (1.0 / norm_type)],
                                          norm_type) ** norm_type
            for n, g in held
        ]
        local = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64)
    value = float(local)
    total = torch.tensor(_all_reduce_norm(value, math.isnan(value), norm_type), dtype=torch.float64)
    proxies = []
    for _, g in held:
        proxy = nn.Parameter(torch.empty_like(g))
        proxy.grad = g
        proxies.append(proxy)
    torch.nn.utils.clip_grads_with_norm_(proxies, max_norm, total)
    return total


# -- 2-5. other non-finite policies -------------------------------------------------------------------
def skip_step_on_nonfinite(model, *, max_norm, norm_type=2.0):
    """Skip step: when the global norm is non-finite, every gradient is zeroed (the optimizer step
    then does nothing) and the non-finite norm is returned; otherwise a normal clip."""
    norm = _all_reduce_norm(*_weighted_partial(model, norm_type), norm_type)
    if not math.isfinite(norm):
        for _, g in _held(model):
            g.zero_()
    else:
        coefficient = _clip_coefficient(max_norm, norm)
        if coefficient < 1.0:
            _scale(model, coefficient)
    return norm


def poison_on_nonfinite(model, *, max_norm, norm_type=2.0):
    """Propagate: when the global norm is non-finite every gradient is multiplied by a NaN
    coefficient, so the NaN reaches every parameter (torch's default, error_if_nonfinite=False,
    for a NaN norm); otherwise every gradient is multiplied by min(1, coefficient), 1.0 included."""
    norm = _all_reduce_norm(*_weighted_partial(model, norm_type), norm_type)
    _scale(model, _clip_coefficient(max_norm, norm) if math.isfinite(norm) else math.nan)
    return torch.tensor(norm, dtype=torch.float64)


def gathered_sum_leave_nonfinite(model, *, max_norm, norm_type=2.0):
    """Leave: every rank all_gathers every rank's [partial, NaN flag] and combines them itself in
    rank order (sum, or NaN-aware max), instead of one all-reduce; a non-finite norm is returned
    and the gradients are left exactly as they were."""
    local, nan = _weighted_partial(model, norm_type)
    mine = _f64([local, float(nan)])
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    table = torch.stack(rows)
    if bool((table[:, 1] > 0).any()):
        norm = math.nan
    elif math.isinf(norm_type):
        norm = float(table[:, 0].max())
    else:
        total = 0.0
        for r in range(table.shape[0]):
            total += float(table[r, 0])
        norm = total ** (1.0 / norm_type)
    _clip_if_finite(model, max_norm, norm)
    return norm


def raise_on_nonfinite(model, *, max_norm, norm_type=2.0):
    """Raise: the norm is reduced first (every rank takes part in the collective), then every rank
    raises torch's error_if_nonfinite=True RuntimeError when it is non-finite, gradients untouched."""
    norm = _all_reduce_norm(*_weighted_partial(model, norm_type), norm_type)
    if not math.isfinite(norm):
        raise RuntimeError(TORCH_NONFINITE_MESSAGE.format(norm_type=float(norm_type)))
    coefficient = _clip_coefficient(max_norm, norm)
    if coefficient < 1.0:
        _scale(model, coefficient)
    return torch.tensor([norm], dtype=torch.float64)  # a 1-element tensor, not 0-dim


# -- 6. inf norm by all_gather --------------------------------------------------------------------------
def inf_by_all_gather(model, *, max_norm, norm_type=2.0):
    """Inf norm from an all_gather of every rank's local maximum, merged with torch.max (which
    propagates NaN) instead of a MAX all-reduce with a NaN flag; p-norms by the usual SUM."""
    if not math.isinf(norm_type):
        norm = _all_reduce_norm(*_weighted_partial(model, norm_type), norm_type)
    else:
        local, _ = _weighted_partial(model, norm_type)
        mine = _f64([local])
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        norm = float(torch.cat(rows).max())
    _clip_if_finite(model, max_norm, norm)
    return norm


# -- 7. one mesh dim at a time ----------------------------------------------------------------------------
def _is_product_set(mesh, ranks) -> bool:
    coords = {mesh.coordinate(r) for r in ranks}
    axes = [{c[a] for c in coords} for a in range(len(mesh.names))]
    return math.prod(len(s) for s in axes) == len(coords)


def _copies_along_replicated_dims(ctx, name: str) -> int:
    """Product over the mesh dims the parameter is Replicate on (true layout) of how many ranks of my
    group along that dim hold it: a dim where only my coordinate holds it is no replica dim."""
    layout, mesh = ctx.layout, ctx.mesh_spec
    spec = layout.param(name)
    mine = mesh.coordinate(ctx.rank)
    count = 1
    for axis, dim in enumerate(mesh.names):
        if not isinstance(spec.placement(dim), Replicate):
            continue
        line = [mesh.rank_at(mine[:axis] + (c,) + mine[axis + 1:]) for c in range(mesh.size(dim))]
        count *= sum(1 for r in line if layout.is_present(spec, r))
    return count


def per_dim_reduction(model, *, max_norm, norm_type=2.0):
    """Two-level (one level per mesh dim) reduction: the partial is all-reduced over each mesh
    dim's own group in turn (ctx.group(dim)) instead of over the world, and each gradient is
    weighted by its copies along the dims its true placement replicates it on, counted among the
    ranks of that dim's group that hold it (so a parameter living at one EP coordinate is not
    divided by ep). Presence sets must be products of per-dim coordinate sets (every scenario's and
    the fuzzer's are); any other layout is refused on every rank, before any collective."""
    ctx = harness.context(model)
    layout, mesh = ctx.layout, ctx.mesh_spec
    for spec in layout.trainable:
        if spec.present_ranks is not None and not _is_product_set(mesh, spec.present_ranks):
            raise ValueError(f"per_dim_reduction: {spec.name} is present on a non-product set of ranks")
    inf = math.isinf(norm_type)
    local = 0.0
    nan = False
    for name, g in _held(model):
        part = float(_pow_sum(g, norm_type))
        nan = nan or math.isnan(part)
        local = max(local, part) if inf else local + part / _copies_along_replicated_dims(ctx, name)
    t = _f64([local, float(nan)])
    for dim in mesh.names:
        if mesh.size(dim) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=ctx.group(dim))
    if t[1] > 0:
        norm = math.nan
    else:
        norm = float(t[0]) if inf else float(t[0]) ** (1.0 / norm_type)
    _clip_if_finite(model, max_norm, norm)
    return norm


# -- 8. accumulation in the gradient's dtype ---------------------------------------------------------------
def grad_dtype_accumulation(model, *, max_norm, norm_type=2.0):
    """Accumulates in the gradients' own precision, as torch does for bf16/fp16 models: each
    per-tensor norm is torch.linalg.vector_norm in the gradient's dtype (rounded to bf16/fp16), the
    weighted p-th powers are summed in float32 (float64 for fp64 gradients); only the collective
    carries float64. Within the judge's tolerance (bf16 1e-2, fp16 2e-3) as long as no per-tensor
    norm overflows the dtype (fp16: 65504), which no harness layout comes near."""
    ctx = harness.context(model)
    inf = math.isinf(norm_type)
    local = None
    for name, g in _held(model):
        acc = torch.promote_types(g.dtype, torch.float32)
        n = torch.linalg.vector_norm(g.detach(), ord=norm_type).to(acc)
        part = n if inf else n.pow(norm_type) / ctx.true_replica_count(name)
        local = part if local is None else (torch.maximum(local, part) if inf else local + part)
    value = 0.0 if local is None else float(local)
    norm = _all_reduce_norm(value, math.isnan(value), norm_type)
    if math.isfinite(norm):
        coefficient = _clip_coefficient(max_norm, norm)
        if coefficient < 1.0:
            for _, g in _held(model):
                g.mul_(torch.tensor(coefficient, dtype=g.dtype))  # the coefficient rounded to the dtype
    return norm


# -- 9. foreach kernels ------------------------------------------------------------------------------------
def foreach_kernels(model, *, max_norm, norm_type=2.0):
    """torch._foreach_norm for the per-tensor norms and torch._foreach_mul_ for the scaling, on
    the rank-local gradients grouped by dtype (skipped on a rank holding none); torch's non-finite
    behaviour: a NaN norm poisons every gradient, an inf norm gives coefficient 0."""
    ctx = harness.context(model)
    inf = math.isinf(norm_type)
    held = _held(model)
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, g in held:
        by_dtype.setdefault(g.dtype, []).append((name, g))
    local = 0.0
    nan = False
    for group in by_dtype.values():
        norms = torch._foreach_norm([g.detach() for _, g in group], norm_type)
        for (name, _), n in zip(group, norms):
            v = float(n.double())
            nan = nan or math.isnan(v)
            local = max(local, v) if inf else local + v ** norm_type / ctx.true_replica_count(name)
    norm = _all_reduce_norm(local, nan, norm_type)
    if math.isnan(norm):
        coefficient = math.nan
    else:
        coefficient = min(1.0, max_norm / (norm + EPS))  # inf norm -> 0.0
    for group in by_dtype.values():
        torch._foreach_mul_([g for _, g in group], coefficient)
    return torch.tensor(norm, dtype=torch.float64)


# -- correct clips an adversarial review (a red team) found the judge failing --------------------------------
_BUILT_AT_INIT: list[dist.ProcessGroup] = []


def group_built_once(model, *, max_norm, norm_type=2.0):
    """Framework style: its reduction group is created once, on its first call ('at init', as Megatron's
    parallel_state and DeepSpeed's groups are), and used for the life of the process; raise policy for a
    non-finite norm (every rank, after the reduction, gradients untouched). A harness that rebuilds the
    world after a documented raise kills the group under it."""
    if not _BUILT_AT_INIT:
        _BUILT_AT_INIT.append(dist.new_group(list(range(dist.get_world_size()))))
    norm = _all_reduce_norm(*_weighted_partial(model, norm_type), norm_type, group=_BUILT_AT_INIT[0])
    if not math.isfinite(norm):
        raise RuntimeError("The total norm of gradients is non-finite, so it cannot be clipped")
    _clip_if_finite(model, max_norm, norm)
    return norm


def returns_a_default_dtype_tensor(model, *, max_norm, norm_type=2.0):
    """Norm and clip exact in float64, but returned as torch.tensor(norm): a tensor of the default dtype,
    float32, so at fp64 the reported value is one float32 rounding from the exact norm (a reporting
    precision, not a wrong clip)."""
    norm = _all_reduce_norm(*_weighted_partial(model, norm_type), norm_type)
    _clip_if_finite(model, max_norm, norm)
    return torch.tensor(norm)


def raise_in_apex_words(model, *, max_norm, norm_type=2.0):
    """Raise, apex/DeepSpeed-flavoured: after the reduction, on every rank, gradients untouched,
    FloatingPointError('NaNs/Infs detected in the gradients; refusing to clip') (a wording the judge once
    read as a crash)."""
    norm = _all_reduce_norm(*_weighted_partial(model, norm_type), norm_type)
    if not math.isfinite(norm):
        raise FloatingPointError("NaNs/Infs detected in the gradients; refusing to clip")
    _clip_if_finite(model, max_norm, norm)
    return norm
