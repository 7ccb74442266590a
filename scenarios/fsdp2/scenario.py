"""Parameters wrapped by torch FSDP2 (``fully_shard``) on CPU meshes, clipped by stock torch.

* ``fsdp``: one flat mesh over all ranks, every parameter sharded on dim 0 (the control).
* ``hsdp``: a 2-D ``(dp_replicate, dp_shard)`` mesh; FSDP shards over ``dp_shard`` and replicates
  over ``dp_replicate``. All gradients share one mesh, so stock clipping is exact.
* ``fsdp nan on last rank``: the ``fsdp`` layout with one NaN in the last rank's shard: an L2 clip
  keeps it (a NaN survives a SUM); torch's inf-norm clip reduces its ``Partial(max)`` norm with a
  float MAX that drops it (gloo keeps a NaN only where rank 0 holds it).
* ``mixed meshes``: dense parameters FSDP-sharded over all ranks, experts (already EP-local) sharded
  by FSDP on their ``ep_fsdp`` sub-mesh, as xorl and VeOmni wrap them. Stock ``clip_grad_norm_``
  cannot combine DTensors from two meshes and raises; the harness reports that error as the case's
  outcome (torch issue #180346).

A clip of the user's is handed what ``fully_shard`` hands it: every gradient a DTensor on its unit's mesh
(``unit_meshes``), with FSDP's placements.

``Variant.info`` (an ``FsdpWrapping``) says how the model is wrapped: its units, inner first, each a
module path, the mesh it shards over and the tensor dim it shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.cases.axes import MeshAxis
from harness.cases.variant import DTensorAxes, Variant, declared_from_layout
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, Replicate, Shard, param
from harness.cases.scenario import Scenario, ScenarioOptions

ROWS_PER_RANK, COLS, EXPERTS = 4, 12, 4

WORLD, CASE = "world", "case"
"""Unit meshes that are not one axis of the case mesh: a flat mesh over all ranks, or the case's own
(2-D, HSDP) mesh."""


@dataclass(frozen=True)
class FsdpUnit:
    """One ``fully_shard`` call: the module (``""`` the root), its mesh (``WORLD``, ``CASE`` or an axis
    of the case mesh) and the tensor dim FSDP shards its parameters on."""

    path: str
    mesh: str
    shard_dim: int


@dataclass(frozen=True)
class FsdpWrapping:
    units: tuple[FsdpUnit, ...]  # inner units first, as a training script wraps them


def unit_meshes(layout: Layout, units: tuple[FsdpUnit, ...]) -> DTensorAxes:
    """Each parameter's DTensor mesh as ``fully_shard`` builds it, as the case mesh's axes it spans: a unit on
    ``WORLD`` is one flattened dim of every axis, one on an axis that axis alone; on ``CASE`` the whole mesh
    (left unnamed). A parameter belongs to the innermost unit whose path contains it."""
    axes = layout.mesh.names
    out: dict[str, tuple[tuple[str, ...], ...]] = {}
    for spec in layout.trainable:
        unit = next(u for u in units if not u.path or spec.name.startswith(u.path + "."))
        if unit.mesh == WORLD and len(axes) > 1:
            out[spec.name] = (tuple(axes),)
        elif unit.mesh not in (WORLD, CASE):
            out[spec.name] = ((unit.mesh,),)
    return out


class FSDP2Meshes(Scenario):
    name = "fsdp2_meshes"
    summary = "torch FSDP2 (fully_shard) on one mesh, on an HSDP mesh, and on mixed dense/expert meshes"
    default_targets = ("torch-fsdp2", "reference")
    default_norm_types = (2.0, float("inf"))

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        injection = Injection(seed=options.seed, dtype=options.dtype)
        rows = ROWS_PER_RANK * world_size
        out = []

        def add(label: str, layout: Layout, units: tuple[FsdpUnit, ...], key: str | None,
                values: Injection = injection) -> None:
            out.append(Variant(label=f"{layout.describe()} {label}", layout=layout, injection=values,
                               declared=declared_from_layout(layout), invariance_key=key,
                               info=FsdpWrapping(units), dtensor=True, dtensor_axes=unit_meshes(layout, units),
                               dress_from_plain=True))

        flat = MeshSpec.of(dp=world_size)
        fsdp = Layout(flat, (
            param("layers.0.weight", (rows, COLS), dp=Shard(0)),
            param("layers.0.bias", (rows,), dp=Shard(0)),
            param("layers.1.weight", (rows, COLS), dp=Shard(0)),
        ))
        add("fsdp", fsdp, (FsdpUnit("", WORLD, 0),), "fsdp2-dense")
        if world_size > 1:  # the first element of the last row: the last rank's shard under Shard(0)
            nan = Injection(seed=options.seed, dtype=options.dtype,
                            nonfinite=(("layers.0.weight", (rows - 1) * COLS, "nan"),))
            add("fsdp nan on last rank", fsdp, (FsdpUnit("", WORLD, 0),), None, nan)
        if world_size % 2 == 0:
            shard = world_size // 2
            hsdp = MeshSpec.of(dp_replicate=2, dp_shard=shard)
            add("hsdp", Layout(hsdp, tuple(
                param(name, shape, dp_replicate=Replicate(), dp_shard=Shard(0))
                for name, shape in (("layers.0.weight", (rows, COLS)), ("layers.0.bias", (rows,)),
                                    ("layers.1.weight", (rows, COLS)))
            )), (FsdpUnit("", CASE, 0),), "fsdp2-dense")
            ep = 2
            mixed = MeshSpec.of(ep=ep, ep_fsdp=world_size // ep)
            both: dict[str, Any] = {MeshAxis.EP: Shard(0), MeshAxis.EP_FSDP: Shard(0)}  # the flat world mesh
            add("mixed meshes", Layout(mixed, (
                param("layers.0.weight", (rows, COLS), **both),
                param("layers.0.bias", (rows,), **both),
                param("moe.experts.w1", (EXPERTS, 2 * world_size, COLS), ep=Shard(0), ep_fsdp=Shard(1)),
            )), (FsdpUnit("moe.experts", MeshAxis.EP_FSDP, 1), FsdpUnit("", WORLD, 0)), "fsdp2-mixed")
        return out
