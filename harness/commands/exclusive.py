"""One run per output: a second ``clipcheck run --json P`` or ``clipcheck matrix --out D`` on the same
file or folder is refused with one line (exit 2) before any process starts.

Why: two matrices on the same ``--out`` (two ``./run_matrix.sh`` in one checkout) read back each
other's per-launch records, matched them to their own cases by index, and the one testing a clip that
reports half the norm printed "12 passed => PASS" and exited 0; two ``clipcheck run --json same.jsonl``
took their status from each other's records; started together, both died of a JSONDecodeError on each
other's half-written lines. Launchers now read back only files
of their own (``launcher``: a private folder per launch), and the output a run writes for the user is
held under an advisory lock (``flock``) for as long as the run lives; the kernel drops it when the
process ends, however it ends.

Only regular files and folders are locked: ``--json /dev/stdout`` names the terminal, which two runs
may well share.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from harness.errors import ClipcheckInputError


class OutputClaim:
    """An exclusive hold on a results file or an output folder (``release`` or process exit ends it)."""

    def __init__(self, path: str | Path, what: str) -> None:
        self._fd: int | None = None
        target = Path(path)
        if target.is_dir():
            fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
        elif not target.exists() or target.is_file():
            # no O_TRUNC: a file another run is writing must not be emptied by the run it refuses
            fd = os.open(target, os.O_WRONLY | os.O_CREAT, 0o644)
        else:  # a device, a pipe, a terminal: nothing to share by accident
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ClipcheckInputError(f"{what} {path}: another clipcheck run is writing it now; give this one "
                                      "its own") from None
        except OSError:  # a file system without locks: nothing to hold
            os.close(fd)
            return
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "OutputClaim":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
