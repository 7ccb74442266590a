"""Hypothesis strategies that draw whole cases: a mesh, parameters of several kinds placed on it, a
framework plan that may lie about them, and gradients with the awkward properties real runs have.

    from hypothesis import given
    from harness.strategies import drawn_cases

    @given(drawn_cases(world_size=4))
    def test_my_clip(drawn): ...          # drawn.variant, drawn.norm_type, drawn.max_norm

Everything is drawn in the controlling process and is plain data (a ``Variant``), so it can be sent
to the ranks of a warm world, shrunk by hypothesis, and encoded into a replay blob.

What gets drawn:

* a mesh ``(fsdp, ep, tp)`` whose sizes multiply to the world size (sizes of 1 included), sometimes
  with one more axis: ``pp`` (each parameter on one stage, or tied between the first and the last),
  ``dp_replicate`` (HSDP replicas) or ``cp`` (context-parallel replicas);
* 1 to 5 parameters, each one of: a dense matrix (FSDP-sharded or replicated, TP-sharded or
  TP-replicated), stacked experts ``[E, a, b]`` sharded over ``ep``, a shared LoRA factor
  ``[1, a, b]`` replicated over ``ep``, or a per-expert module living only on the ranks of its owner
  (DeepSpeed style); sometimes every expert module belongs to one EP rank, so the others own none;
  named as real models name theirs (``bias``, ``norm``, ``gate``, ``embed_tokens``, ``lm_head``,
  ``lora_A``, ``shared_experts``, ...: ``harness.cases.model_names``), since clips pick groups by name;
* which parameters the framework's plan enumerates: the others get a fallback ``Replicate`` on ``ep``;
* sometimes DTensor parameters (when every parameter is on every rank), placed as the plan declares:
  honest placements where the plan enumerates a parameter, a lying ``Replicate`` where it does not;
* sometimes some of a DTensor model's replicated parameters stay plain tensors (a TP plan's
  unplanned modules);
* gradient magnitudes: as generated, loss-scaled (x64: norms inside fp16, their squares beyond it),
  and around fp16's smallest normal numbers (x2^-14: squares that underflow);
* experts whose gradient is None (no tokens; plain parameters only: a DTensor gradient exists on
  every rank of its mesh), all-zero gradients, a NaN or inf element on any rank's slice (gloo's float
  MAX keeps a NaN only where rank 0 holds it, so which rank holds it matters);
* dtype, norm type, and a clip bound below or above the true norm.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, TypeVar, cast

from hypothesis import strategies as st

from harness.cases.axes import MeshAxis
from harness.cases.variant import DeclaredPlan, Variant
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, ParamSpec, Placement, Replicate, Shard, param, ravel
from harness.cases.model_names import NAMES, real_name
from harness.cases.constructive import gradient_pow_sums, variant_truth
from harness.clipmath import root
from harness.cases.drawn import DrawnCase

KINDS = ("dense", "experts", "shared_lora", "expert_module")
NORM_TYPES = (2.0, 1.0, math.inf, 3.0, 1.5)
NONFINITE_NORM_TYPES = (math.inf, 2.0)
DTYPES = ("fp32", "fp32", "bf16", "fp16", "fp64")
CLIP_FACTORS = (0.25, 0.5, 2.0, 4.0, 0.3)
AT_FP16_EDGE = 0.0
"""A drawn scale meaning: fp16 gradients (whatever dtype was drawn) scaled so that their total passes 65504
while every gradient's own norm still fits fp16 (``_fp16_edge_scale``)."""
SCALES = (1.0, 1.0, 64.0, 2.0**-14, AT_FP16_EDGE)
"""Gradient magnitudes: as drawn, a loss-scaled fp16 run's (norms inside fp16, squares beyond it), fp16's
smallest normal numbers (squares that underflow), and fp16 gradients whose norms fit fp16 one by one but
whose total may pass 65504 (a clip holding its total in the gradient dtype returns inf); shrinks towards 1."""
DTYPE_MAX = {"fp16": 65504.0, "bf16": 3.39e38, "fp32": 3.40e38, "fp64": 1.79e308}
FITS_THE_DTYPE = 4.0
"""A drawn norm stays below a quarter of its dtype's largest number (else the scale falls back to 1):
a clip may return the norm in the gradient dtype. Not at ``AT_FP16_EDGE``, whose point is a total that
does not fit."""
PAST_THE_EDGE = 1.125
"""At ``AT_FP16_EDGE``, the total aimed at: this far past 65504."""
EDGE_FITS = 1.0625
"""At ``AT_FP16_EDGE``, every gradient's own norm stays below 65504 / 1.0625: fp16 holds each (torch's
per-tensor norms of fp16 gradients are fp16), with room for their rounding."""


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(k for k in range(1, n + 1) if n % k == 0)


