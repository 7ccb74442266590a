"""Dense parameters over data parallelism: the control every clip function should pass.

Layouts of the same logical gradients: fully replicated over ``dp`` (plain DDP), sharded on dim 0
over ``dp`` (FSDP), and the FSDP layout again with DTensor parameters. All hold the same unique
gradients, so any correct clip gives them the same norm and coefficient. The naive ``torch`` target
passes the first and fails the others with the rank-local signature, which makes this scenario the
simplest positive control for the harness.

Non-finite variants put one NaN (on rank 0, and on the last rank) or one inf (on the last rank) into
the FSDP layout: it lives on one rank only, so a clip must share the non-finite verdict across ranks
(a rank-local clip reports NaN on one rank and a number on the rest), and where it sits matters:
gloo's float MAX keeps a NaN only when rank 0 holds it, so an inf-norm clip that merges maxima with a
plain MAX reports a finite norm when the NaN is elsewhere. Every variant runs with L2 and inf.

``stage on rank 0``: every parameter lives on rank 0 only (a pipeline stage), so the other ranks hold
no gradient at all and must still report the global norm (torch's ``if not grads: return 0.``).
"""

from __future__ import annotations

from typing import Any, Sequence

from harness.cases.axes import MeshAxis
from harness.cases.variant import Variant, declared_from_layout
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, Shard, param
from harness.cases.scenario import Scenario, ScenarioOptions

LAYERS = 3


def dense_width(world_size: int) -> int:
    return 32 if 32 % world_size == 0 else 8 * world_size


class DenseDP(Scenario):
    name = "dense_dp"
    summary = "dense params replicated over DP (control) and FSDP-sharded over DP"
    default_targets = ("reference", "torch", "torch-dtensor")
    default_norm_types = (2.0, float("inf"))

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        width = dense_width(world_size)
        mesh = MeshSpec.of(dp=world_size)
        last_row = width * width - 2  # an element of the last rank's shard under Shard(0)
        fsdp: dict[str, Any] = {MeshAxis.DP: Shard(0)}
        layouts: list[tuple[str, dict[str, Any], bool, Sequence[tuple[str, int, str]], frozenset[int] | None]] = [
            ("replicated", {}, False, (), None),
            ("fsdp", fsdp, False, (), None),
            ("fsdp dtensor", fsdp, True, (), None),
            ("fsdp nonfinite", fsdp, False, [("layers.0.weight", width + 1, "nan")], None),
            ("fsdp nan on last rank", fsdp, False, [("layers.0.weight", last_row, "nan")], None),
            ("fsdp inf on last rank", fsdp, False, [("layers.1.weight", last_row, "inf")], None),
        ]
        if world_size > 1:
            layouts.append(("stage on rank 0", {}, False, (), frozenset({0})))
        out = []
        for label, placement, dtensor, nonfinite, present in layouts:
            specs = []
            for i in range(LAYERS):
                specs.append(param(f"layers.{i}.weight", (width, width), present_ranks=present, **placement))
                specs.append(param(f"layers.{i}.bias", (width,), present_ranks=present, **placement))
            layout = Layout(mesh, tuple(specs))
            out.append(
                Variant(
                    label=f"dp={world_size} {label}",
                    layout=layout,
                    injection=Injection(seed=options.seed, dtype=options.dtype, nonfinite=tuple(nonfinite)),
                    declared=declared_from_layout(layout),
                    invariance_key=f"dense-{width}" if not nonfinite else None,
                    dtensor=dtensor,
                )
            )
        return out


SCENARIO = DenseDP
TARGETS = ()  # torch's own clips are built-in targets
FRAMEWORK = None
