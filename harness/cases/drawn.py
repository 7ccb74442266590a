"""What the fuzzer draws, as plain data: a layout variant with its norm type, bound and world size, and
the scenario such cases belong to. Defined apart from the strategies that draw them (which need
hypothesis) so that a replay blob decodes without hypothesis installed."""

from __future__ import annotations

from dataclasses import dataclass

from harness.cases.scenario import Scenario, ScenarioOptions
from harness.cases.variant import Variant


@dataclass(frozen=True)
class DrawnCase:
    """A drawn layout variant, norm type and clip bound (the target is chosen by the caller)."""

    variant: Variant
    norm_type: float
    max_norm: float
    world_size: int


class DrawnScenario(Scenario):
    """The scenario drawn cases belong to: the generic model, no framework dressing."""

    name = "fuzz"
    summary = "layouts drawn by hypothesis (harness.strategies)"

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        return []