EXTRA_AXES = (None, MeshAxis.PP, MeshAxis.CP, MeshAxis.DP_REPLICATE)
"""At most one axis beside (fsdp, ep, tp): pipeline stages (outermost), HSDP replicas (outermost) or
context-parallel replicas (after fsdp). None first: hypothesis shrinks towards the plain mesh."""


_Factory = TypeVar("_Factory", bound=Callable[..., Any])


def _reused(factory: _Factory) -> _Factory:
    """One strategy object per distinct arguments. Hypothesis builds a fresh lazy strategy on every
    call of a composite (or of ``one_of``, ``map``) and validates it on its first draw: called inside
    another composite, that validation was paid on every draw (its cost: docs/performance.md, "Where it
    stands", item 7, and "Figures cited by the code"). A cached object is
    validated once; derandomized runs draw the same cases as with fresh objects (pinned in
    tests/test_fuzz.py); ``sampled_from`` is left to hypothesis's own cache. Arguments that are not
    hashable (a list of kinds from a caller) get a fresh object, as before; ``typed`` keeps 1, 1.0
    and True apart, as hypothesis's own cache does."""
    cached = functools.lru_cache(maxsize=4096, typed=True)(factory)

    @functools.wraps(factory)
    def strategy(*args: Any, **kwargs: Any) -> Any:
        try:
            hash((args, tuple(kwargs.items())))
        except TypeError:
            return factory(*args, **kwargs)
        return cached(*args, **kwargs)

    return cast(_Factory, strategy)


_integers = _reused(st.integers)
_BOOLEANS = st.booleans()


@_reused
def _subsets(names: tuple[str, ...], max_size: int) -> st.SearchStrategy[list[str]]:
    return st.lists(st.sampled_from(names), max_size=max_size, unique=True)


