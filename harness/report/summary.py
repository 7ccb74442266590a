"""The compact text summary ``clipcheck matrix`` prints: one aligned row per (target, scenario), so a
matrix of hundreds of cases reads on one screen, with the worst failing ratio and the signature most
often seen, which together usually name the mistake. Built from the record dicts of a results file,
like the HTML page (``html``); pure functions, no torch.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

from harness.judge.verdicts import count
from harness.report.numbers import NONE, format_ratio, parse_float, ratio_deviation
from harness.report.record_fields import case_dicts, clip, errors, failed_checks, group_dicts, is_failing, \
    raised, signatures, text


def _worst_failing(cases: list[dict[str, Any]]) -> str:
    failing = [r for r in cases if is_failing(r)]
    if not failing:
        return NONE
    devs = [(d, r) for r in failing if (d := ratio_deviation(parse_float(r.get("ratio")))) is not None]
    if devs:
        worst = max(devs, key=lambda p: p[0])[1]  # max keeps the first of equals: input order
        return format_ratio(worst.get("ratio"))
    return "raised" if any(raised(r) for r in failing) else NONE


def _common_signature(cases: list[dict[str, Any]]) -> tuple[str, int]:
    """The signature seen most often among the failures (else the first error, else the failed
    checks), and how many other distinct signatures there were."""
    failing = [r for r in cases if is_failing(r)]
    sigs = Counter(s for r in failing for s in dict.fromkeys(signatures(r)))
    if sigs:
        top = sigs.most_common(1)[0][0]
        return top, len(sigs) - 1
    errs = [msg for r in failing for _, msg in errors(r)]
    if errs:
        first = next((line for line in errs[0].splitlines() if line.strip()), errs[0])
        return f"error: {first.strip()}", 0
    checks = Counter(", ".join(n for n, _ in failed_checks(r)) for r in failing)
    checks.pop("", None)
    if checks:
        return f"failed: {checks.most_common(1)[0][0]}", 0
    return "-", 0


def compact_summary(records: Iterable[Any], width: int = 120) -> list[str]:
    """One aligned row per (target, scenario), sorted by target then scenario, under a header:
    cases passed / failed / harness errors / skipped, failed/all metamorphic groups, the worst ratio
    among failing cases (farthest from 1.0 as |log ratio|, non-finite farthest; "raised" where they
    raised without one, "-" where none failed), and the signature most common among the failures
    ("(+N)" counts the other signatures seen). When every signature fits whole on its row within
    ``width`` columns it is a last column; otherwise each failing row's signature
    follows it on an indented line of its own, cut to ``width``."""
    records = list(records)
    rows: dict[tuple[str, str], dict[str, Any]] = {}

    def row(rec: dict[str, Any]) -> dict[str, Any]:
        key = (text(rec.get("target")), text(rec.get("scenario")))
        return rows.setdefault(key, {"cases": [], "groups": []})

    for rec in case_dicts(records):
        row(rec)["cases"].append(rec)
    for rec in group_dicts(records):
        row(rec)["groups"].append(rec)

    header = ["target", "scenario", "pass", "fail", "error", "skip", "meta", "worst"]
    table: list[list[str]] = []
    for (target, scenario), data in sorted(rows.items()):
        cases, groups = data["cases"], data["groups"]
        c = count(cases + groups)
        meta = f"{c.metamorphic_failed}/{c.metamorphic_groups}" if groups else NONE
        sig, others = _common_signature(cases)
        table.append([target, scenario, str(c.passed), str(c.failed), str(c.errors), str(c.skipped), meta,
                      _worst_failing(cases), sig + (f" (+{others})" if others else "")])
    if not table:
        return ["  ".join(header), "(no cases)"]

    # the target and scenario are never cut: two targets of one file differ only at the end
    caps = [None, None, 6, 6, 6, 6, 7, 12]
    widths = [min(max(len(header[i]), *(len(t[i]) for t in table)), caps[i] or 10**6) for i in range(8)]
    right = {2, 3, 4, 5, 6}

    def cols(values: list[str]) -> str:
        cells = []
        for i, w in enumerate(widths):
            shown = clip(values[i], w)
            cells.append(shown.rjust(w) if i in right else shown.ljust(w))
        return "  ".join(cells)

    prefix = sum(widths) + 2 * len(widths)
    sig_room = width - prefix
    if all(len(t[8]) <= sig_room for t in table):
        # every signature fits whole on its row: a signature column
        return [cols(header) + "  signature"] + [(cols(t) + "  " + t[8]).rstrip() for t in table]
    # else each failing row's signature goes whole (up to the width) on an indented line under it
    out = [cols(header).rstrip()]
    for t in table:
        out.append(cols(t).rstrip())
        if t[8] != "-":
            out.append("    " + clip(t[8], max(width - 4, 40)))
    return out
