"""Results files that fail in one line, not in a traceback.

A full disk, a quota or an I/O error while a run writes ``--json`` / ``--junit`` raises an OSError in
rank 0's report; let out, the run dies with a traceback, the launcher takes the passing case in flight
for a crash and relaunches it, and the file stays empty. Here a failed write is remembered,
the file is given up (nothing half-written after it), and the run goes on printing every verdict on
the console; at the end the command prints ``problem()`` as one line and exits with
``EXIT_OUTPUT`` (5).
"""

from __future__ import annotations

import json
from typing import IO, Any, Iterable

from harness.judge.verdicts import EXIT_OUTPUT, worst


class ResultsFile:
    """A JSON Lines file written one record at a time, each flushed as it is written."""

    def __init__(self, path: str, append: bool = False) -> None:
        self.path = path
        self.error: str | None = None
        self._file: IO[str] | None = None
        try:
            self._file = open(path, "a" if append else "w", encoding="utf-8")
        except OSError as exc:
            self._give_up(exc)

    def write(self, record: Any) -> None:
        self.write_line(json.dumps(record))

    def write_line(self, line: str) -> None:
        if self._file is None:
            return
        try:
            self._file.write(line + "\n")
            self._file.flush()
        except OSError as exc:
            self._give_up(exc)

    def _give_up(self, exc: OSError) -> None:
        self.error = exc.strerror or str(exc)
        if self._file is not None:
            try:
                self._file.close()
            except OSError:  # the buffer it could not flush: nothing more to do with it
                pass
            self._file = None

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                self._give_up(exc)
            self._file = None

    def problem(self) -> str | None:
        return None if self.error is None else unwritten(self.path, self.error)


def write_text(path: str, text: str) -> str | None:
    """Write a whole file (JUnit, a rewritten results file); the one-line problem, or None."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        return unwritten(path, exc.strerror or str(exc))
    return None


def write_records(path: str, records: Iterable[Any]) -> str | None:
    """Rewrite a JSON Lines file with ``records``; the one-line problem, or None."""
    return write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def unwritten(path: str, why: str) -> str:
    return f"cannot write {path}: {why}; every verdict is on the console, the file is incomplete"


def report_problems(problems: Iterable[str | None], status: int, out: IO[str]) -> int:
    """Print each problem (one line each) and return ``status``, or EXIT_OUTPUT if there was any
    (through ``verdicts.worst``: bad input and interruptions still rank first)."""
    found = [p for p in problems if p]
    for problem in found:
        print(f"clipcheck: error: {problem}", file=out, flush=True)
    return worst(status, EXIT_OUTPUT) if found else status
