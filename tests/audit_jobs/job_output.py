"""What an audit job's rank 0 writes for the test that launched it (tests/audit_runs.py reads it back)."""

from __future__ import annotations

import json
from typing import Any, Sequence

import torch.distributed as dist

from harness.auditor import AuditReport


def write(out: str, report: AuditReport | None, **extra: Any) -> None:
    """Rank 0: the case record, the text, the verdict and notes of ``report``, and ``extra``; then a barrier,
    so no rank leaves while another still needs the job's groups."""
    if dist.get_rank() == 0:
        found: dict[str, Any] = {"record": None, "text": None, "passed": None, "verdict": None, "notes": []}
        if report is not None:
            found.update(record=report.record(), text=report.describe(), passed=report.passed,
                         verdict=report.verdict, notes=report.notes)
        found.update(extra)
        with open(out, "w", encoding="utf-8") as f:
            json.dump(found, f)
        print(found["text"], flush=True)
    dist.barrier()


def save_as_asked(report: AuditReport, options: Sequence[str]) -> None:
    """``report.save(PATH)`` for a ``save=PATH`` among a job's options: the layout a replay test reads back."""
    for option in options:
        if option.startswith("save="):
            report.save(option[len("save="):])
