"""Gradient injection with a known replication structure.

``Injection`` says what every logical gradient element is; ``local_grad`` gives one rank its slice.
Options act on *logical* elements or on whole replica groups, never on a single rank's copy, so a
true replica is always bit-identical to its peers:

* ``none_on``: ranks whose gradient is ``None`` (an expert that got no tokens). A listed rank stands
  for its whole replica group: every rank holding the same slice gets ``None`` too, and the logical
  gradient of that slice is zero.
* ``zero``: parameters whose gradient is all zeros (present, not ``None``).
* ``nonfinite``: (parameter, flat logical index, "nan" | "inf" | "-inf") elements.
* ``scale``: a multiplier applied before the cast to ``dtype``, on top of each parameter's own
  magnitude (``values.magnitude``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from harness.cases.layout import Box, Layout, LayoutError, ParamSpec, box_contains, unravel
from harness.cases.values import box_values, magnitude

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}
NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@dataclass(frozen=True)
class Injection:
    """What the gradients are. Same on every rank; a pure description, cheap to pickle."""

    seed: int = 0
    dtype: str = "fp32"
    scale: float = 1.0
    zero: frozenset[str] = frozenset()
    none_on: tuple[tuple[str, frozenset[int]], ...] = ()
    nonfinite: tuple[tuple[str, int, str], ...] = ()
    _none: dict[str, frozenset[int]] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise LayoutError(f"unknown dtype {self.dtype!r} (known: {', '.join(DTYPES)})")
        if not math.isfinite(self.scale):
            raise LayoutError(f"scale must be finite, got {self.scale}")
        object.__setattr__(self, "zero", frozenset(self.zero))
        none_on = self.none_on.items() if isinstance(self.none_on, Mapping) else self.none_on
        none_on = tuple(sorted((n, frozenset(r)) for n, r in none_on))
        object.__setattr__(self, "none_on", none_on)
        object.__setattr__(self, "nonfinite", tuple(tuple(x) for x in self.nonfinite))
        for _, _, kind in self.nonfinite:
            if kind not in NONFINITE:
                raise LayoutError(f"nonfinite kind must be one of {list(NONFINITE)}, got {kind!r}")
        object.__setattr__(self, "_none", dict(none_on))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def validate(self, layout: Layout) -> None:
        """Every option must name a trainable parameter of the layout and a real element."""
        names = {s.name for s in layout.trainable}
        for name in list(self.zero) + list(self._none) + [n for n, _, _ in self.nonfinite]:
            if name not in names:
                raise LayoutError(f"injection names {name!r}, which is not a trainable parameter")
        for name, ranks in self._none.items():
            bad = sorted(r for r in ranks if not 0 <= r < layout.mesh.world_size)
            if bad:
                raise LayoutError(f"injection: no-grad ranks {bad} for {name!r} are outside the mesh")
        for name, flat, _ in self.nonfinite:
            unravel(flat, layout.param(name).shape)

    # -- which slices have no gradient ------------------------------------------------------------
    def none_boxes(self, layout: Layout, spec: ParamSpec) -> set[Box]:
        ranks = self._none.get(spec.name, frozenset())
        boxes = {layout.local_box(spec, r) for r in ranks}
        return {b for b in boxes if b is not None}

    def grad_is_none(self, layout: Layout, spec: ParamSpec, rank: int) -> bool:
        if not spec.trainable:
            return True
        box = layout.local_box(spec, rank)
        return box is None or box in self.none_boxes(layout, spec)

    # -- values ---------------------------------------------------------------------------------------
    def values(self, spec: ParamSpec, box: Box) -> torch.Tensor:
        """float64 values of ``box`` exactly as they will be after the cast to ``dtype``."""
        if spec.name in self.zero:
            values = torch.zeros(tuple(b - a for a, b in box), dtype=torch.float64)
        else:
            scale = magnitude(self.seed, spec.name) * self.scale
            values = box_values(self.seed, spec.name, spec.shape, box) * scale
        for name, flat, kind in self.nonfinite:
            if name != spec.name:
                continue
            index = unravel(flat, spec.shape)
            if box_contains(box, index):
                values[tuple(i - a for i, (a, _) in zip(index, box))] = NONFINITE[kind]
        return values.to(self.torch_dtype).to(torch.float64)


def local_grad(
    layout: Layout, injection: Injection, spec: ParamSpec, rank: int
) -> torch.Tensor | None:
    """This rank's gradient for ``spec`` in the injection's dtype, or None."""
    if injection.grad_is_none(layout, spec, rank):
        return None
    box = layout.local_box(spec, rank)
    assert box is not None
    return injection.values(spec, box).to(injection.torch_dtype)


def logical_grad(layout: Layout, injection: Injection, spec: ParamSpec) -> torch.Tensor:
    """The whole logical gradient in float64: what the global norm must count exactly once.

    Built slice by slice from the distinct slices the layout defines, with no-grad slices zero.
    """
    out = torch.zeros(spec.shape, dtype=torch.float64)
    if not spec.trainable:
        return out
    none = injection.none_boxes(layout, spec)
    for box in layout.distinct_boxes(spec):
        if box in none:
            continue
        out[tuple(slice(a, b) for a, b in box)] = injection.values(spec, box)
    return out

