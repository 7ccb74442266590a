"""One way to count verdicts and turn them into an exit status, for a single launch, a merged
matrix, JUnit and the summary lines alike. Works on JSON records (what the JSON Lines file holds).

An ERROR is never a pass. Two kinds are told apart because they mean different things to a user:
a *harness error* (the harness's own self-check failed: ``truth``) and an *unjudged* case (a rank
hung or died, or the run ended before the case: checks ``hang``, ``crash``, ``not_run``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from harness.judge.records import SummaryRecord

UNJUDGED_CHECKS = ("hang", "crash", "not_run")

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_BROKEN = 0, 1, 2, 3
"""0 every case passed; 1 a case or metamorphic group failed, or a harness error; 2 bad input;
3 a rank hung or died, or some planned case was not judged."""

EXIT_STATUSES = {
    EXIT_PASS: "every case passed",
    EXIT_FAIL: "a case or metamorphic group failed, or a harness error",
    EXIT_USAGE: "bad input (said in one line, before any process starts)",
    EXIT_BROKEN: "a rank hung or died, or a planned case was not judged",
}
"""What each exit status means, the same for every command (``clipcheck --help`` lists them)."""


def is_unjudged(record: Mapping[str, Any]) -> bool:
    return record.get("verdict") == "ERROR" and any(name in UNJUDGED_CHECKS for name in record.get("checks", {}))


@dataclass
class Counts:
    cases: int = 0
    passed: int = 0
    failed: int = 0
    harness_errors: int = 0
    unjudged: int = 0
    skipped: int = 0
    metamorphic_groups: int = 0
    metamorphic_failed: int = 0

    @property
    def errors(self) -> int:
        """Cases that were not a verdict on the target: harness errors and unjudged cases."""
        return self.harness_errors + self.unjudged

    @property
    def status(self) -> int:
        if self.unjudged:
            return EXIT_BROKEN
        if self.failed or self.harness_errors or self.metamorphic_failed:
            return EXIT_FAIL
        return EXIT_PASS

    @property
    def word(self) -> str:
        return {EXIT_PASS: "PASS", EXIT_FAIL: "FAIL", EXIT_BROKEN: "ERROR"}[self.status]

    def line(self) -> str:
        unjudged = f", {self.unjudged} not judged (hang, crash or not run)" if self.unjudged else ""
        return (f"{self.cases} cases, {self.passed} passed, {self.failed} failed, {self.harness_errors} harness "
                f"errors{unjudged}, {self.skipped} skipped; metamorphic groups: {self.metamorphic_groups}, "
                f"{self.metamorphic_failed} failed => {self.word}")

    def as_record(self) -> SummaryRecord:
        return {"type": "summary", "cases": self.cases, "passed": self.passed, "failed": self.failed,
                "harness_errors": self.harness_errors, "unjudged": self.unjudged, "skipped": self.skipped,
                "metamorphic_groups": self.metamorphic_groups, "metamorphic_failed": self.metamorphic_failed,
                "ok": self.status == EXIT_PASS, "status": self.status}


def count(records: Iterable[Mapping[str, Any]]) -> Counts:
    """Count case and metamorphic records (others are ignored). Records read from a file are taken as
    they come: one without a type is a case, an unknown or missing verdict a harness error, a group
    without ``passed`` a failed one; nothing unrecognised counts as a pass."""
    counts = Counts()
    for rec in records:
        kind = rec.get("type", "case")
        if kind == "metamorphic":
            counts.metamorphic_groups += 1
            counts.metamorphic_failed += not rec.get("passed", False)
            continue
        if kind != "case":
            continue
        counts.cases += 1
        verdict = rec.get("verdict")
        if verdict == "PASS":
            counts.passed += 1
        elif verdict == "FAIL":
            counts.failed += 1
        elif verdict == "SKIP":
            counts.skipped += 1
        elif is_unjudged(rec):
            counts.unjudged += 1
        else:
            counts.harness_errors += 1
    return counts
