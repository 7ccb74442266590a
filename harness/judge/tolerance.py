"""How far a correct clip may be from the exact answer, derived from the arithmetic it does.

Every tolerance of the judge comes from here, as a function of the gradient dtype and the number of
elements involved, never a constant picked to make a case pass. The unit roundoff ``u`` of a dtype
bounds the relative error of one rounding; a correct clip rounds a bounded number of times per value.

* **The reported norm** (``norm_rtol``): the p-th powers of ``n`` elements summed in an accumulator at
  least as wide as fp32 (fp64 for fp64 gradients: ``u_acc``), a blocked or pairwise sum (error
  growing with log2 n), the power and the root, then the result rounded once to the gradient dtype
  (torch returns the norm in it): ``2 (u_d + (log2 n + 4) u_acc)``, a factor two of margin. It never
  goes below ``NORM_RTOL[dtype]``, the documented floor: what correct clips written in ways the
  derivation does not cover (per-tensor norms combined in the gradient dtype, a root of a root) were
  measured to need, and well below any counting mistake (a replica counted twice is sqrt(2)).
* **How uniformly a gradient was scaled** (``uniformity_bound``): a correctly clipped element is the
  original times one coefficient, rounded: at most two roundings to the gradient dtype (a product,
  then a quotient) and two in an intermediate (fp32 for bf16/fp16 gradients, the gradient dtype
  otherwise). The judge fits that coefficient by least squares in float64, which is itself within
  ``u_d`` of the applied one, with float64 sums over the ``n`` elements (``(2 n + 8) u_64`` at worst,
  sequential). Bound: ``4 (2 u_d + 2 u_int + (2 n + 8) u_64)``, a factor four of margin. At fp64 the
  float64 fit is the same precision as the gradients, which is why the bound must grow with ``n``
  there (a fixed ``8 u`` failed the reference itself at fp64). Below the dtype's smallest normal number a
  rounding is absolute, not relative: the residual is taken less one subnormal spacing, the factor is fitted
  on the elements that are normal numbers, and a gradient with none carries the fit's own slack
  (``run.case.factor_fit``, the one fit of the runner's reading and both of the audit's; the fuzzer's fp16
  gradients at 2^-14 clipped at 0.3 x the norm).
* **The coefficient's value** (``coefficient_rtol``): the coefficient a correct clip applies is
  ``max_norm / (its reported norm + eps)``, so it is off by its norm's error (the band), plus one rounding
  of the coefficient itself to the gradient dtype, plus the elements' roundings averaged by the fit.
* **The band** (``harness.judge.band``): the norm's tolerance of a case is also measured, on the case's
  own gradients: how far correct clips (torch's kernels, their ways of combining per-gradient norms in the
  dtype) land from the exact norm, times a safety factor, plus the roundings of the result. The analytic
  bound above stays its floor; the measurement raises it where correct code does worse (millions of fp32
  elements in one CPU kernel, partial norms combined in bf16).
"""

from __future__ import annotations

import math

UNIT_ROUNDOFF = {"fp64": 2.0**-53, "fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}
"""Half the distance from 1 to the next representable number: one rounding's relative error."""

NORM_RTOL = {"fp64": 1e-9, "fp32": 1e-5, "fp16": 2e-3, "bf16": 1e-2}
"""The floor of the relative tolerance on a reported norm (bf16/fp16 targets often accumulate
per-tensor norms in the low-precision type, or round them to it more than once)."""

_U64 = UNIT_ROUNDOFF["fp64"]
_U32 = UNIT_ROUNDOFF["fp32"]


def accumulator_roundoff(dtype: str) -> float:
    """The unit roundoff of the narrowest accumulator a correct clip uses: fp64 for fp64 gradients,
    fp32 for every narrower dtype (summing squares in bf16/fp16 overflows and underflows)."""
    return _U64 if dtype == "fp64" else _U32


def intermediate_roundoff(dtype: str) -> float:
    """The roundoff of an intermediate product of a gradient element: fp32 for bf16/fp16 gradients
    (torch computes their arithmetic in fp32), the gradient dtype itself otherwise."""
    return _U32 if dtype in ("bf16", "fp16") else UNIT_ROUNDOFF[dtype]


def norm_rtol(dtype: str, elements: int = 1) -> float:
    """Relative tolerance on a reported norm computed over ``elements`` gradient elements."""
    u_d, u_acc = UNIT_ROUNDOFF[dtype], accumulator_roundoff(dtype)
    derived = 2 * (u_d + (math.log2(max(elements, 1)) + 4) * u_acc)
    return max(NORM_RTOL[dtype], derived)


def element_rounding(dtype: str) -> float:
    """The relative error of one correctly clipped element: a product, then a quotient (two roundings to
    the gradient dtype, two in the intermediate)."""
    return 2 * UNIT_ROUNDOFF[dtype] + 2 * intermediate_roundoff(dtype)


def _fit_error(elements: int) -> float:
    """The float64 least-squares fit's own error over ``elements`` elements (sequential sums, at worst)."""
    return (2 * max(elements, 1) + 8) * _U64


def uniformity_bound(dtype: str, elements: int) -> float:
    """The largest relative residual of a least-squares fit of one coefficient to a correctly clipped
    gradient of ``elements`` elements (residual: max |after - c * before| / max |c * before|)."""
    return 4 * (element_rounding(dtype) + _fit_error(elements))


def coefficient_rtol(dtype: str, elements: int, band: float) -> float:
    """Relative tolerance on the coefficient applied to a gradient of ``elements`` elements, in a case
    whose norm's tolerance is ``band`` (``harness.judge.band``): the norm it was computed from, one rounding
    of the coefficient to the gradient dtype (torch's clip holds it in the norm's dtype), and the elements'
    own roundings, which the least-squares fit averages (a weighted mean of per-element errors is no larger
    than the largest), plus the fit's own float64 error."""
    return band + UNIT_ROUNDOFF[dtype] + element_rounding(dtype) + _fit_error(elements)
