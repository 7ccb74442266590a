"""``clipcheck compat FILE.jsonl ...``: the compatibility table (markdown) of the real frameworks'
clip functions, from results the harness wrote; ``clipcheck compat --sweep FRAMEWORK``: one
framework's adapters over a list of its releases (``harness.commands.sweep``)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from harness.errors import ClipcheckInputError
from harness.report.compat import compat_rows, filed_findings, markdown
from harness.judge.records import read_records


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clipcheck compat", allow_abbrev=False,
                                description="the real frameworks' compatibility table (markdown) from results "
                                            "the harness wrote; --sweep FRAMEWORK runs one framework's adapters over "
                                            "its releases (clipcheck compat --sweep FRAMEWORK --help)")
    p.add_argument("results", nargs="+", metavar="RESULTS.jsonl", help="JSON Lines files of clipcheck run / matrix")
    return p


def main(argv: Sequence[str]) -> int:
    if any(a == "--sweep" or a.startswith("--sweep=") for a in argv):
        from harness.commands.sweep import main as sweep_main

        try:
            return sweep_main(argv)
        except ClipcheckInputError as exc:
            print(f"clipcheck compat: error: {exc}", file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)  # --help, or a usage line and exit 2
    missing = [path for path in args.results if not os.path.isfile(path)]
    if missing:
        print(f"clipcheck compat: error: no such results file: {', '.join(missing)}", file=sys.stderr)
        return 2
    records = [rec for path in args.results for rec in read_records(path)]
    print(markdown(compat_rows(records), filed_findings(records)))
    return 0
