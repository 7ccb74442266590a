"""The layout model: a named device mesh and the logical parameters spread over it.

A layout is the *truth* about where every logical gradient element lives. Everything the harness
measures or expects (which ranks hold a replica, how many times a value must be counted, what the
float64 norm is) is derived from it, and nothing here talks to a process group, so layouts can be
built, validated and reasoned about before any process is launched.

Conventions follow torch's DeviceMesh: mesh axes are ordered outermost first and ranks are laid out
row-major (the last axis varies fastest). A parameter names, per mesh axis, how its logical tensor is
placed along that axis: ``Shard(d)`` splits the tensor's dim ``d`` evenly over the axis's
coordinates, ``Replicate()`` gives every coordinate the same slice. Several mesh axes may shard the
same tensor dim; they nest in mesh order (``ep`` then ``ep_fsdp`` on dim 0 splits experts first).
("Axis" is always the mesh's, "dim" always the tensor's; the axis names are in ``axes.MeshAxis``.)
"""

from __future__ import annotations

import functools

import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping, Union
from harness.errors import ClipcheckInputError


class LayoutError(ClipcheckInputError):
    """A layout, mesh or case that cannot exist; raised before any process group is touched."""


@dataclass(frozen=True)
class Shard:
    """Split logical tensor dim ``dim`` evenly over the coordinates of a mesh axis."""

    dim: int

    def __str__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every coordinate of a mesh axis holds the same slice."""

    def __str__(self) -> str:
        return "Replicate()"


Placement = Union[Shard, Replicate]
Box = tuple[tuple[int, int], ...]
"""A local slice of a logical tensor: one half-open ``(start, stop)`` range per logical dim."""


@dataclass(frozen=True)
class Piece:
    """What one rank holds of a *measured* parameter (``harness.audit``), where no mesh placement says it.

    A measured layout lays every distinct gradient a job held (one replica class: the holders of
    bit-identical copies) out in one value space shared by the whole layout: the class is the range
    ``[start, start + numel)`` of that space, and each holder holds it at its own local ``shape``
    (FSDP's uneven last shard included). Two holdings with the same ``start`` are copies of each other,
    under one name or two (a weight tied between the first and the last pipeline stage); distinct
    ranges never overlap. ``source`` names the parameter the values belong to (the first name holding
    them), which is the name injection options (``zero``, ``nonfinite``) and the blame's groups
    attribute them to; ``dtype`` is the gradient's dtype where it differs from the injection's;
    ``norm``, the 2-norm the measured gradient had: the injected values are scaled to it, so a replay
    has the measured norms, per gradient, per rank and in all (``Injection.piece_values``).
    """

    source: str
    start: int
    shape: tuple[int, ...]
    dtype: str | None = None
    norm: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def box(self) -> Box:
        """Its range of the layout's value space, as a one-dim box."""
        return ((self.start, self.start + self.numel),)


@dataclass(frozen=True)
class MeshSpec:
    """Named mesh axes and their sizes; the product is the world size it needs."""

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        names = [name for name, _ in self.axes]
        if not names:
            raise LayoutError("a mesh needs at least one axis")
        if len(set(names)) != len(names):
            raise LayoutError(f"mesh axis names must be unique, got {names}")
        for name, size in self.axes:
            if not name or not name.replace("_", "").isalnum():
                raise LayoutError(f"mesh axis name {name!r} must be a non-empty identifier")
            if not isinstance(size, int) or size < 1:
                raise LayoutError(f"mesh axis {name!r} must have a positive integer size, got {size!r}")

    @classmethod
    def of(cls, **sizes: int) -> "MeshSpec":
        """``MeshSpec.of(ep=4, ep_fsdp=1)``: axes in keyword order, outermost first."""
        return cls(tuple(sizes.items()))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def size(self, axis: str) -> int:
        return self.sizes[self.index(axis)]

    def index(self, axis: str) -> int:
        try:
            return self.names.index(axis)
        except ValueError:
            raise LayoutError(f"mesh has no axis {axis!r} (axes: {', '.join(self.names)})") from None

    def has(self, axis: str) -> bool:
        return axis in self.names

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            product = " x ".join(f"{n}={s}" for n, s in self.axes)
            raise LayoutError(
                f"mesh {product} needs {self.world_size} ranks, but the world has {world_size}"
            )

    def coordinate(self, rank: int) -> tuple[int, ...]:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        coord = []
        for size in reversed(self.sizes):
            coord.append(rank % size)
            rank //= size
        return tuple(reversed(coord))

    def rank_at(self, coord: Iterable[int]) -> int:
        rank = 0
        for c, size in zip(coord, self.sizes):
            rank = rank * size + c
        return rank

    def groups(self, *axes: str) -> list[list[int]]:
        """Every process group along ``axes``: ranks that differ only in those axes' coordinates
        (one axis: its groups; several: groups spanning them, e.g. expert model parallel)."""
        along = {self.index(axis) for axis in axes}
        seen: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            key = tuple(c for a, c in enumerate(self.coordinate(rank)) if a not in along)
            seen.setdefault(key, []).append(rank)
        return list(seen.values())

    def ranks_where(self, **coords: int) -> frozenset[int]:
        """Ranks whose coordinate on each named axis equals the given value."""
        wanted = {self.index(axis): value for axis, value in coords.items()}
        return frozenset(
            r for r in range(self.world_size)
            if all(self.coordinate(r)[a] == v for a, v in wanted.items())
        )

    def ranks_on(self, axis: str, coordinates: Iterable[int]) -> frozenset[int]:
        """Ranks whose coordinate on ``axis`` is any of ``coordinates``: the ranks of some pipeline
        stages (``ranks_on("pp", (0, last))`` holds a parameter tied between the first and last)."""
        wanted = set(coordinates)
        a = self.index(axis)
        return frozenset(r for r in range(self.world_size) if self.coordinate(r)[a] in wanted)

    def describe(self) -> str:
        return " ".join(f"{name}={size}" for name, size in self.axes)


@dataclass(frozen=True)
class ParamSpec:
    """One logical parameter: its full shape and its true placement on every mesh axis.

    ``placements`` may omit mesh axes; an omitted axis means Replicate. ``present_ranks`` restricts
    the ranks that hold the parameter at all (a pipeline stage or an EP rank that owns no expert);
    ``None`` means every rank. Frozen (``trainable=False``) parameters get no gradient.

    ``pieces`` (a measured parameter, ``harness.audit``): what each rank holds, by rank (``None``: the
    rank does not hold it), instead of placements on the mesh; ``present_ranks`` is then the ranks
    holding a piece, and ``shape`` the one-dim extent of the values it owns (``Piece``).
    """

    name: str
    shape: tuple[int, ...]
    placements: tuple[tuple[str, Placement], ...] = ()
    present_ranks: frozenset[int] | None = None
    trainable: bool = True
    pieces: tuple[Piece | None, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        placements = self.placements
        if isinstance(placements, Mapping):
            placements = tuple(placements.items())
        object.__setattr__(self, "placements", tuple(placements))
        if self.pieces is not None:
            object.__setattr__(self, "pieces", tuple(self.pieces))
            object.__setattr__(self, "present_ranks",
                               frozenset(r for r, piece in enumerate(self.pieces) if piece is not None))
        if self.present_ranks is not None:
            object.__setattr__(self, "present_ranks", frozenset(self.present_ranks))

    def placement(self, axis: str) -> Placement:
        for name, placement in self.placements:
            if name == axis:
                return placement
        return Replicate()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def param(
    name: str,
    shape: Iterable[int],
    *,
    trainable: bool = True,
    present_ranks: Iterable[int] | None = None,
    **placements: Placement,
) -> ParamSpec:
    """Shorthand: ``param("experts.w", (8, 64), ep=Shard(0), ep_fsdp=Shard(1))``."""
    return ParamSpec(
        name=name,
        shape=tuple(shape),
        placements=tuple(placements.items()),
        present_ranks=None if present_ranks is None else frozenset(present_ranks),
        trainable=trainable,
    )


@dataclass(frozen=True)
class Layout:
    """A mesh and the parameters placed on it, with the derived facts the harness relies on."""

    mesh: MeshSpec
    params: tuple[ParamSpec, ...]
    _by_name: dict[str, ParamSpec] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(self.params))
        by_name: dict[str, ParamSpec] = {}
        for spec in self.params:
            if spec.name in by_name:
                raise LayoutError(f"parameter name {spec.name!r} appears twice")
            by_name[spec.name] = spec
        object.__setattr__(self, "_by_name", by_name)
        self._validate_params()
        self._validate_pieces()

    # -- validation --------------------------------------------------------------------------
    def _validate_params(self) -> None:
        for spec in self.params:
            if spec.pieces is not None:
                continue  # a measured parameter: ``_validate_pieces``
            if any(s < 0 for s in spec.shape):  # a zero-size parameter is legal (empty local gradients)
                raise LayoutError(f"parameter {spec.name!r} has a negative dim in shape {spec.shape}")
            for axis, placement in spec.placements:
                if not self.mesh.has(axis):
                    raise LayoutError(
                        f"parameter {spec.name!r} is placed on mesh axis {axis!r}, which the mesh "
                        f"does not have (mesh axes: {', '.join(self.mesh.names)})"
                    )
                if isinstance(placement, Shard) and not 0 <= placement.dim < len(spec.shape):
                    raise LayoutError(
                        f"parameter {spec.name!r}: {placement} on mesh axis {axis!r} is out of range "
                        f"for a tensor of {len(spec.shape)} dims {spec.shape}"
                    )
                if not isinstance(placement, (Shard, Replicate)):
                    raise LayoutError(f"parameter {spec.name!r}: unknown placement {placement!r}")
            self._validate_divisibility(spec)
            self._validate_presence(spec)

    def _validate_divisibility(self, spec: ParamSpec) -> None:
        extent = list(spec.shape)
        for axis, size in self.mesh.axes:
            placement = spec.placement(axis)
            if isinstance(placement, Shard):
                d = placement.dim
                if extent[d] % size:
                    raise LayoutError(
                        f"parameter {spec.name!r}: logical dim {d} has {extent[d]} elements "
                        f"(after outer shardings), not divisible by mesh axis {axis!r} of size {size}"
                    )
                extent[d] //= size

    def _validate_presence(self, spec: ParamSpec) -> None:
        if spec.present_ranks is None:
            return
        bad = sorted(r for r in spec.present_ranks if not 0 <= r < self.mesh.world_size)
        if bad:
            raise LayoutError(f"parameter {spec.name!r} is present on ranks {bad} outside the mesh")
        held = {self._box(spec, r) for r in spec.present_ranks}
        every = {self._box(spec, r) for r in range(self.mesh.world_size)}
        missing = every - held
        if missing:
            raise LayoutError(
                f"parameter {spec.name!r}: present_ranks {sorted(spec.present_ranks)} leave "
                f"{len(missing)} of its {len(every)} slices on no rank"
            )

    def _validate_pieces(self) -> None:
        """A measured layout: a piece per rank, a known source, and one class per value range."""
        ranges: dict[int, Piece] = {}
        for spec in self.params:
            if spec.pieces is None:
                continue
            if len(spec.pieces) != self.mesh.world_size:
                raise LayoutError(f"parameter {spec.name!r} has pieces for {len(spec.pieces)} ranks, "
                                  f"the mesh has {self.mesh.world_size}")
            for rank, piece in enumerate(spec.pieces):
                if piece is None:
                    continue
                if piece.start < 0 or any(s < 0 for s in piece.shape):
                    raise LayoutError(f"parameter {spec.name!r} on rank {rank}: invalid piece {piece}")
                source = self._by_name.get(piece.source)
                if source is None or source.pieces is None:
                    raise LayoutError(f"parameter {spec.name!r} on rank {rank}: its values' source "
                                      f"{piece.source!r} is not a measured parameter of the layout")
                known = ranges.setdefault(piece.start, piece)
                if (known.numel, known.source, known.norm) != (piece.numel, piece.source, piece.norm):
                    raise LayoutError(f"parameter {spec.name!r} on rank {rank}: piece {piece} starts where "
                                      f"{known} does, with other values")
        ordered = sorted((p.start, p.start + p.numel) for p in ranges.values() if p.numel)
        for (_, stop), (start, _) in zip(ordered, ordered[1:]):
            if start < stop:
                raise LayoutError(f"measured layout: value ranges overlap at {start}")

    def check_world(self, world_size: int) -> None:
        self.mesh.check_world(world_size)

    # -- lookups ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[ParamSpec]:
        return iter(self.params)

    def param(self, name: str) -> ParamSpec:
        try:
            return self._by_name[name]
        except KeyError:
            raise LayoutError(f"layout has no parameter {name!r}") from None

    @property
    def trainable(self) -> tuple[ParamSpec, ...]:
        return tuple(s for s in self.params if s.trainable)

    # -- derived facts -----------------------------------------------------------------------------
    @property
    def measured(self) -> bool:
        """A layout measured on a real job (``harness.audit``): its parameters are ``Piece``s."""
        return any(spec.pieces is not None for spec in self.params)

    def is_present(self, spec: ParamSpec, rank: int) -> bool:
        return spec.present_ranks is None or rank in spec.present_ranks

    def piece(self, spec: ParamSpec, rank: int) -> Piece | None:
        """What ``rank`` holds of a measured parameter (None: nothing, or not a measured parameter)."""
        return None if spec.pieces is None else spec.pieces[rank]

    def _box(self, spec: ParamSpec, rank: int) -> Box:
        if spec.pieces is not None:
            piece = spec.pieces[rank]
            return piece.box if piece is not None else ((0, 0),)
        coord = self.mesh.coordinate(rank)
        ranges = [[0, s] for s in spec.shape]
        for (axis, size), c in zip(self.mesh.axes, coord):
            placement = spec.placement(axis)
            if isinstance(placement, Shard):
                start, stop = ranges[placement.dim]
                step = (stop - start) // size
                ranges[placement.dim] = [start + c * step, start + (c + 1) * step]
        return tuple((a, b) for a, b in ranges)

    def local_box(self, spec: ParamSpec, rank: int) -> Box | None:
        """The slice of ``spec`` that ``rank`` holds, or None when the rank does not hold it."""
        return self._box(spec, rank) if self.is_present(spec, rank) else None

    def local_shape(self, spec: ParamSpec) -> tuple[int, ...]:
        """Local shape on any holding rank; even sharding makes it the same everywhere."""
        return box_shape(self._box(spec, 0))

    def held_shape(self, spec: ParamSpec, rank: int) -> tuple[int, ...]:
        """The shape of what ``rank`` holds of ``spec`` (a measured piece's own local shape)."""
        piece = self.piece(spec, rank)
        if piece is not None:
            return piece.shape
        box = self.local_box(spec, rank)
        if box is None:
            raise LayoutError(f"rank {rank} does not hold {spec.name!r}")
        return box_shape(box)

    def holders(self, spec: ParamSpec, box: Box) -> list[int]:
        """Ranks that hold exactly ``box`` of ``spec``: one replica group."""
        return [r for r in range(self.mesh.world_size) if self.local_box(spec, r) == box]

    def replica_count(self, spec: ParamSpec, rank: int) -> int:
        """How many ranks hold the same slice as ``rank`` (0 when ``rank`` holds none). A measured
        piece counts every holding of its values, under any name (a tied copy is one of them)."""
        piece = self.piece(spec, rank)
        if piece is not None:
            return sum(1 for other in self.params if other.pieces is not None
                       for held in other.pieces if held is not None and held.start == piece.start)
        box = self.local_box(spec, rank)
        return 0 if box is None else len(self.holders(spec, box))

    @functools.cached_property
    def replica_counts(self) -> frozenset[int]:
        """Every true replica count above 1 that some parameter has on some rank: the judge's miscount
        hypotheses are priced for these counts only. Computed once per layout (every case of a layout asks)."""
        return frozenset(count for spec in self.trainable for rank in range(self.mesh.world_size)
                         if self.is_present(spec, rank) and (count := self.replica_count(spec, rank)) > 1)

    def distinct_boxes(self, spec: ParamSpec) -> list[Box]:
        """The distinct slices of ``spec`` (of a measured parameter: the ranges of the values it owns,
        its tied copies of another parameter's values left to that parameter)."""
        boxes: dict[Box, None] = {}
        for r in range(self.mesh.world_size):
            piece = self.piece(spec, r)
            if spec.pieces is not None and (piece is None or piece.source != spec.name):
                continue
            box = self.local_box(spec, r)
            if box is not None:
                boxes.setdefault(box)
        return list(boxes)

    def describe(self) -> str:
        return self.mesh.describe()


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_contains(box: Box, index: tuple[int, ...]) -> bool:
    return all(a <= i < b for (a, b), i in zip(box, index))


def ravel(index: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """Flat row-major index of a multi-index (the inverse of ``unravel``)."""
    flat = 0
    for i, size in zip(index, shape):
        flat = flat * size + i
    return flat


def unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major multi-index of a flat logical index."""
    if not 0 <= flat < math.prod(shape):
        raise LayoutError(f"flat index {flat} is outside a tensor of shape {shape}")
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))