@_reused
@st.composite
def meshes(draw: Any, world_size: int, stages: bool = True) -> MeshSpec:
    """A mesh for ``world_size`` ranks; ``stages=False`` leaves out pipeline stages."""
    extra = draw(st.sampled_from(EXTRA_AXES if stages else tuple(a for a in EXTRA_AXES if a != MeshAxis.PP)))
    outer = draw(st.sampled_from(_divisors(world_size)[1:])) if extra is not None and world_size > 1 else 1
    rest = world_size // outer
    ep = draw(st.sampled_from(_divisors(rest)))
    tp = draw(st.sampled_from(_divisors(rest // ep)))
    fsdp = rest // (ep * tp)
    if extra is None or outer == 1:
        return MeshSpec.of(fsdp=fsdp, ep=ep, tp=tp)
    if extra == MeshAxis.CP:
        return MeshSpec.of(fsdp=fsdp, cp=outer, ep=ep, tp=tp)
    return MeshSpec.of(**{extra.value: outer}, fsdp=fsdp, ep=ep, tp=tp)


@_reused
@st.composite
def stage_ranks(draw: Any, mesh: MeshSpec) -> frozenset[int] | None:
    """The ranks of the pipeline stage(s) a parameter lives on: one stage, or (tied, like an
    embedding shared with the output head) the first and the last; None without a ``pp`` axis."""
    if not mesh.has(MeshAxis.PP):
        return None
    last = mesh.size(MeshAxis.PP) - 1
    return mesh.ranks_on(MeshAxis.PP, draw(_stages(last)))


@_reused
def _stages(last: int) -> st.SearchStrategy[tuple[int, ...]]:
    return st.one_of(_integers(0, last).map(_one_stage), st.just((0, last)))


def _one_stage(stage: int) -> tuple[int]:
    return (stage,)


_SHARD_OR_REPLICATE = {dim: st.sampled_from((Shard(dim), Replicate())) for dim in range(3)}
"""Built once: a strategy made afresh on every draw is validated afresh on every draw."""
_NAME_GROUPS = {kind: st.integers(0, len(groups) - 1) for kind, groups in NAMES.items()}
_SPELLINGS = {count: st.integers(0, count - 1) for count in {len(g) for groups in NAMES.values() for g in groups}}


@_reused
@st.composite
def param_specs(draw: Any, mesh: MeshSpec, index: int, experts: int, owner: int | None,
                kinds: tuple[str, ...] = KINDS) -> ParamSpec:
    """One parameter of one of ``kinds``; ``owner`` pins every expert module to one EP coordinate."""
    fsdp, ep, tp = mesh.size(MeshAxis.FSDP), mesh.size(MeshAxis.EP), mesh.size(MeshAxis.TP)
    kind = draw(st.sampled_from(kinds))
    # at least 2 x 2 elements per local slice: distinct slices then differ in some element even in
    # bf16 (a 1-element slice could collide with another by chance and be measured as a replica)
    a = fsdp * draw(_integers(2, 3))
    b = tp * draw(_integers(2, 3))
    stage = draw(stage_ranks(mesh))
    shard_or_rep = _SHARD_OR_REPLICATE
    group = draw(_NAME_GROUPS[kind])
    spelling = draw(_SPELLINGS[len(NAMES[kind][group])])
    if kind == "dense":
        return param(real_name(kind, index, group, spelling), (a, b), present_ranks=stage,
                     fsdp=draw(shard_or_rep[0]), tp=draw(shard_or_rep[1]))
    if kind == "experts":
        return param(real_name(kind, index, group, spelling), (experts, a, b), present_ranks=stage, ep=Shard(0),
                     fsdp=draw(shard_or_rep[1]), tp=draw(shard_or_rep[2]))
    if kind == "shared_lora":
        return param(real_name(kind, index, group, spelling), (1, a, b), present_ranks=stage, fsdp=draw(shard_or_rep[1]))
    home = owner if owner is not None else draw(_integers(0, ep - 1))
    owners = mesh.ranks_where(ep=home)
    return param(real_name(kind, index, group, spelling, owner=home), (a, b),
                 present_ranks=owners if stage is None else owners & stage,
                 fsdp=draw(shard_or_rep[0]), tp=draw(shard_or_rep[1]))


@_reused
@st.composite
def layouts(draw: Any, world_size: int, dtensor: bool = False) -> tuple[Layout, DeclaredPlan]:
    """A layout and the framework's declared plan for it (true where enumerated, else fallback).
    ``dtensor``: one DTensor parameters can have, every parameter on every rank (no pipeline
    stages, no per-owner expert modules)."""
    mesh = draw(meshes(world_size, stages=not dtensor))
    experts = mesh.size(MeshAxis.EP) * draw(_integers(1, 2))
    owner = 0 if draw(_BOOLEANS) and mesh.size(MeshAxis.EP) > 1 else None
    count = draw(_integers(1, 5))
    kinds = tuple(k for k in KINDS if k != "expert_module") if dtensor else KINDS
    specs = tuple(draw(param_specs(mesh, i, experts, owner, kinds)) for i in range(count))
    layout = Layout(mesh, specs)
    declared: dict[str, dict[str, Placement]] = {}
    for spec in layout:
        truth = {axis: spec.placement(axis) for axis in mesh.names}
        if not draw(_BOOLEANS):  # not enumerated by the plan: the fallback placement on ep
            truth[MeshAxis.EP] = Replicate()
        declared[spec.name] = truth
    return layout, declared


def _slices_away_from_rank_zero(layout: Layout, name: str) -> tuple[int, ...]:
    """Ranks whose slice of ``name`` rank 0 does not hold (where a float MAX can drop a NaN)."""
    spec = layout.param(name)
    zero = layout.local_box(spec, 0)
    return tuple(r for r in range(layout.mesh.world_size)
                 if (box := layout.local_box(spec, r)) is not None and box != zero)


@st.composite
def nonfinite_elements(draw: Any, layout: Layout, names: tuple[str, ...]) -> tuple[str, int]:
    """A parameter and the flat logical index of a non-finite element in the slice of a drawn rank.

    Where the element sits decides what a float MAX keeps (gloo's keeps a NaN only where rank 0
    holds it), so half the draws pick a slice rank 0 does not hold, when there is one. The rank is
    drawn last rank first (hypothesis shrinks towards the first choice, so a minimal case keeps its
    element away from rank 0), then an element inside that rank's slice; its replicas carry it too."""
    away_names = tuple(n for n in names if _slices_away_from_rank_zero(layout, n))
    name = draw(st.one_of(st.sampled_from(away_names), st.sampled_from(names)) if away_names
                else st.sampled_from(names))
    spec = layout.param(name)
    holders = tuple(r for r in range(layout.mesh.world_size) if layout.local_box(spec, r) is not None)
    away = _slices_away_from_rank_zero(layout, name)
    ranks = st.sampled_from(holders[::-1])
    box = layout.local_box(spec, draw(st.one_of(st.sampled_from(away[::-1]), ranks) if away else ranks))
    assert box is not None
    index = tuple(draw(_integers(a, b - 1)) for a, b in box)
    return name, ravel(index, spec.shape)


@st.composite
def injections(draw: Any, layout: Layout, seed: int = 0, dtensor: bool = False) -> Injection:
    names = tuple(s.name for s in layout.trainable)  # tuples: hypothesis reuses the strategies built on them
    none_on = {}
    for name in draw(_subsets(names, 0 if dtensor else 2)):
        none_on[name] = frozenset({draw(_integers(0, layout.mesh.world_size - 1))})
    zero = draw(_subsets(names, 1))
    nonfinite = []
    if draw(_BOOLEANS):  # often: where a NaN sits decides whether a float MAX drops it
        name, flat = draw(nonfinite_elements(layout, names))
        nonfinite.append((name, flat, draw(st.sampled_from(("nan", "nan", "inf", "-inf")))))
    return Injection(seed=seed, dtype=draw(st.sampled_from(DTYPES)), zero=frozenset(zero),
                     none_on=tuple(none_on.items()), nonfinite=tuple(nonfinite))


def _fp16_edge_scale(layout: Layout, injection: Injection, norm_type: float) -> float:
    """``AT_FP16_EDGE``'s scale: the one that puts the total just past 65504 (x ``PAST_THE_EDGE``), or, where a
    gradient's own norm would then not fit, the largest at which every gradient's own norm stays below
    65504 / ``EDGE_FITS`` (1 for the inf norm, whose total is one element, and where a gradient is not
    finite)."""
    if math.isinf(norm_type):
        return 1.0
    parts = gradient_pow_sums(layout, dataclasses.replace(injection, scale=1.0), norm_type)  # one pass for both
    largest, total = root(max(parts, default=0.0), norm_type), root(sum(parts), norm_type)
    if not (math.isfinite(total) and largest > 0):
        return 1.0
    return min(DTYPE_MAX["fp16"] * PAST_THE_EDGE / total, DTYPE_MAX["fp16"] / EDGE_FITS / largest)


@_reused
@st.composite
def drawn_cases(draw: Any, world_size: int) -> DrawnCase:
    # DTensor parameters in about one case in three, decided first so that it is a top-level choice
    dtensor = draw(_integers(0, 2)) == 2
    layout, declared = draw(layouts(world_size, dtensor))
    injection = draw(injections(layout, seed=draw(_integers(0, 2**16)), dtensor=dtensor))
    # with a NaN or inf gradient the inf norm is where clips differ most (a float MAX may drop a NaN)
    norm_type = draw(st.sampled_from(NONFINITE_NORM_TYPES if injection.nonfinite else NORM_TYPES))
    factor = draw(st.sampled_from(CLIP_FACTORS))
    # drawn last, so that adding them left the rest of each example as it was drawn before:
    # a DTensor model whose plan leaves some modules unplanned holds them as plain, replicated tensors
    replicated = tuple(spec.name for spec in layout if all(isinstance(p, Replicate) for _, p in spec.placements))
    plain = frozenset(draw(_subsets(replicated, len(replicated)))) if dtensor and replicated else frozenset()
    scale = draw(st.sampled_from(SCALES))
    edge = scale == AT_FP16_EDGE
    if edge:  # fp16 whatever dtype was drawn: the edge is fp16's
        injection = dataclasses.replace(injection, dtype="fp16")
    injection = dataclasses.replace(injection, scale=_fp16_edge_scale(layout, injection, norm_type) if edge else scale)
    variant = Variant(label=f"drawn {layout.describe()}", layout=layout, injection=injection, declared=declared,
                      dtensor=dtensor, plain=plain)
    truth = variant_truth(variant, norm_type)  # kept on the variant: rank 0 judges with it
    if math.isfinite(truth) and truth * FITS_THE_DTYPE > DTYPE_MAX[injection.dtype] and not edge:
        variant = dataclasses.replace(variant, injection=dataclasses.replace(injection, scale=1.0))
        truth = variant_truth(variant, norm_type)
    max_norm = factor * truth if math.isfinite(truth) and truth > 0 else 1.0
    return DrawnCase(variant, norm_type, max_norm, world_size)
