"""Numbers as JSON can hold them.

JSON has no NaN or infinities: ``json.dumps`` writes ``NaN`` / ``Infinity``, which strict readers
(``jq``, browsers, most languages' parsers) reject, so one such number would make a whole results
line unreadable. A non-finite number is written as the string Python spells it, "nan", "inf" or
"-inf", which ``float()`` reads back (``harness.report.numbers.parse_float``). Results files and
replay blobs both write numbers this way; it lives here, at the bottom, because a blob is a case.
"""

from __future__ import annotations

import math


def json_float(x: float | None) -> float | str | None:
    """``x`` itself when finite (or None), else its name: "nan", "inf" or "-inf"."""
    if x is None or math.isfinite(x):
        return x
    return str(x)
