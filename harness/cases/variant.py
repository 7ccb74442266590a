"""What one case is: a scenario's layout variant, run against one target with one norm and bound.

Cases are plain data, built identically on every rank from the command line, so every rank walks
the same list in the same order (the precondition for matching collectives).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, TypeVar

from harness.cases.injection import Injection
from harness.cases.layout import Layout, LayoutError, Placement, Replicate

DeclaredPlan = Mapping[str, Mapping[str, Placement]]
"""What the framework under test *believes*: parameter name -> mesh axis -> placement."""

Info = TypeVar("Info")

DTensorAxes = Mapping[str, tuple[tuple[str, ...], ...]]
"""Per DTensor parameter: its DTensor's mesh dims, each as the axes of the case's mesh it spans (several:
those axes flattened into one dim)."""


def whole_mesh_dims(names: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """The dims of a DTensor on the whole mesh: one per axis, in the mesh's order."""
    return tuple((axis,) for axis in names)


def sub_mesh_problem(names: tuple[str, ...], dims: tuple[tuple[str, ...], ...]) -> str | None:
    """Why ``dims`` cannot be built as a sub-mesh of a DeviceMesh with axes ``names`` (None: it can). Torch
    slices a mesh by axes in the mesh's own order, each once, and flattens axes that are adjacent; a
    flattened dim beside others would need slicing a flattened dim from the root mesh, which torch
    deprecates, so that is refused too."""
    axes = [axis for dim in dims for axis in dim]
    if not dims or any(not dim for dim in dims):
        return "it spans no axes"
    unknown = [axis for axis in axes if axis not in names]
    if unknown:
        return f"it spans axes the mesh does not have: {', '.join(map(str, unknown))}"
    order = [names.index(axis) for axis in axes]
    if any(b <= a for a, b in zip(order, order[1:])):
        return "its dims are not axes of the mesh in the mesh's order, each once"
    if len(dims) > 1 and any(len(dim) > 1 for dim in dims):
        return "a dim of it flattens several axes beside other dims"
    if len(dims) == 1 and len(dims[0]) > 1 and order[-1] - order[0] != len(order) - 1:
        return "its one dim flattens axes that are not adjacent"
    return None


def mesh_dim_name(dim: tuple[str, ...]) -> str:
    """The name torch gives a sub-mesh dim spanning ``dim`` (``sub_mesh_problem``'s rules): the axis itself, or
    for axes flattened into one dim their names joined, as ``DeviceMesh._flatten`` is asked to name it."""
    return "_".join(dim)


def declared_from_layout(layout: Layout) -> dict[str, dict[str, Placement]]:
    """A plan that tells the truth: the layout's own placements, every mesh axis spelled out."""
    return {spec.name: {axis: spec.placement(axis) for axis in layout.mesh.names} for spec in layout}


def plan_lies(variant: "Variant") -> dict[str, list[str]]:
    """Per parameter, the mesh axes where the variant's declared plan contradicts its true layout
    (an axis the plan does not name is declared ``Replicate``); empty for an honest plan."""
    lies: dict[str, list[str]] = {}
    for spec in variant.layout:
        declared = variant.declared.get(spec.name, {})
        wrong = [axis for axis in variant.layout.mesh.names if declared.get(axis, Replicate()) != spec.placement(axis)]
        if wrong:
            lies[spec.name] = wrong
    return lies


HONEST_PLAN = " [honest plan]"


def with_honest_plan(variant: "Variant") -> "Variant":
    """``variant`` with its declared plan replaced by the truth (DTensor parameters placed by it too),
    labelled so; a variant whose plan is already honest, unchanged. What a plan-trusting clip is
    judged on when the question is its arithmetic, not the plan (``--plans honest``)."""
    if not plan_lies(variant):
        return variant
    return dataclasses.replace(variant, label=variant.label + HONEST_PLAN, declared=declared_from_layout(variant.layout))


