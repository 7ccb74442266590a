"""The user's ``--json`` file of a ``clipcheck run`` launch, written as each case ends.

Rank 0 writes its records to a file in the launcher's private folder, one per launch attempt (the
launcher reads back nothing else: see ``exclusive``); a thread of the launcher copies each case
record and in-flight marker from there into the user's file as it appears. The user's file has one
writer, the launcher, so a full disk there is one line at the end (``results_file``) and never
makes a passing case look like a crash. At the end the launcher rewrites it whole: every planned
case once, the metamorphic groups, the summary.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from harness.judge.verdicts import is_unjudged
from harness.report.results_file import ResultsFile

POLL_S = 0.2


def worth_mirroring(line: str) -> bool:
    """Case records and in-flight markers; not the ``not_run`` records of a launch that ended early
    (the next launch runs those cases), nor a launch's own summary."""
    try:
        record = json.loads(line)
    except ValueError:
        return False
    if not isinstance(record, dict):
        return False
    if record.get("type") == "in_flight":
        return True
    return record.get("type") == "case" and not (is_unjudged(record) and "not_run" in record.get("checks", {}))


class ResultsMirror:
    """Follows one source file at a time (``follow``), appending what is worth it to ``dest``."""

    def __init__(self, dest: str) -> None:
        self.out = ResultsFile(dest)
        self._source: Path | None = None
        self._offset = 0
        self._partial = ""
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="clipcheck-results-mirror", daemon=True)
        self._thread.start()

    def follow(self, source: Path) -> None:
        """Copy what is left of the current source, then follow ``source`` from its start."""
        with self._lock:
            self._copy_new()
            self._source, self._offset, self._partial = source, 0, ""

    def _run(self) -> None:
        while not self._stopped.wait(POLL_S):
            with self._lock:
                self._copy_new()

    def _copy_new(self) -> None:
        if self._source is None or not self._source.exists():
            return
        with open(self._source, encoding="utf-8", errors="replace") as f:
            f.seek(self._offset)
            text = f.read()
            self._offset = f.tell()
        *complete, self._partial = (self._partial + text).split("\n")
        for line in complete:
            if worth_mirroring(line):
                self.out.write_line(line)

    def close(self) -> str | None:
        """Copy the rest, stop, close the file; why it could not all be written, or None."""
        self._stopped.set()
        self._thread.join()
        with self._lock:
            self._copy_new()
        self.out.close()
        return self.out.problem()
