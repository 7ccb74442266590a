"""Dense parameters over data parallelism: the control every clip function should pass.

Layouts of the same logical gradients: fully replicated over ``dp`` (plain DDP), sharded on dim 0
over ``dp`` (FSDP), and the FSDP layout again with DTensor parameters. All hold the same unique
gradients, so any correct clip gives them the same norm and coefficient. The naive ``torch`` target
passes the first and fails the others with the rank-local signature, which makes this scenario the
simplest positive control for the harness.

A last variant puts one NaN into the FSDP layout: it lives on one rank only, so a clip must share the
non-finite verdict across ranks (a rank-local clip reports NaN on one rank and a number on the rest).
"""

from __future__ import annotations

from harness.case import Variant, declared_from_layout
from harness.injection import Injection
from harness.layout import Layout, MeshSpec, Shard, param
from harness.scenario import Scenario, ScenarioOptions

LAYERS = 3


def _width(world_size: int) -> int:
    return 32 if 32 % world_size == 0 else 8 * world_size


class DenseDP(Scenario):
    name = "dense_dp"
    summary = "dense params replicated over DP (control) and FSDP-sharded over DP"
    default_targets = ("reference", "torch", "torch-dtensor")

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        width = _width(world_size)
        mesh = MeshSpec.of(dp=world_size)
        nan_at = [("layers.0.weight", width + 1, "nan")]
        layouts = (
            ("replicated", {}, False, ()),
            ("fsdp", {"dp": Shard(0)}, False, ()),
            ("fsdp dtensor", {"dp": Shard(0)}, True, ()),
            ("fsdp nonfinite", {"dp": Shard(0)}, False, nan_at),
        )
        out = []
        for label, placement, dtensor, nonfinite in layouts:
            specs = []
            for i in range(LAYERS):
                specs.append(param(f"layers.{i}.weight", (width, width), **placement))
                specs.append(param(f"layers.{i}.bias", (width,), **placement))
            layout = Layout(mesh, tuple(specs))
            out.append(
                Variant(
                    label=f"dp={world_size} {label}",
                    layout=layout,
                    injection=Injection(seed=options.seed, dtype=options.dtype, nonfinite=nonfinite),
                    declared=declared_from_layout(layout),
                    invariance_key=f"dense-{width}{'-nonfinite' if nonfinite else ''}",
                    dtensor=dtensor,
                )
            )
        return out
