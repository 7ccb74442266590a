"""``clipcheck compat FILE.jsonl ...``: the compatibility table (markdown) of the real frameworks'
clip functions, from results the harness wrote; ``clipcheck compat --sweep FRAMEWORK``: one
framework's adapters over a list of its releases (``harness.commands.sweep``)."""

from __future__ import annotations

import os
import sys
from typing import Sequence

from harness.errors import ClipcheckInputError
from harness.report.compat import compat_rows, filed_findings, markdown
from harness.judge.records import read_records


def main(argv: Sequence[str]) -> int:
    if any(a == "--sweep" or a.startswith("--sweep=") for a in argv):
        from harness.commands.sweep import main as sweep_main

        try:
            return sweep_main(argv)
        except ClipcheckInputError as exc:
            print(f"clipcheck compat: error: {exc}", file=sys.stderr)
            return 2
    usage = ("usage: clipcheck compat RESULTS.jsonl [...]   (the frameworks' table, markdown, from JSON Lines)\n"
             "       clipcheck compat --sweep FRAMEWORK [--releases A,B] [--nproc-list 2,4]   (its releases)")
    if list(argv) in (["--help"], ["-h"]):
        print(usage)
        return 0
    if not argv:
        print(usage, file=sys.stderr)
        return 2
    missing = [path for path in argv if not os.path.isfile(path)]
    if missing:  # one line, exit 2, like every other bad input (it was a FileNotFoundError traceback)
        print(f"clipcheck: error: compat: no such results file {missing[0]!r}", file=sys.stderr)
        return 2
    records = [rec for path in argv for rec in read_records(path)]
    print(markdown(compat_rows(records), filed_findings(records)))
    return 0
