"""The band of a case: how far correct clips land from the exact norm on the case's own gradients.

Every rank measured, on each gradient it holds, the relative error of torch's own norm kernel
(``clipmath.kernel_error``), and on one flat buffer of its gradients the same kernel's
(``clipmath.flat_error``). From those numbers rank 0 replays, as a handful of scalar operations in the
gradients' dtype, the ways correct clips turn per-gradient norms into one reported norm
(``replayed_ways``): torch's ``clip_grad_norm_`` and ``get_total_norm`` (each gradient's norm rounded to the
dtype, stacked, the stack's norm), a DTensor's partial norms (each rank's total raised to the p-th power
and summed over the ranks in the dtype), fp32 totals all-reduced, one flat buffer per rank. Each way counts
every logical gradient once, as the truth does, so it differs from the truth by its arithmetic only.

The band is the largest distance of those ways from the truth times ``BAND_SAFETY``, plus two roundings to
the dtype, never below the analytic bound (``tolerance.norm_rtol``): docs/reading-a-failure.md, "The band".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from harness.cases.injection import DTYPES
from harness.clipmath import KERNEL_ERROR_CAP, is_inf_norm
from harness.judge.records import StatsTable
from harness.judge.tolerance import UNIT_ROUNDOFF, norm_rtol
from harness.judge.truth import Copies, first_holdings

BAND_SAFETY = 2.0
"""How far past the replayed ways a correct clip may land: another correct clip sums in another order, on
another thread count, with another block size, and lands about as far again from the way measured as that
way is from the exact value."""

REPLAY_ROUNDINGS = 8
"""The most roundings to the dtype one replayed way is taken to accumulate (each gradient's norm, its rank's
total, the p-th power, the additions over ranks, the root). A way further from the truth than that many
roundings plus ``KERNEL_ERROR_CAP`` underflowed or overflowed the dtype: it is what an arithmetic mistake
does, not a correct clip, and must not widen the band."""


@dataclass(frozen=True)
class Band:
    """A case's band: the ways replayed on its gradients (each one's reported / true) and the tolerance."""

    dtype: str
    floor: float
    """The analytic bound (``tolerance.norm_rtol``): the band never goes below it."""
    ways: tuple[tuple[str, float], ...] = ()

    @property
    def distance(self) -> float:
        """The largest relative distance of a replayed way from the truth (0 with none)."""
        return max((abs(ratio - 1.0) for _, ratio in self.ways), default=0.0)

    @property
    def rtol(self) -> float:
        """The relative tolerance on the case's reported norm."""
        return max(self.floor, BAND_SAFETY * self.distance + 2 * UNIT_ROUNDOFF[self.dtype])

    @property
    def spread(self) -> tuple[float, float]:
        """The lowest and highest reported / true of the replayed ways (the truth itself included)."""
        ratios = [ratio for _, ratio in self.ways] + [1.0]
        return min(ratios), max(ratios)

    def reach(self) -> str:
        """Where correct clips land on these gradients, in words: ``correct fp32 implementations on these
        gradients reach 0.999720-1.000000`` (a spread narrower than six digits as its distance from 1)."""
        lo, hi = self.spread
        where = f"{lo:.6f}-{hi:.6f}" if hi - lo >= 5e-6 else f"1 +/- {max(1.0 - lo, hi - 1.0):.2g}"
        return f"correct {self.dtype} implementations on these gradients reach {where}"

    def describe(self, ratio: float) -> str:
        """``ratio`` (reported / true) against the spread of correct clips on these gradients, in words."""
        inside = abs(ratio - 1.0) <= self.rtol
        return (f"reported {ratio:.6f} x true; {self.reach()} (band 1 +/- {self.rtol:.2g}): "
                f"{'within' if inside else 'outside'} their spread")


def case_band(stats: StatsTable, copies: Copies, norm_type: float, dtype: str) -> Band:
    """The band of a case whose holdings have ``copies`` (``truth.measured_copies``)."""
    elements = sum(n for per_rank in stats.numel for n in per_rank if n > 0)
    floor = norm_rtol(dtype, elements)
    cap = KERNEL_ERROR_CAP + REPLAY_ROUNDINGS * UNIT_ROUNDOFF[dtype]
    ways = tuple((way, ratio) for way, ratio in replayed_ways(stats, copies, norm_type, dtype)
                 if math.isfinite(ratio) and abs(ratio - 1.0) <= cap)
    return Band(dtype, floor, ways)


def replayed_ways(stats: StatsTable, copies: Copies, norm_type: float, dtype: str) -> list[tuple[str, float]]:
    """Each correct way's reported / true on this case's gradients, every logical gradient counted once (on
    its first holding: ``truth.first_holdings``); none where the truth is zero or not finite."""
    held = first_holdings(copies)
    exact = [[stats.pow_sum[r][j] for j in held[r]] for r in range(stats.world_size)]
    if is_inf_norm(norm_type):
        top = max((v for row in exact for v in row), default=0.0)
        if not math.isfinite(top) or top == 0:
            return []
        return [("the largest |g|, in the dtype", _rounded(top, dtype) / top)]
    p = norm_type
    total = sum(v for row in exact for v in row)
    if not math.isfinite(total) or total <= 0:
        return []
    errors = stats.kernel_error or [[0.0] * len(stats.names) for _ in range(stats.world_size)]
    kernel = [[v ** (1 / p) * (1 + errors[r][j]) for v, j in zip(exact[r], held[r])]
              for r in range(stats.world_size)]
    flat = stats.flat_error or [0.0] * stats.world_size
    truth = total ** (1 / p)
    d = DTYPES[dtype]
    return [
        ("torch's kernel on each gradient, summed exactly",
         sum(k ** p for row in kernel for k in row) ** (1 / p) / truth),
        (f"each gradient's norm in {dtype}, each rank's stack, p-th powers summed over ranks in {dtype}",
         _partial_norms(kernel, p, d, d) / truth),
        (f"each gradient's norm in {dtype}, each rank's stack and the all-reduce in {_wide(dtype)}",
         _partial_norms(kernel, p, d, DTYPES[_wide(dtype)]) / truth),
        ("one flat buffer per rank", _rounded(sum(sum(row) * (1 + f) ** p for row, f in zip(exact, flat)) ** (1 / p),
                                              dtype) / truth),
    ]


def _partial_norms(kernel: Sequence[Sequence[float]], p: float, norms: torch.dtype, reduce: torch.dtype) -> float:
    """A DTensor-style total: each rank's per-gradient norms rounded to ``norms`` and stacked, the stack's
    norm (torch's kernel: wider accumulation, result in ``norms``), its p-th power summed over the ranks in
    rank order in ``reduce`` (an all-reduce in that type), the root, the result in ``norms``."""
    acc = None
    for row in kernel:
        if not row:
            continue
        local = torch.linalg.vector_norm(torch.tensor(row, dtype=torch.float64).to(norms), p).to(reduce)
        power = local.pow(p)
        acc = power if acc is None else acc + power
    return 0.0 if acc is None else float(acc.pow(1 / p).to(norms))


def _wide(dtype: str) -> str:
    """The type a clip accumulates ``dtype``'s norms in when it widens them: fp32, or the dtype when wider."""
    return "fp64" if dtype == "fp64" else "fp32"


def _rounded(value: float, dtype: str) -> float:
    """``value`` rounded once to ``dtype``."""
    return float(torch.tensor(value, dtype=torch.float64).to(DTYPES[dtype]))
