"""How every report reads and shows a number: the console table, the compatibility table, the
matrix's summaries and the HTML page print a ratio the same way, so a value can be searched for
across them.

A number in a results file may be a float, an integer, null, or one of the strings "nan", "inf",
"-inf" (``harness.cases.json_numbers.json_float`` wrote it); a file from someone else may hold
anything. ``parse_float`` turns each into a float or None, and the formatters never raise.
"""

from __future__ import annotations

import math
from typing import Any

NONE = "-"
"""What a missing number shows as."""


def parse_float(x: Any) -> float | None:
    """``x`` as a float (NaN and the infinities included), or None where it is no number. A bool is
    no number, though Python counts it as one."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return None


def format_ratio(x: Any) -> str:
    """A ratio (or a norm beside it) as the console prints it: six decimals, so a miss in the sixth
    digit shows; a non-finite one spelled out; ``NONE`` for none."""
    r = parse_float(x)
    if r is None:
        return NONE
    return f"{r:.6f}" if math.isfinite(r) else str(r)


def format_number(x: Any) -> str:
    """Any other number (a norm, a tolerance, a coefficient gap) in at most seven significant digits,
    whatever its magnitude; a value that is no number is shown as it is."""
    r = parse_float(x)
    if r is None:
        return NONE if x is None else str(x)
    return f"{r:.7g}" if math.isfinite(r) else str(r)


def ratio_deviation(r: float | None) -> float | None:
    """How far a reported/true ratio is from 1.0, the same for over- and under-reporting (|log r|): a
    non-finite or non-positive ratio is infinitely far; None where there is no ratio."""
    if r is None:
        return None
    if not math.isfinite(r) or r <= 0:
        return math.inf
    return abs(math.log(r))
