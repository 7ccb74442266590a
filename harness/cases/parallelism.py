"""The kinds of parallelism a layout is built from: ``ddp``, ``fsdp``, ``hsdp``, ``ep``, ``tp``, ``pp``,
``cp``, the same names across every scenario, whatever its framework calls its mesh axes (xorl's
``ep_fsdp``, torchtitan's ``efsdp`` and ``dp_shard_cp``, DeepSpeed's ``edp``).

A clip is written for some of them (EP + FSDP2, say); ``--parallelism ep,fsdp`` keeps the layouts
built from those kinds only, so layouts it was never written for (HSDP, TP, PP) are not counted
against it. One function decides (``parallelism_of``), from the mesh and the true placements alone,
so the planner, ``clipcheck layouts`` and the tests agree. The rule, axis by axis, where only axes of
size > 1 count (an axis of one coordinate parallelizes nothing):

* ``ep``, ``tp``, ``pp``, ``cp``: the kind of that name;
* a data-parallel axis (``DATA_AXES``): what a clip is handed there decides, not the name: ``fsdp``
  when some parameter is sharded over the axis, ``ddp`` when every parameter is replicated on it
  (``dense_dp``'s one ``dp`` axis is either, by variant); a replicating data axis together with a
  sharding one is ``hsdp`` (torchtitan's ``dp_replicate`` x ``dp_shard``), instead of ddp + fsdp;
* ``world`` (a layout ``harness.audit`` measured on a job whose mesh it does not know) and any name
  not above (a user's own scenario): no kind. The axis is listed as unknown, and the layout is kept
  only when no parallelism is selected: nothing shows that it is within a selection, and guessing
  from a name would keep or drop it silently. Name the axes with ``MeshAxis`` members to classify them.

A layout with no axis of size > 1 (world 1) has no kinds and is within every selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable

from harness.cases.axes import MeshAxis
from harness.cases.layout import Layout, LayoutError, Shard

KINDS: tuple[str, ...] = ("ddp", "fsdp", "hsdp", "ep", "tp", "pp", "cp")
"""The canonical kinds, in the order labels list them."""

NAMED_AXES: dict[str, str] = {MeshAxis.EP: "ep", MeshAxis.TP: "tp", MeshAxis.PP: "pp", MeshAxis.CP: "cp"}
"""Axes whose name is their kind."""

DATA_AXES: frozenset[str] = frozenset({MeshAxis.DP, MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, MeshAxis.DP_SHARD_CP,
                                       MeshAxis.FSDP, MeshAxis.EP_FSDP, MeshAxis.EFSDP, MeshAxis.EDP})
"""Data-parallel axes: ddp, fsdp or hsdp by their placements."""

UNCLASSIFIED_AXES: frozenset[str] = frozenset({MeshAxis.WORLD})
"""Known axes with no kind: a measured job's one axis says nothing of how the job was parallel."""


@dataclass(frozen=True)
class Parallelism:
    """A layout's kinds, and the axes of size > 1 whose name says no kind (``unknown``)."""

    kinds: frozenset[str]
    unknown: tuple[str, ...] = ()

    def within(self, selected: Collection[str]) -> bool:
        """Whether a selection of kinds keeps the layout: its kinds are a subset, and none is unknown."""
        return not self.unknown and self.kinds <= set(selected)

    @property
    def names(self) -> list[str]:
        """The kinds in canonical order."""
        return [kind for kind in KINDS if kind in self.kinds]

    @property
    def label(self) -> str:
        """``ep+fsdp``; ``none`` for a layout without parallelism; an unknown axis as ``?name``."""
        return "+".join([*self.names, *(f"?{axis}" for axis in self.unknown)]) or "none"


def parallelism_of(layout: Layout) -> Parallelism:
    """The kinds ``layout`` is built from (the rule: this module's docstring)."""
    kinds: set[str] = set()
    unknown: list[str] = []
    data: list[bool] = []  # per data axis of size > 1: whether some parameter is sharded over it
    for axis, size in layout.mesh.axes:
        if size <= 1:
            continue
        if axis in NAMED_AXES:
            kinds.add(NAMED_AXES[axis])
        elif axis in DATA_AXES:
            data.append(any(isinstance(spec.placement(axis), Shard) for spec in layout))
        else:
            unknown.append(axis)
    if any(data) and not all(data):
        kinds.add("hsdp")
    elif data:
        kinds.add("fsdp" if data[0] else "ddp")
    return Parallelism(frozenset(kinds), tuple(unknown))


def check_kinds(kinds: Iterable[str]) -> None:
    """Raise ``LayoutError`` (one line, listing the valid kinds) for a kind that is not canonical."""
    for kind in kinds:
        if kind not in KINDS:
            raise LayoutError(f"unknown parallelism kind {kind!r} (valid: {', '.join(KINDS)})")
