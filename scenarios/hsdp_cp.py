"""Replicated axes beside a sharded one: HSDP (``dp_replicate`` x ``dp_shard``) with context parallel.

Mesh ``(dp_replicate, dp_shard, cp)``. FSDP shards the matrices on dim 0 over ``dp_shard``; every
rank of a ``dp_replicate`` group holds the same shard (HSDP's replicas), and every rank of a ``cp``
group holds the same, all-reduced gradient (context parallel splits the sequence, not the
parameters). A correct clip counts each replica once: summing over the whole data-parallel world
over-counts by sqrt(dp_replicate) (VeOmni #184, PRs #185 and #862) and summing over ``cp`` by
sqrt(cp). The layout with both replicated axes of size 1 is the plain-FSDP control; all of them hold
the same logical gradients. A clip is handed DTensors on the ``(dp_replicate, dp_shard)`` mesh, as
``fully_shard`` hands them (the norms ``Replicate`` on both: kept whole, as ``replicate`` keeps them).
"""

from __future__ import annotations

from typing import Any

from harness.cases.axes import MeshAxis
from harness.cases.variant import Variant, declared_from_layout
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, Shard, param
from harness.cases.scenario import Scenario, ScenarioOptions

WIDTH, LAYERS = 16, 3
FSDP_MESH = ((MeshAxis.DP_REPLICATE,), (MeshAxis.DP_SHARD,))
"""The mesh every parameter's DTensor lives on, as ``fully_shard`` on an HSDP mesh builds it: context parallel
splits the sequence, not the parameters, so ``cp`` is not one of its dims (its replicas hold the same DTensor)."""
REPLICA_SIZES = (1, 2)  # dp_replicate and cp sizes tried, where they divide the world


def _layout(replicate: int, shard: int, cp: int) -> Layout:
    mesh = MeshSpec.of(dp_replicate=replicate, dp_shard=shard, cp=cp)
    fsdp: dict[str, Any] = {MeshAxis.DP_SHARD: Shard(0)}
    specs = []
    for i in range(LAYERS):
        specs.append(param(f"layers.{i}.weight", (WIDTH, WIDTH), **fsdp))
        specs.append(param(f"layers.{i}.norm.weight", (WIDTH,)))
    return Layout(mesh, tuple(specs))


class HsdpCp(Scenario):
    name = "hsdp_cp"
    summary = "HSDP replicas (dp_replicate) and context-parallel replicas (cp) beside an FSDP-sharded axis"
    default_targets = ("reference", "torch")
    default_norm_types = (2.0, float("inf"))

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        injection = Injection(seed=options.seed, dtype=options.dtype)
        out = []
        for replicate in REPLICA_SIZES:
            for cp in REPLICA_SIZES:
                if world_size % (replicate * cp) or WIDTH % (world_size // (replicate * cp)):
                    continue
                layout = _layout(replicate, world_size // (replicate * cp), cp)
                label = "fsdp control" if replicate == cp == 1 else "replicas"
                out.append(Variant(label=f"{layout.mesh.describe()} {label}", layout=layout, injection=injection,
                                   declared=declared_from_layout(layout), invariance_key="hsdp-cp", dtensor=True,
                                   dtensor_axes={s.name: FSDP_MESH for s in layout.trainable}))
        return out


SCENARIO = HsdpCp
TARGETS = ()
FRAMEWORK = None