@dataclass(frozen=True)
class Variant:
    """One layout of a scenario and everything fixed with it.

    ``invariance_key``: variants with equal keys hold the same unique logical gradients laid out
    differently, so any correct clip must give them the same norm and coefficient (a metamorphic
    check). ``info`` is what a framework's scenario tells that framework's adapter about this
    layout (how to wrap the model, which marks or meshes to use): a typed object defined in the
    framework's own folder, read back with ``info_as`` (never shared string keys).

    ``dtensor``: the parameters are DTensors placed as declared, except those named in ``plain``, which
    stay plain tensors: a model whose TP plan leaves some modules unplanned (transformers, accelerate)
    holds both kinds at once, and a clip must count both. ``dtensor_axes``: the DTensor parameters that live
    on a sub-mesh of the case's mesh (a measured job's experts on ``ep_fsdp``, its dense parameters on a
    flattened mesh of every rank), each as the axes its mesh dims span; a DTensor parameter it does not name
    is on the whole mesh, as are all of them when it is empty. Torch's clip sees one mesh per parameter,
    and how many distinct meshes there are changes what it does, so a replay must keep them.

    ``synthetic``: why no known path of the scenario's framework reaches this layout (its trainer's
    hooks make these gradients replicas, say), or None for a layout its users meet. A synthetic layout
    is a regression layout: the harness's own targets run it, a framework's adapter only on request
    (``--synthetic``), with the gradients injected after the framework's setup, and its FAILs are
    never called findings.

    ``dress_from_plain``: the DTensors of this variant are what its framework's own setup makes of a plain model
    (``fully_shard``, accelerate's ``prepare``): a target with a ``dress`` (that setup) is built the plain model
    its trainer starts from (``as_built_for``), a clip without one the DTensors.

    ``truths``: the constructive norm by norm type, filled by ``constructive.variant_truth`` as it is
    first asked for; not an argument (``dataclasses.replace`` starts a changed variant empty), not
    compared, and pickled with the variant, so the ranks of a warm world get what the fuzzer's
    process computed to draw the bound instead of hashing every logical element again.
    """

    label: str
    layout: Layout
    injection: Injection
    declared: DeclaredPlan
    invariance_key: str | None = None
    dtensor: bool = False
    plain: frozenset[str] = frozenset()
    dtensor_axes: DTensorAxes = field(default_factory=dict)
    ep_size: int | None = None
    info: Any = None
    synthetic: str | None = None
    dress_from_plain: bool = False
    truths: dict[float, float] = field(default_factory=dict, init=False, compare=False, repr=False)

    def as_built_for(self, dressed: bool) -> "Variant":
        """The variant whose model a target is built: this one, or for a target with a ``dress`` of a variant
        whose DTensors that setup makes (``dress_from_plain``), the same one with every parameter plain."""
        if not (dressed and self.dress_from_plain):
            return self
        return dataclasses.replace(self, dtensor=False, plain=frozenset(), dtensor_axes={}, dress_from_plain=False)

    def info_as(self, kind: type[Info]) -> Info:
        """This variant's ``info``, checked to be the adapter's expected type (a clear error when a
        target is run on another framework's scenario)."""
        if not isinstance(self.info, kind):
            raise LayoutError(f"variant {self.label!r} carries {type(self.info).__name__}, not the "
                              f"{kind.__name__} its target needs: run the target on its own scenario")
        return self.info

    def __post_init__(self) -> None:
        self.injection.validate(self.layout)
        unknown = sorted(set(self.declared) - {s.name for s in self.layout})
        if unknown:
            raise LayoutError(f"variant {self.label!r}: declared plan names unknown parameters {unknown}")
        object.__setattr__(self, "plain", frozenset(self.plain))
        unknown_plain = sorted(self.plain - {s.name for s in self.layout})
        if unknown_plain or (self.plain and not self.dtensor):
            raise LayoutError(f"variant {self.label!r}: plain parameters {sorted(self.plain)} need a DTensor variant "
                              f"naming its own parameters (unknown: {unknown_plain})")
        self._check_dtensor_axes()
        if self.dtensor:
            world = self.layout.mesh.world_size  # a measured parameter names its ranks even when it is on all
            partial = [s.name for s in self.layout
                       if s.present_ranks is not None and len(s.present_ranks) < world and s.name not in self.plain]
            if partial:
                raise LayoutError(
                    f"variant {self.label!r}: DTensor parameters must exist on every rank, "
                    f"but {partial} are present on some ranks only"
                )


    def _check_dtensor_axes(self) -> None:
        """Each sub-mesh parameter a DTensor of this variant, on a sub-mesh its mesh can build."""
        stray = sorted(n for n in self.dtensor_axes if n in self.plain or n not in {s.name for s in self.layout})
        if stray or (self.dtensor_axes and not self.dtensor):
            raise LayoutError(f"variant {self.label!r}: sub-mesh parameters {sorted(self.dtensor_axes)} need a DTensor "
                              f"variant naming its own DTensor parameters (not: {stray})")
        for name, dims in self.dtensor_axes.items():
            problem = sub_mesh_problem(self.layout.mesh.names, dims)
            if problem:
                raise LayoutError(f"variant {self.label!r}: the sub-mesh of {name} cannot be built: {problem}")


@dataclass(frozen=True)
class CaseSpec:
    """A variant run against one target with one norm type and clip bound; a case whose target or
    scenario needs a framework that is not installed is planned anyway, as a skip with the reason."""

    index: int
    scenario: str
    variant: Variant
    target: str
    norm_type: float
    max_norm: float
    skip: str | None = None  # why this case cannot run here (a framework it needs is missing)
    clip_ratio: float | None = None  # max_norm as a multiple of the true norm, when planned that way

    @property
    def layout(self) -> Layout:
        return self.variant.layout

    @property
    def injection(self) -> Injection:
        return self.variant.injection

    @property
    def norm_label(self) -> str:
        return norm_label(self.norm_type)


def norm_label(norm_type: float) -> str:
    if math.isinf(norm_type):
        return "Linf"
    return f"L{norm_type:g}"


def parse_norm_type(text: str) -> float:
    """'2', '1', '1.5', 'inf' -> float; rejects p <= 0 and NaN."""
    try:
        value = float(text)
    except ValueError:
        raise LayoutError(f"norm type must be a number or 'inf', got {text!r}") from None
    if math.isnan(value) or value <= 0:
        raise LayoutError(f"norm type must be positive or inf, got {text!r}")
    return value


def bound_label(clip_ratio: float | None, max_norm: float) -> str:
    """``x0.5`` for a bound relative to the true norm, the bound itself when absolute."""
    return f"x{clip_ratio:g}" if clip_ratio is not None else f"{max_norm:.3g}"
