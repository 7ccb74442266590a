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


def weighted_parts(
    stats: StatsTable,
    mesh: MeshSpec,
    replicated_axes: Mapping[str, frozenset[str]],
    norm_type: float,
) -> list[float]:
    """Each rank's share of the global p-th power sum when its slice of a parameter counts 1/k, k its
    replica count (for the inf norm: its local maximum).

    The replica group of rank r for a parameter is every rank that holds a gradient for it and shares
    r's coordinates on all axes the parameter is *not* replicated on. Used with measured replication
    it gives the measured truth; with declared placements, what a plan-trusting clip would report.
    """
    coords = [mesh.coordinate(r) for r in range(stats.world_size)]
    parts = [0.0] * stats.world_size
    for j, name in enumerate(stats.names):
        keep = [a for a, axis in enumerate(mesh.names) if axis not in replicated_axes[name]]
        for r in range(stats.world_size):
            if not stats.present(r, j):
                continue
            key = tuple(coords[r][a] for a in keep)
            count = sum(
                1
                for q in range(stats.world_size)
                if stats.present(q, j) and tuple(coords[q][a] for a in keep) == key
            )
            value = stats.pow_sum[r][j]
            parts[r] = combine(parts[r], value if is_inf_norm(norm_type) else value / count, norm_type)
    return parts


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


def class_parts(stats: StatsTable, replication: Replication, norm_type: float) -> list[float]:
    """Each rank's share of the global p-th power sum when every holding of one class of bits
    (``Replication.classes``: a measured layout's) counts 1/k, k the holdings of that class under any
    name; for the inf norm, its local maximum."""
    classes = replication.classes or {}
    copies = replication.copies()
    parts = [0.0] * stats.world_size
    for j, name in enumerate(stats.names):
        keys = classes.get(name, [None] * stats.world_size)
        for r in range(stats.world_size):
            if not stats.present(r, j):
                continue
            key = keys[r]
            count = copies.get(key, 1) if key is not None else 1
            value = stats.pow_sum[r][j]
            parts[r] = combine(parts[r], value if is_inf_norm(norm_type) else value / count, norm_type)
    return parts


def measured_norm(stats: StatsTable, replication: Replication, mesh: MeshSpec, norm_type: float) -> float:
    """The norm the raw bits imply: each logical gradient counted once, its copies found per mesh axis,
    or by class of bits where the replication has classes (a measured layout's)."""
    if replication.classes is not None:
        return _root_of(class_parts(stats, replication, norm_type), norm_type)
    axes = {name: replication.replicated_axes(name, mesh) for name in stats.names}
    return weighted_norm(stats, mesh, axes, norm_type)


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
