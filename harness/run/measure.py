"""The measured ground truth, per rank: what the raw bits say is replicated where.

For every parameter and every mesh axis, a MAX and a MIN all-reduce of the gradient's raw
bits (viewed as integers) over that axis's groups. A spread of 0 in every group means the gradient is
replicated along the axis and must be counted once there. Nothing declared is trusted: only the bits.
All parameters share one bucket per axis, so a case costs two collectives per mesh axis (plus one to
gather per-rank statistics and one to merge the per-group verdicts), not two per parameter.
Integer views matter: float MAX/MIN merge +0/-0 and drop NaN depending on rank order.

The norm these measurements imply, and its cross-check with the constructive truth, are pure
functions on the results: ``harness.judge.truth``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from harness.clipmath import combine, is_inf_norm, pow_sum, root
from harness.spec.injection import Injection, logical_grad
from harness.spec.layout import Layout, MeshSpec, Replicate

_MISSING_MAX = torch.iinfo(torch.int32).min
_MISSING_MIN = torch.iinfo(torch.int32).max
_HEADER = 2  # numel, itemsize: a shape mismatch shows up as a spread too


@dataclass
class StatsTable:
    """Per-rank, per-parameter statistics, identical on every rank after one all-reduce.

    ``numel`` is -1 where a rank has no gradient for the parameter (absent or ``None``).
    ``pow_sum`` is sum |g|^p (max |g| for the inf norm) of the rank's local gradient.
    """

    names: list[str]
    numel: list[list[int]]
    itemsize: list[list[int]]
    pow_sum: list[list[float]]

    @property
    def world_size(self) -> int:
        return len(self.numel)

    def present(self, rank: int, j: int) -> bool:
        return self.numel[rank][j] >= 0

    def local_norms(self, norm_type: float) -> list[float]:
        """Each rank's norm of everything it holds, with no cross-rank reduction."""
        out = []
        for r in range(self.world_size):
            total = 0.0
            for j in range(len(self.names)):
                if self.present(r, j):
                    total = combine(total, self.pow_sum[r][j], norm_type)
            out.append(root(total, norm_type))
        return out


@dataclass
class Replication:
    """Measured replication: ``distinct[axis][name]`` is True when some group of ``axis`` saw a spread."""

    distinct: dict[str, dict[str, bool]]

    def replicated_axes(self, name: str, mesh: MeshSpec) -> frozenset[str]:
        return frozenset(a for a in mesh.names if not self.distinct.get(a, {}).get(name, False))

    def describe(self, name: str, mesh: MeshSpec) -> str:
        parts = []
        rep = [d for d in mesh.names if mesh.size(d) > 1 and not self.distinct[d][name]]
        dis = [d for d in mesh.names if mesh.size(d) > 1 and self.distinct[d][name]]
        if rep:
            parts.append("replicated on " + ", ".join(rep))
        if dis:
            parts.append("distinct on " + ", ".join(dis))
        return "; ".join(parts) or "single rank"


def bit_words(t: torch.Tensor) -> torch.Tensor:
    """Raw bits of ``t`` as int32 words (gloo cannot reduce int16, so 2-byte types are widened)."""
    flat = t.detach().contiguous().view(-1)
    size = flat.element_size()
    if size in (4, 8):
        return flat.view(torch.int32)
    if size == 2:
        return flat.view(torch.int16).to(torch.int32)
    return flat.view(torch.uint8).to(torch.int32)


def _word_count(numel: int, itemsize: int) -> int:
    return numel * 2 if itemsize == 8 else numel


def gather_stats(
    names: Sequence[str],
    grads: Mapping[str, torch.Tensor | None],
    norm_type: float,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup,
    device: torch.device,
) -> StatsTable:
    """One SUM all-reduce of a [world, params, 3] float64 table where each rank fills its row."""
    table = torch.zeros(world_size, len(names), 3, dtype=torch.float64, device=device)
    for j, name in enumerate(names):
        g = grads.get(name)
        if g is None:
            table[rank, j, 0] = -1
            continue
        table[rank, j, 0] = g.numel()
        table[rank, j, 1] = g.element_size()
        table[rank, j, 2] = pow_sum(g, norm_type)
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
    t = table.cpu()
    return StatsTable(
        names=list(names),
        numel=t[:, :, 0].long().tolist(),
        itemsize=t[:, :, 1].long().tolist(),
        pow_sum=t[:, :, 2].tolist(),
    )


def measure_replication(
    names: Sequence[str],
    grads: Mapping[str, torch.Tensor | None],
    stats: StatsTable,
    mesh: MeshSpec,
    axis_groups: Mapping[str, dist.ProcessGroup],
    world_group: dist.ProcessGroup | None,
    device: torch.device,
) -> Replication:
    """MAX-MIN of raw bits per mesh axis, bucketed; then one MAX over the world to merge groups
    (``world_group`` None: this rank's own view, for ``merged``)."""
    if not names:
        return Replication({axis: {} for axis in mesh.names})
    lengths = []
    for j in range(len(names)):
        words = [
            _word_count(stats.numel[r][j], stats.itemsize[r][j])
            for r in range(stats.world_size)
            if stats.present(r, j)
        ]
        lengths.append(_HEADER + max(words, default=0))
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    segment = torch.repeat_interleave(
        torch.arange(len(names), device=device), torch.tensor(lengths, device=device)
    )

    high = torch.full((offsets[-1],), _MISSING_MAX, dtype=torch.int32, device=device)
    low = torch.full((offsets[-1],), _MISSING_MIN, dtype=torch.int32, device=device)
    for j, name in enumerate(names):
        g = grads.get(name)
        if g is None:
            continue
        words = torch.cat(
            [
                torch.tensor([g.numel(), g.element_size()], dtype=torch.int32, device=device),
                bit_words(g).to(device),
            ]
        )
        high[offsets[j] : offsets[j] + words.numel()] = words
        low[offsets[j] : offsets[j] + words.numel()] = words

    flags = torch.zeros(len(mesh.names), len(names), dtype=torch.int32, device=device)
    for row, axis in enumerate(mesh.names):
        if mesh.size(axis) == 1 or not names:
            continue
        # MAX and MIN in one collective: MIN(x) = -MAX(-x), in int64 so that negating int32 words
        # (INT32_MIN among them) cannot overflow
        both = torch.cat([high.to(torch.int64), -low.to(torch.int64)])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=axis_groups[axis])
        hi, lo = both[: high.numel()], -both[high.numel():]
        spread = (hi != lo).to(torch.int32)
        # a segment nobody in the group holds stays at the sentinels: that is "absent", not a spread
        nobody = hi[torch.tensor(offsets[:-1], device=device)] == _MISSING_MAX
        per_param = torch.zeros(len(names), dtype=torch.int32, device=device)
        per_param.index_add_(0, segment, spread)
        flags[row] = ((per_param > 0) & ~nobody).to(torch.int32)
    if world_group is not None:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=world_group)
    flags = flags.cpu()
    return Replication(
        {axis: {name: bool(flags[a, j]) for j, name in enumerate(names)} for a, axis in enumerate(mesh.names)}
    )


def merged(views: Sequence[Replication]) -> Replication:
    """The world's replication from each rank's own view (a spread any group saw): what the world
    MAX of ``measure_replication`` gives, merged where the views arrive anyway (rank 0's records)."""
    axes = views[0].distinct if views else {}
    return Replication({axis: {name: any(v.distinct[axis][name] for v in views) for name in names}
                        for axis, names in axes.items()})
