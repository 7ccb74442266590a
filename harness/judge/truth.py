"""Ground truth, two independent ways, as pure functions of what the ranks measured.

*Measured*: each rank's per-parameter statistics (``harness.run.case.measure``) weighted by the
replication the raw bits showed: a slice replicated k times counts 1/k.

*Constructive*: the float64 norm of the logical gradients, from the value generator alone, with no
communication at all (``harness.cases.constructive``: planning needs it too, to set the bounds).

The two must agree (within ``CROSS_CHECK_RTOL``). When they do not, the harness itself (or its
injection) is wrong, and the case is reported as a harness error rather than blamed on the function
under test.
"""

from __future__ import annotations

import math
from typing import Mapping

from harness.clipmath import combine, is_inf_norm, root
from harness.judge.records import Replication, StatsTable
from harness.cases.layout import MeshSpec, Replicate

CROSS_CHECK_RTOL = 1e-9
"""How closely the measured and the constructive truth must agree (both are float64 sums)."""


RankParam = tuple[int, int]
"""(rank, parameter index) of one gradient a rank holds."""

Copies = list[list[tuple[RankParam, ...]]]
"""Per rank and parameter: every holding of the same logical gradient (itself included; empty where the rank
holds no gradient for the parameter)."""


def axis_copies(
    stats: StatsTable, mesh: MeshSpec, replicated_axes: Mapping[str, frozenset[str]]
) -> Copies:
    """Per rank and parameter: every holding of the same logical slice (its copies, itself included; empty
    where the rank holds no gradient). The copies of rank r's slice are the ranks that hold a gradient for
    the parameter and share r's coordinates on all axes it is *not* replicated on."""
    coords = [mesh.coordinate(r) for r in range(stats.world_size)]
    out: Copies = [[() for _ in stats.names] for _ in range(stats.world_size)]
    for j, name in enumerate(stats.names):
        keep = [a for a, axis in enumerate(mesh.names) if axis not in replicated_axes[name]]
        for r in range(stats.world_size):
            if stats.present(r, j):
                key = tuple(coords[r][a] for a in keep)
                out[r][j] = tuple((q, j) for q in range(stats.world_size)
                                  if stats.present(q, j) and tuple(coords[q][a] for a in keep) == key)
    return out


def class_copies(stats: StatsTable, replication: Replication) -> Copies:
    """Per rank and parameter: every holding of the same class of bits (``Replication.classes``: a measured
    layout's), under any name; a holding without a class key is its own only copy."""
    classes = replication.classes or {}
    members: dict[str, list[RankParam]] = {}
    for j, name in enumerate(stats.names):
        for r, key in enumerate(classes.get(name, [None] * stats.world_size)):
            if key is not None and stats.present(r, j):
                members.setdefault(key, []).append((r, j))
    out: Copies = [[() for _ in stats.names] for _ in range(stats.world_size)]
    for j, name in enumerate(stats.names):
        keys = classes.get(name, [None] * stats.world_size)
        for r, key in enumerate(keys):
            if stats.present(r, j):
                out[r][j] = tuple(members[key]) if key is not None else ((r, j),)
    return out


def measured_copies(stats: StatsTable, replication: Replication, mesh: MeshSpec) -> Copies:
    """The copies the raw bits showed: by class of bits where the replication has classes (a measured
    layout's), else per mesh axis."""
    if replication.classes is not None:
        return class_copies(stats, replication)
    return axis_copies(stats, mesh, {name: replication.replicated_axes(name, mesh) for name in stats.names})


def first_holdings(copies: Copies) -> list[list[int]]:
    """Per rank, the parameters whose gradient it holds as the first of its copies: each logical gradient
    once, where a clip that counts it once would."""
    return [[j for j, held in enumerate(row) if held and min(held) == (r, j)] for r, row in enumerate(copies)]


def parts_of(stats: StatsTable, copies: Copies, norm_type: float) -> list[float]:
    """Each rank's share of the global p-th power sum when each holding counts 1/k, k its copies (for the
    inf norm: its local maximum)."""
    parts = [0.0] * stats.world_size
    for r in range(stats.world_size):
        for j in range(len(stats.names)):
            if copies[r][j]:
                value = stats.pow_sum[r][j]
                parts[r] = combine(parts[r], value if is_inf_norm(norm_type) else value / len(copies[r][j]),
                                   norm_type)
    return parts


def weighted_parts(
    stats: StatsTable,
    mesh: MeshSpec,
    replicated_axes: Mapping[str, frozenset[str]],
    norm_type: float,
) -> list[float]:
    """Each rank's share of the global p-th power sum when its slice of a parameter counts 1/k, k its
    replica count (``axis_copies``; for the inf norm: its local maximum). Used with measured replication
    it gives the measured truth; with declared placements, what a plan-trusting clip would report."""
    return parts_of(stats, axis_copies(stats, mesh, replicated_axes), norm_type)


def _root_of(parts: list[float], norm_type: float) -> float:
    total = 0.0
    for part in parts:
        total = combine(total, part, norm_type)
    return root(total, norm_type)


def weighted_norm(
    stats: StatsTable,
    mesh: MeshSpec,
    replicated_axes: Mapping[str, frozenset[str]],
    norm_type: float,
) -> float:
    """The global norm from ``weighted_parts``: every logical element counted once."""
    return _root_of(weighted_parts(stats, mesh, replicated_axes, norm_type), norm_type)


def unreduced_over(
    stats: StatsTable, replication: Replication, mesh: MeshSpec, axis: str, norm_type: float
) -> list[float]:
    """Per rank: the de-duplicated norm of the ranks sharing its coordinate on ``axis``, what a clip
    that reduces over every axis but ``axis`` reports (a pipeline stage's own norm, an EP group's)."""
    replicated = {name: replication.replicated_axes(name, mesh) for name in stats.names}
    parts = weighted_parts(stats, mesh, replicated, norm_type)
    a = mesh.index(axis)
    coords = [mesh.coordinate(r) for r in range(stats.world_size)]
    return [_root_of([parts[q] for q in range(stats.world_size) if coords[q][a] == coords[r][a]], norm_type)
            for r in range(stats.world_size)]


def replicas_counted_on(
    stats: StatsTable, replication: Replication, mesh: MeshSpec, axis: str, norm_type: float
) -> float:
    """The norm when copies along ``axis`` are counted as distinct (tied weights summed per stage,
    HSDP or CP replicas summed): the measured replication with ``axis`` taken out."""
    replicated = {name: replication.replicated_axes(name, mesh) - {axis} for name in stats.names}
    return weighted_norm(stats, mesh, replicated, norm_type)


def measured_norm(stats: StatsTable, replication: Replication, mesh: MeshSpec, norm_type: float) -> float:
    """The norm the raw bits imply: each logical gradient counted once, its copies found per mesh axis,
    or by class of bits where the replication has classes (a measured layout's)."""
    return _root_of(parts_of(stats, measured_copies(stats, replication, mesh), norm_type), norm_type)


def declared_norm(
    stats: StatsTable,
    mesh: MeshSpec,
    declared: Mapping[str, Mapping[str, object]],
    norm_type: float,
) -> float:
    """The norm a clip would get by trusting the declared plan's Replicate placements."""
    axes = {
        name: frozenset(a for a in mesh.names if isinstance(declared.get(name, {}).get(a, Replicate()), Replicate))
        for name in stats.names
    }
    return weighted_norm(stats, mesh, axes, norm_type)


def norms_agree(a: float, b: float, rtol: float) -> bool:
    """Equal within ``rtol``; two non-finite values agree when both are NaN or both the same inf."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-300)
