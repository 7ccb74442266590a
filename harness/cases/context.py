"""What a clip function under test can reach from the model it is handed.

The target contract is ``fn(model, *, max_norm, norm_type) -> total_norm``. Everything else a real
framework would know (its mesh, its process groups, its own parallel plan) is reachable through
``harness.context(model)``, so a user's function needs no harness-specific arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Hashable, Mapping, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from harness.cases.variant import CaseSpec, DeclaredPlan
from harness.cases.layout import Layout, MeshSpec, ParamSpec, Placement, Replicate

_ATTRIBUTE = "_clipcheck_context"
T = TypeVar("T")


class GroupSource(Protocol):
    """What a case's context asks of the world that runs it (``harness.run.world.dist_world.DistWorld``):
    groups over mesh axes, the case's timeout on a framework's own meshes, and state kept per generation
    of groups. A protocol, so that what a case is knows nothing of how it is run."""

    def group_over(self, spec: MeshSpec, axes: tuple[str, ...]) -> dist.ProcessGroup: ...

    def give_case_timeout(self, *meshes: DeviceMesh | None) -> None: ...

    def per_generation(self, key: Hashable, build: Callable[[], T]) -> T: ...

    def at_generation_end(self, release: Callable[[], None]) -> None: ...


@dataclass
class CaseContext:
    """The case a model belongs to, as seen from one rank.

    * ``mesh`` / ``group(axis)``: the DeviceMesh and per-axis process groups for the function under test
      (the default group is the whole world). The harness never shares these with its own checks.
    * ``declared``: the scenario's declared plan, i.e. what a framework believes about placements.
      It can be wrong; that is the point of several scenarios.
    * ``layout``: the true layout. A correct clip may use it (the reference does); a realistic one
      should rely on ``declared`` and its own parameter marks.
    """

    case: CaseSpec
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    groups: Mapping[str, dist.ProcessGroup]
    world: GroupSource | None = None
    extras: dict = field(default_factory=dict)  # what a target's dress() leaves for its clip call
    _declared: DeclaredPlan | None = field(default=None, init=False, repr=False)

    @property
    def layout(self) -> Layout:
        return self.case.layout

    @property
    def mesh_spec(self) -> MeshSpec:
        return self.case.layout.mesh

    @property
    def declared(self) -> DeclaredPlan:
        """A read-only copy of the variant's plan: the plan itself is shared by every target and case of
        the variant and read by the judge, so a target that "resolves" it in place (writing the
        placements it derived back into it) must not change how later targets are set up or judged."""
        if self._declared is None:
            self._declared = read_only_plan(self.case.variant.declared)
        return self._declared

    def group(self, axis: str) -> dist.ProcessGroup:
        self.mesh_spec.index(axis)  # a clear error for an unknown axis
        return self.groups[axis]

    def group_size(self, axis: str) -> int:
        return self.mesh_spec.size(axis) if self.mesh_spec.has(axis) else 1

    def group_over(self, axes: tuple[str, ...]) -> dist.ProcessGroup:
        """A process group spanning several mesh axes at once (e.g. ``(MeshAxis.EP, MeshAxis.TP)``
        for an expert model-parallel group). Built on first use and cached; every rank must ask in
        the same order."""
        assert self.world is not None, "group_over needs a harness world"
        return self.world.group_over(self.mesh_spec, axes)

    def give_case_timeout(self, *meshes: DeviceMesh | None) -> None:
        """The case's collective timeout on every group of a framework's own ``meshes``, as the harness's
        meshes have it (nothing outside a harness world)."""
        if self.world is not None:
            self.world.give_case_timeout(*meshes)

    def per_generation(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()`` once while the harness's process groups live (a framework's own groups or meshes,
        built once as a training job builds them), then the same object for every case with that
        ``key``; forgotten when the harness renews its groups. Every rank must ask in the same order
        (``build`` is usually collective)."""
        assert self.world is not None, "per_generation needs a harness world"
        return self.world.per_generation(key, build)

    def at_generation_end(self, release: Callable[[], None]) -> None:
        """Have ``release()`` run once when the harness drops its process groups: reset there whatever a
        framework keeps of them in module globals, or the dropped groups (and their threads) stay alive."""
        assert self.world is not None, "at_generation_end needs a harness world"
        self.world.at_generation_end(release)

    def param_spec(self, name: str) -> ParamSpec:
        return self.layout.param(name)

    def declared_placement(self, name: str, axis: str) -> Placement:
        return self.declared.get(name, {}).get(axis, Replicate())

    def true_replica_count(self, name: str) -> int:
        """Ranks holding the same slice of ``name`` as this rank, by the true layout."""
        return self.layout.replica_count(self.layout.param(name), self.rank)


def read_only_plan(plan: DeclaredPlan) -> DeclaredPlan:
    """``plan`` copied into mappings that refuse writes (``TypeError`` on assignment)."""
    return MappingProxyType({name: MappingProxyType(dict(axes)) for name, axes in plan.items()})


def attach(model: nn.Module, ctx: CaseContext) -> None:
    setattr(model, _ATTRIBUTE, ctx)


def context(model: nn.Module) -> CaseContext:
    """The CaseContext of a model the harness built; a clear error for any other module."""
    ctx = getattr(model, _ATTRIBUTE, None)
    if ctx is None:
        raise TypeError(
            f"{type(model).__name__} was not built by the harness: harness.context() only works on "
            "the model passed to a clip function under test"
        )
    return ctx
