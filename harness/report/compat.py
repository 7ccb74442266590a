"""The compatibility table (markdown) of the real
frameworks' clip functions, from results the harness wrote: framework and version, scenario, layout,
norm, dtype, world size, verdict, reported/true ratio and, for a FAIL, what it is: the upstream
report it matches or a new finding (the target's ``findings``), else "unexplained". Cases of the
harness's own targets (the reference, the framework-style models, the mutants) are left out."""

from __future__ import annotations

from typing import Iterable

from harness.judge.records import CaseRecord, Record, case_records
from harness.targets.target import Finding


def _findings() -> dict[str, tuple[Finding, ...]]:
    from harness.targets.registry import registered_targets

    return {name: target.findings for name, target in registered_targets().items()}


def explain(rec: CaseRecord, findings: dict[str, tuple[Finding, ...]]) -> str:
    """A FAIL's upstream report or finding; '-' for anything else."""
    if rec["verdict"] not in ("FAIL", "ERROR"):
        return "-"
    for finding in findings.get(rec["target"], ()):
        if finding.matches(rec["layout"], rec["norm"]):
            return finding.describe()
    return "unexplained: no recorded finding matches (look at it, then report it or record it)"


def _ratio(rec: CaseRecord) -> str:
    if rec["verdict"] == "SKIP":
        return "-"
    r = rec["ratio"]
    if r is None:
        failed = [n for n, c in rec["checks"].items() if not c["passed"]]
        return "raised" if "raised" in failed or "setup" in failed else "-"
    return r if isinstance(r, str) else f"{r:.6f}"


def compat_rows(records: Iterable[Record]) -> list[list[str]]:
    findings = _findings()
    rows = []
    for rec in case_records(records):
        if not rec.get("framework") and rec["verdict"] != "SKIP":
            continue
        if rec["verdict"] == "SKIP" and not rec.get("skip_reason"):
            continue
        framework = rec.get("framework") or f"{rec['target']} (not installed)"
        rows.append([framework, rec["target"], rec["scenario"], rec["layout"], rec["norm"], rec["dtype"],
                     str(rec["world_size"]), rec["verdict"], _ratio(rec), explain(rec, findings)])
    return sorted({tuple(r): r for r in rows}.values(), key=lambda r: (r[0], r[2], int(r[6]), r[3], r[1], r[4], r[5]))


def markdown(rows: list[list[str]]) -> str:
    head = ["framework", "target", "scenario", "layout", "norm", "dtype", "world", "verdict", "ratio",
            "upstream report or finding"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
