"""Where each rank of a launch is, in a file its launcher can read after the rank died.

Why: a rank that dies (a signal, a native crash) says nothing, and its launcher relaunches the later
cases. When it died in the harness's own work (building the model, injecting, measuring: phases that
every case repeats), the relaunched ranks die there again; the launcher must know that to stop instead
of relaunching up to ``--max-resumes`` times. Each rank writes the phase it enters into a small file of
its own (one ``pwrite`` of a few bytes on a descriptor opened once: nothing a case would notice), and
clears it when the phase ends; the launcher reads the dead rank's file (``phase_of``).
"""

from __future__ import annotations

import os

PHASE_DIR_ENV = "CLIPCHECK_PHASE_DIR"
"""Set by ``clipcheck run`` for its ranks: the folder of their phase files."""

WIDTH = 64
"""Bytes a mark takes (a phase name, padded with spaces): each write replaces the whole mark."""


def _path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.phase")


class PhaseMarks:
    """This rank's phase file, or nothing where no launcher asked for one (torchrun, a warm pool)."""

    def __init__(self, rank: int) -> None:
        folder = os.environ.get(PHASE_DIR_ENV)
        self._fd: int | None = None
        if folder:
            try:
                self._fd = os.open(_path(folder, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            except OSError:  # an unwritable folder: the launcher then knows no phase, as before
                self._fd = None

    def mark(self, phase: str) -> None:
        """This rank is now in ``phase`` of the harness's own work ("": none)."""
        if self._fd is not None:
            os.pwrite(self._fd, phase.encode()[:WIDTH].ljust(WIDTH), 0)


def phase_of(folder: str, rank: int) -> str | None:
    """The phase of the harness's own work ``rank`` was in when it last wrote its mark; None: none."""
    try:
        with open(_path(folder, rank), "rb") as f:
            text = f.read(WIDTH).decode(errors="replace").strip()
    except OSError:
        return None
    return text or None
