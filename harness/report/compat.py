"""The compatibility table (markdown) of the real frameworks' clip functions, from results the harness
wrote: framework and version, scenario, layout, norm, dtype, world size, verdict, reported/true ratio
and, for a FAIL, what it is and who reaches it: the upstream report it matches or a new finding (the
target's ``findings``), else "unexplained". Cases of the harness's own targets (the reference, the
framework-style models, the mutants) are left out.

Below the rows, ``findings`` lists each distinct finding once, with its reach, its owner (a finding in
torch that several frameworks inherit is filed under torch, once), the frameworks and layouts whose
rows show it, and its standalone reproduction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable

from harness.judge.records import CaseRecord, Record, case_records
from harness.report.numbers import NONE, format_ratio
from harness.cases.target import FindingRecord
from harness.cases.target import Finding, finding_for, synthetic

UNEXPLAINED = "unexplained: no recorded finding matches (look at it, then report it or record it)"


def registered_findings() -> dict[str, tuple[Finding, ...]]:
    from harness.targets.registry import registered_targets

    return {name: target.findings for name, target in registered_targets().items()}


def finding_record(rec: CaseRecord, findings: dict[str, tuple[Finding, ...]]) -> FindingRecord | None:
    """The finding a FAIL or ERROR record matches: the one it carries, or (a file written before
    records carried one) the target's matching finding as registered now."""
    if rec["verdict"] != "FAIL":
        return None
    if rec.get("finding"):
        return rec["finding"]
    found = finding_for(findings.get(rec["target"], ()), rec["layout"], rec["norm"])
    if found is not None and rec.get("synthetic"):
        found = dataclasses.replace(found, reach=synthetic(rec["synthetic"] or ""))
    return found.record() if found is not None else None


def _ratio(rec: CaseRecord) -> str:
    """The row's ratio; "raised" where the clip raised instead of reporting one."""
    if rec["verdict"] == "SKIP":
        return NONE
    if rec["ratio"] is None:
        failed = [n for n, c in rec["checks"].items() if not c["passed"]]
        return "raised" if "raised" in failed else NONE
    return format_ratio(rec["ratio"])


def _reach(rec: CaseRecord, finding: FindingRecord | None) -> str:
    if finding is not None:
        return finding["reach"]
    if rec.get("synthetic"):
        return "synthetic"
    return "?" if rec["verdict"] == "FAIL" else "-"


HEAD = ["framework", "target", "scenario", "layout", "norm", "dtype", "world", "verdict", "ratio", "reach",
        "upstream report or finding"]


def compat_rows(records: Iterable[Record]) -> list[list[str]]:
    findings = registered_findings()
    rows = []
    for rec in case_records(records):
        if not rec.get("framework") and rec["verdict"] != "SKIP":
            continue
        if rec["verdict"] == "SKIP" and not rec.get("skip_reason"):
            continue
        framework = rec.get("framework") or f"{rec['target']} (not installed)"
        finding = finding_record(rec, findings)
        explained = finding["text"] if finding is not None else (
            UNEXPLAINED if rec["verdict"] == "FAIL" else "-")
        if rec["verdict"] == "ERROR":
            explained = "not judged: " + ", ".join(n for n, c in rec["checks"].items() if not c["passed"])
        if rec["verdict"] == "SKIP" and rec.get("framework"):
            explained = f"skipped: {rec.get('skip_reason')}"
        rows.append([framework, rec["target"], rec["scenario"], rec["layout"], rec["norm"], rec["dtype"],
                     str(rec["world_size"]), rec["verdict"], _ratio(rec), _reach(rec, finding), explained])
    return sorted({tuple(r): r for r in rows}.values(), key=lambda r: (r[0], r[2], int(r[6]), r[3], r[1], r[4], r[5]))


@dataclass
class FiledFinding:
    """One finding and every row that shows it."""

    finding: FindingRecord
    frameworks: set[str] = field(default_factory=set)
    layouts: set[str] = field(default_factory=set)
    rows: int = 0


def filed_findings(records: Iterable[Record]) -> list[FiledFinding]:
    """Each distinct finding once (by owner, upstream report and mechanism), with the frameworks,
    targets and layouts whose FAIL rows show it: a torch mechanism that several frameworks inherit
    is one entry, under torch."""
    findings = registered_findings()
    filed: dict[tuple[str | None, str | None, str, str], FiledFinding] = {}
    for rec in case_records(records):
        finding = finding_record(rec, findings) if rec.get("framework") else None
        if finding is None:
            continue
        key = (finding["owner"], finding["upstream"], finding["note"], finding["reach"])
        entry = filed.setdefault(key, FiledFinding(finding))
        entry.frameworks.add(f"{rec['framework']} ({rec['target']})")
        entry.layouts.add(f"{rec['scenario']} {rec['layout']} {rec['norm']}")
        entry.rows += 1
    return sorted(filed.values(), key=lambda e: (e.finding["owner"] or "", e.finding["text"]))


def markdown(rows: list[list[str]], filed: list[FiledFinding] | None = None) -> str:
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if filed:
        lines += ["", "Findings (each once; `owner` where the mechanism is not the framework's own code):", "",
                  "| owner | reach | how it is reached | finding | shown by | rows | reproduction |",
                  "|---|---|---|---|---|---|---|"]
        for e in filed:
            f = e.finding
            lines.append(f"| {f['owner'] or '-'} | {f['reach']} | {f['how']} | {f['text']} | "
                         f"{', '.join(sorted(e.frameworks))} | {e.rows} | {f['repro'] or '-'} |")
    return "\n".join(lines)
