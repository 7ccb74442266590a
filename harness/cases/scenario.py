"""What a scenario is: a family of layouts with a story, the clip functions that go with it, and how
its model is built, dressed with framework marks and given gradients.

Scenarios live in the top-level ``scenarios`` package, one module each; a user can also point
``--scenario`` at ``module:Class`` or ``file.py:Class``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from harness.cases.variant import Variant
from harness.cases.frameworks import Framework
from harness.cases.layout import LayoutError
from harness.cases.model import build_model, inject_grads
from harness.cases.target import Target


@dataclass(frozen=True)
class ScenarioOptions:
    """Knobs shared by all scenarios. ``ep_sizes=None`` means every valid expert-parallel size."""

    seed: int = 0
    dtype: str = "fp32"
    ep_sizes: tuple[int, ...] | None = None


class Scenario(ABC):
    name: ClassVar[str]
    summary: ClassVar[str]
    uses_ep: ClassVar[bool] = False
    default_targets: ClassVar[tuple[str, ...]] = ("reference",)
    default_norm_types: ClassVar[tuple[float, ...]] = (2.0,)
    targets: ClassVar[Mapping[str, Target]] = {}
    requires: ClassVar[Framework | None] = None  # a framework the model is built with, if any

    @abstractmethod
    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        """Every layout variant at this world size; raise LayoutError for impossible options."""

    def build_model(self, variant: Variant, rank: int, device: torch.device, mesh: DeviceMesh) -> nn.Module:
        return build_model(
            variant.layout,
            variant.injection,
            rank,
            device,
            mesh=mesh,
            dtensor_placements=variant.declared if variant.dtensor else None,
            plain=variant.plain,
            dtensor_axes=variant.dtensor_axes,
        )

    def dress(self, model: nn.Module, variant: Variant) -> None:
        """Mark parameters the way the modelled framework does (e.g. DeepSpeed's allreduce=False)."""

    def inject(self, model: nn.Module, variant: Variant, rank: int) -> None:
        inject_grads(model, variant.layout, variant.injection, rank)


def ep_sizes_for(scenario: str, world_size: int, num_experts: int, requested: tuple[int, ...] | None) -> list[int]:
    """Requested EP sizes, validated; or every size that divides both the world and the experts."""
    if requested is None:
        return [k for k in range(1, world_size + 1) if world_size % k == 0 and num_experts % k == 0]
    for k in requested:
        if k < 1:
            raise LayoutError(f"ep_size must be positive, got {k}")
        if world_size % k:
            raise LayoutError(f"{scenario}: ep_size {k} does not divide the world size {world_size}")
        if num_experts % k:
            raise LayoutError(f"{scenario}: {num_experts} experts are not divisible by ep_size {k}")
    return list(requested)
