"""``AuditReport``: what ``harness.audit`` found on one rank, defined once.

``run_audit`` (``session``) returns it and ``harness.auditor`` re-exports it as the public type. It
was two types, the session's outcome copied field for field into the public report by position, so
a field added to one silently shifted every later one in the other; here it is one type whose fields
are given by name only (``kw_only``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from harness.judge.records import CaseRecord, CaseResult


@dataclass(kw_only=True)
class AuditReport:
    """What ``audit`` found, on one rank. Rank 0 holds the judged case (``result``, ``record()``,
    ``save``); every rank holds the verdict and its text."""

    verdict: str
    """PASS, FAIL, or ERROR (a rank hung or died in the clip, or the audit itself could not judge)."""
    text: str
    rank: int
    world_size: int
    backend: str
    result: CaseResult | None = None
    """Rank 0's judged case (None on the other ranks, and when the job broke before it was judged)."""
    broken: bool = False
    """A rank hung or died in the clip: the job's process groups cannot be trusted any more."""
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    """Where the audit's time went, by phase (measure, classes, snapshot, call, effects, blame)."""
    value: Any = None
    """What the clip returned on this rank (what ``auditing`` hands back to its caller)."""

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"

    def describe(self) -> str:
        """The case as ``clipcheck run`` prints it: its line, every failed check, the signature and the
        blame; then the audit's notes."""
        return self.text + "".join(f"\nnote: {n}" for n in self.notes)

    def record(self) -> CaseRecord | None:
        """Rank 0: the case as a JSON Lines record (``--json``'s), None elsewhere."""
        if self.result is None:
            return None
        from harness.report.reporter import case_json

        return case_json(self.result, self.world_size, self.backend)

    def save(self, path: str) -> bool:
        """Rank 0: write the measured layout (names, local shapes, dtypes, which ranks hold copies of
        what, each gradient's norm) and what the audit found, for ``clipcheck run --from-audit PATH
        --target T``; False (nothing written) on the other ranks, or when nothing was measured."""
        if self.result is None:
            return False
        from harness.cases.measured import audit_doc

        case = self.result.case
        found = {"truth": self.result.truth, "reported": self.result.reported, "verdict": self.verdict,
                 "target": case.target, "signature": self.result.signature, "backend": self.backend}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(audit_doc(case.variant, case.norm_type, case.max_norm, self.world_size, found), f)
            f.write("\n")
        return True
