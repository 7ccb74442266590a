"""The factor a clip applied to one gradient, fitted the same way by every reading of a call: the runner's
(``effects.applied_coefficients``, from float64 copies), the audit's with a copy (``with_copy``, in blocks)
and without one (``without_copy``, from samples). Each reading sums what the fit needs its own way; the
fit itself, and what it may be off by, is decided here once.

Why a fit needs more than ``sum(a*b) / sum(a*a)``: below a dtype's smallest normal number a rounding is
absolute (``clipmath.subnormal_spacing``), so a correctly clipped element of subnormal magnitude may sit a
sizeable fraction of itself away from ``c * before``. The fit is taken over the elements that are normal
numbers before and after the call where any is, and carries a slack where none is (or where the reading
did not separate them): the most those absolute roundings can pull the factor, which the coefficient check
adds to its tolerance."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.clipmath import subnormal_spacing

NEGLIGIBLE_PULL = 2.0**-30
"""A slack below this part of the factor is dropped: far under every dtype's rounding of the coefficient,
so a reading need not separate the normal elements (an extra pass) to get it."""


@dataclass(frozen=True)
class FitSums:
    """One gradient's sums, in float64: ``denom`` = sum a*a and ``dot`` = sum a*b over the elements fitted,
    ``abs_sum`` = sum |a| over them (None where not summed: bounded by Cauchy-Schwarz, sqrt(n * denom)),
    ``elements`` how many were fitted."""

    denom: float
    dot: float
    elements: int
    abs_sum: float | None = None


@dataclass(frozen=True)
class Factor:
    """A fitted factor and its slack (relative: how far absolute subnormal roundings may have pulled it)."""

    c: float
    slack: float

    def entry(self, residual: float, elements: int) -> list[float]:
        """The record's ``[c, residual, elements(, slack)]`` (``records.Coefficients``)."""
        return [self.c, residual, elements, *([self.slack] if self.slack > 0.0 else [])]


def fit(sums: FitSums, dtype: torch.dtype) -> Factor | None:
    """The least-squares factor of finite sums, with the pull of absolute roundings on it as its slack (at
    most half a spacing per element: (spacing / 2) * sum |a| / (|c| * sum a*a), here a whole spacing: a
    product and a quotient may each round); None for an all-zero gradient."""
    if sums.denom == 0.0:
        return None
    c = sums.dot / sums.denom
    if c == 0.0:
        return Factor(0.0, 0.0)
    abs_sum = sums.abs_sum if sums.abs_sum is not None else math.sqrt(sums.elements * sums.denom)
    pull = subnormal_spacing(dtype) * abs_sum / (abs(c) * sums.denom)
    return Factor(c, pull if pull > NEGLIGIBLE_PULL else 0.0)


def normal_elements(a: torch.Tensor, b: torch.Tensor, smallest: float | torch.Tensor) -> torch.Tensor:
    """Where both ``a`` (before) and ``b`` (after) are at least ``smallest`` in magnitude (the dtype's smallest
    normal number, ``clipmath.smallest_normal``; per element where gradients of several dtypes lie in one
    vector): the elements whose roundings are relative, which a fit with no slack may use."""
    return (a.abs() >= smallest) & (b.abs() >= smallest)


def best_fit(everything: FitSums, normal: FitSums | None, dtype: torch.dtype) -> Factor | None:
    """The fit on the normal elements where there are any (no slack), else on all of them with its slack.
    ``normal`` None: the reading did not separate them, because ``everything``'s slack was negligible."""
    whole = fit(everything, dtype)
    if whole is None or whole.slack == 0.0 or normal is None:
        return whole
    on_normal = fit(normal, dtype) if math.isfinite(normal.denom) and math.isfinite(normal.dot) else None
    return Factor(on_normal.c, 0.0) if on_normal is not None else whole


def relative_residual(worst: float, top: float, dtype: torch.dtype) -> float:
    """The largest |b - c*a| relative to max |c*a|, less one subnormal spacing (a correctly clipped element
    may land that far from ``c * a`` however small it is)."""
    return max(0.0, worst - subnormal_spacing(dtype)) / top if top > 0.0 else 0.0


__all__ = ["FitSums", "Factor", "fit", "best_fit", "normal_elements", "relative_residual", "NEGLIGIBLE_PULL"]
