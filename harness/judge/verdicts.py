"""One way to count verdicts and turn them into an exit status, for a single launch, a merged
matrix, JUnit and the summary lines alike. Works on JSON records (what the JSON Lines file holds).

An ERROR is never a pass. Two kinds are told apart because they mean different things to a user:
a *harness error* (the harness's own self-check failed: ``truth``) and an *unjudged* case (a rank
hung or died, the run was interrupted or ended before the case: checks ``hang``, ``crash``,
``interrupted``, ``not_run``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from harness.judge.records import SummaryRecord

UNJUDGED_CHECKS = ("hang", "crash", "not_run", "interrupted")

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_BROKEN, EXIT_NOTHING_JUDGED, EXIT_OUTPUT = 0, 1, 2, 3, 4, 5
"""0 every case passed (and at least one was judged); 1 a case or metamorphic group failed, or a
harness error; 2 bad input; 3 a rank hung or died, or some planned case was not judged; 4 nothing was
judged (no case planned from ``--start-at`` on, or every case a SKIP): no verdict is not a pass;
5 a results file could not be written (disk full, I/O error): the console has every verdict, the
file does not. An interrupted command exits 128 + the signal (130 SIGINT, 143 SIGTERM)."""

_PRECEDENCE = (EXIT_USAGE, EXIT_OUTPUT, EXIT_BROKEN, EXIT_FAIL, EXIT_NOTHING_JUDGED, EXIT_PASS)


def worst(*statuses: int) -> int:
    """The status a run made of parts (worlds, launches, targets, files) exits with: the most serious
    of its parts' (bad input, then unwritten results, unjudged cases, failures, nothing judged, pass);
    an interruption (128 + signal) and any status not listed above rank first. Never ``max``: 4 (nothing
    judged here) must not hide 3 (a rank died there), nor 3 hide 5."""
    def rank(status: int) -> int:
        return _PRECEDENCE.index(status) if status in _PRECEDENCE else -1
    return min(statuses, key=rank, default=EXIT_PASS)

EXIT_STATUSES = {
    EXIT_PASS: "every case passed, and at least one was judged",
    EXIT_FAIL: "a case or metamorphic group failed, or a harness error",
    EXIT_USAGE: "bad input (said in one line, before any process starts)",
    EXIT_BROKEN: "a rank hung or died, or a planned case was not judged",
    EXIT_NOTHING_JUDGED: "nothing was judged (no case planned, or every case a SKIP)",
    EXIT_OUTPUT: "a results file could not be written (disk full, I/O error); the console has every verdict",
    128 + 2: "interrupted by SIGINT (143: SIGTERM); what finished is recorded, with the summary",
}
"""What each exit status means, the same for every command (``clipcheck --help`` lists them)."""


def is_unjudged(record: Mapping[str, Any]) -> bool:
    """An ERROR record whose target was never judged (a crash, a hang, a case not run); a results file
    is read back from disk, so a missing or null ``checks`` is a record without checks, not a crash."""
    checks = record.get("checks")
    return record.get("verdict") == "ERROR" and isinstance(checks, Mapping) and any(n in UNJUDGED_CHECKS for n in checks)


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
        if not self.passed:  # zero cases, or only skips: nothing was judged, which is not a pass
            return EXIT_NOTHING_JUDGED
        return EXIT_PASS

    @property
    def word(self) -> str:
        return {EXIT_PASS: "PASS", EXIT_FAIL: "FAIL", EXIT_BROKEN: "ERROR",
                EXIT_NOTHING_JUDGED: "NOTHING JUDGED"}[self.status]

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
    without ``passed`` a failed one; nothing unrecognised counts as a pass. An ``in_flight`` marker
    (rank 0 writes one before each case) that no case record follows is a case whose rank 0 died
    mid-case (plain torchrun, a gloo abort): counted as not judged."""
    counts = Counts()
    in_flight: set[tuple[Any, ...]] = set()
    for rec in records:
        kind = rec.get("type", "case")
        if kind == "in_flight":
            in_flight.add(case_identity(rec))
            continue
        if kind == "case":
            in_flight.discard(case_identity(rec))
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
    counts.cases += len(in_flight)
    counts.unjudged += len(in_flight)
    return counts


def case_identity(record: Mapping[str, Any]) -> tuple[Any, ...]:
    """What ties a case record to the ``in_flight`` marker written before it."""
    return tuple(record.get(key) for key in ("index", "scenario", "layout", "target", "world_size"))
