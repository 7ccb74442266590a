"""What a clip is handed, parameter by parameter, on the ranks of one layout variant: told from the
variant alone, so ``clipcheck layouts`` shows it without starting a process group.

Per parameter: the gradient's kind, its local shape, the ranks that hold it, and its declared
placement on each mesh axis (what ``harness.context(model)`` tells the clip, and what a DTensor
gradient carries), beside the true one where the variant's plan lies.

The kind is decided as ``Scenario.build_model`` decides it (``cases.model.build_model``): a DTensor
variant's parameters are DTensors placed as declared, in mesh-axis order, less the ones it keeps
``plain``; every parameter of any other variant is a plain tensor holding this rank's slice; a frozen
parameter has no gradient. Two things can hand a clip something else, and the command names them
where they apply: a scenario that overrides ``build_model``, and a target's ``dress`` (a framework's
adapter sets the model up its framework's way first, from the plain model where the variant's DTensors are
that setup's own: ``Variant.dress_from_plain``). A clip of your own, given as ``module:function``, has no
``dress``: it is handed the DTensors listed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.cases.layout import Replicate
from harness.cases.variant import Variant, mesh_dim_name

DTENSOR = "DTensor"
PLAIN = "plain"
NO_GRAD = "none"


@dataclass(frozen=True)
class HandedParam:
    """One parameter as a clip meets it (placements as text: ``Shard(0)``, ``Replicate()``)."""

    name: str
    grad: str
    """``DTensor``, ``plain``, or ``none`` (a frozen parameter: no gradient)."""
    shape: tuple[int, ...]
    """The logical (global) shape."""
    local_shape: tuple[int, ...]
    """What one holding rank has (sharding is even: the same on every holder)."""
    ranks: tuple[int, ...] | None
    """The ranks that hold it; None for every rank."""
    no_grad_on: tuple[int, ...]
    """Holding ranks whose gradient is None (an expert that got no tokens)."""
    declared: dict[str, str]
    """Mesh axis -> the declared placement, every axis of the mesh in order."""
    true: dict[str, str]
    """Mesh axis -> the true placement; differs from ``declared`` only where the plan lies."""
    dtensor_mesh: tuple[str, ...] = ()
    """A DTensor's mesh dims as torch names them, where it is not the whole case mesh (``Variant.dtensor_axes``:
    FSDP's flattened mesh ``ep_ep_fsdp``, the experts' ``ep_fsdp``); empty otherwise."""

    def record(self) -> dict[str, Any]:
        """As JSON (``clipcheck layouts --json``)."""
        return {"name": self.name, "grad": self.grad, "shape": list(self.shape), "local_shape": list(self.local_shape),
                "ranks": None if self.ranks is None else list(self.ranks), "no_grad_on": list(self.no_grad_on),
                "declared": self.declared, "true": self.true, "dtensor_mesh": list(self.dtensor_mesh)}


def handed(variant: Variant) -> list[HandedParam]:
    """Every parameter of ``variant`` as a clip without a ``dress`` of its own is handed it."""
    layout, axes = variant.layout, variant.layout.mesh.names
    out = []
    for spec in layout:
        holders = sorted(spec.present_ranks) if spec.present_ranks is not None else list(range(layout.mesh.world_size))
        declared = variant.declared.get(spec.name, {})
        kind = NO_GRAD if not spec.trainable else DTENSOR if variant.dtensor and spec.name not in variant.plain \
            else PLAIN
        out.append(HandedParam(
            name=spec.name, grad=kind, shape=spec.shape,
            local_shape=layout.held_shape(spec, holders[0]) if holders else spec.shape,
            ranks=None if spec.present_ranks is None else tuple(holders),
            no_grad_on=tuple(r for r in holders if spec.trainable
                             and variant.injection.grad_is_none(layout, spec, r)),
            declared={axis: str(declared.get(axis, Replicate())) for axis in axes},
            true={axis: str(spec.placement(axis)) for axis in axes},
            dtensor_mesh=tuple(map(mesh_dim_name, variant.dtensor_axes.get(spec.name, ()))) if kind == DTENSOR
            else ()))
    return out
