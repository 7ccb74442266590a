"""``clipcheck compat FILE.jsonl ...``: the compatibility table (markdown) of the real frameworks'
clip functions, from results the harness wrote."""

from __future__ import annotations

import sys
from typing import Sequence

from harness.report.compat import compat_rows, filed_findings, markdown
from harness.judge.records import read_records


def main(argv: Sequence[str]) -> int:
    if not argv:
        print("usage: python -m harness compat RESULTS.jsonl [...]", file=sys.stderr)
        return 2
    records = [rec for path in argv for rec in read_records(path)]
    print(markdown(compat_rows(records), filed_findings(records)))
    return 0
