"""Gradient injection with a known replication structure.

``Injection`` says what every logical gradient element is; ``local_grad`` gives one rank its slice.
Options act on *logical* elements or on whole replica groups, never on a single rank's copy, so a
true replica is always bit-identical to its peers:

* ``none_on``: ranks whose gradient is ``None`` (an expert that got no tokens). A listed rank stands
  for its whole replica group: every rank holding the same slice gets ``None`` too, and the logical
  gradient of that slice is zero.
* ``zero``: parameters whose gradient is all zeros (present, not ``None``).
* ``zero_on``: ranks whose gradient of a parameter is all zeros (present, not ``None``): an expert
  whose FSDP shard got no tokens on some ranks; like ``none_on``, a listed rank stands for its
  replica group.
* ``nonfinite``: (parameter, flat logical index, "nan" | "inf" | "-inf") elements.
* ``scale``: a multiplier applied before the cast to ``dtype``, on top of each parameter's own
  magnitude (``values.magnitude``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from harness.cases.layout import Box, Layout, LayoutError, ParamSpec, Piece, box_contains, unravel
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
    zero_on: tuple[tuple[str, frozenset[int]], ...] = ()
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
        zero_on = self.zero_on.items() if isinstance(self.zero_on, Mapping) else self.zero_on
        object.__setattr__(self, "zero_on", tuple(sorted((n, frozenset(r)) for n, r in zero_on)))
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
        zero_on = [n for n, _ in self.zero_on]
        for name in list(self.zero) + list(self._none) + zero_on + [n for n, _, _ in self.nonfinite]:
            if name not in names:
                raise LayoutError(f"injection names {name!r}, which is not a trainable parameter")
        for name, ranks in [*self._none.items(), *self.zero_on]:
            bad = sorted(r for r in ranks if not 0 <= r < layout.mesh.world_size)
            if bad:
                raise LayoutError(f"injection: ranks {bad} for {name!r} are outside the mesh")
        for name, flat, _ in self.nonfinite:
            spec = layout.param(name)
            if spec.pieces is None:
                unravel(flat, spec.shape)
            elif not any(box_contains(box, (flat,)) for box in layout.distinct_boxes(spec)):
                raise LayoutError(f"injection: element {flat} is not among the values of {name!r}")
        for spec in layout:
            for piece in spec.pieces or ():
                if piece is not None and piece.dtype is not None and piece.dtype not in DTYPES:
                    raise LayoutError(f"parameter {spec.name!r}: unknown dtype {piece.dtype!r}")

    # -- which slices have no gradient ------------------------------------------------------------
    def none_boxes(self, layout: Layout, spec: ParamSpec) -> set[Box]:
        ranks = self._none.get(spec.name, frozenset())
        boxes = {layout.local_box(spec, r) for r in ranks}
        return {b for b in boxes if b is not None}

    def zero_boxes(self, layout: Layout, spec: ParamSpec) -> set[Box]:
        """The slices of ``spec`` whose gradient is all zeros (``zero_on``); of a measured layout, every
        listed range (a range is one replica class, under whichever name it is held)."""
        entries = self.zero_on if layout.measured else [(n, r) for n, r in self.zero_on if n == spec.name]
        boxes = {layout.local_box(layout.param(name), r) for name, ranks in entries for r in ranks}
        return {b for b in boxes if b is not None}

    def torch_dtype_of(self, piece: Piece | None) -> torch.dtype:
        """The dtype of a measured piece's gradient (the injection's own, unless the piece says)."""
        return DTYPES[piece.dtype] if piece is not None and piece.dtype is not None else self.torch_dtype

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

    def piece_values(self, layout: Layout, piece: Piece) -> torch.Tensor:
        """float64 values of a measured piece at its local shape, as they will be after the cast to its
        dtype: its source's value stream at the piece's range of the layout's value space (so every
        holding of a range, under any name, gets the same bits), zero where ``zero``/``zero_on`` say."""
        start, stop = piece.box[0]
        source = layout.param(piece.source)
        if piece.source in self.zero or piece.box in self.zero_boxes(layout, source):
            values = torch.zeros(stop - start, dtype=torch.float64)
        else:
            scale = magnitude(self.seed, piece.source) * self.scale
            values = box_values(self.seed, piece.source, (stop,), piece.box) * scale
            if piece.norm is not None and math.isfinite(piece.norm) and values.numel():
                values = values * (piece.norm / float(torch.linalg.vector_norm(values)))
        for name, flat, kind in self.nonfinite:
            if name == piece.source and start <= flat < stop:
                values[flat - start] = NONFINITE[kind]
        return values.to(self.torch_dtype_of(piece)).to(torch.float64).reshape(piece.shape)


def local_grad(
    layout: Layout, injection: Injection, spec: ParamSpec, rank: int
) -> torch.Tensor | None:
    """This rank's gradient for ``spec`` in the injection's dtype, or None."""
    if injection.grad_is_none(layout, spec, rank):
        return None
    piece = layout.piece(spec, rank)
    if piece is not None:
        return injection.piece_values(layout, piece).to(injection.torch_dtype_of(piece))
    box = layout.local_box(spec, rank)
    assert box is not None
    values = injection.values(spec, box)
    if box in injection.zero_boxes(layout, spec):
        values = torch.zeros_like(values)
    return values.to(injection.torch_dtype)


def logical_grad(layout: Layout, injection: Injection, spec: ParamSpec) -> torch.Tensor:
    """The whole logical gradient in float64: what the global norm must count exactly once.

    Built slice by slice from the distinct slices the layout defines, with no-grad slices zero. A
    measured parameter's: the values it owns, one range after the other (its tied copies of another
    parameter's values are that parameter's).
    """
    none = injection.none_boxes(layout, spec)
    if spec.pieces is not None:
        owned = {piece.start: piece for piece in spec.pieces
                 if piece is not None and piece.source == spec.name and piece.box not in none}
        parts = [injection.piece_values(layout, owned[start]).reshape(-1) for start in sorted(owned)]
        return torch.cat(parts) if parts and spec.trainable else torch.zeros(0, dtype=torch.float64)
    out = torch.zeros(spec.shape, dtype=torch.float64)
    if not spec.trainable:
        return out
    zero = injection.zero_boxes(layout, spec)
    for box in layout.distinct_boxes(spec):
        if box in none or box in zero:
            continue
        out[tuple(slice(a, b) for a, b in box)] = injection.values(spec, box)
    return out

