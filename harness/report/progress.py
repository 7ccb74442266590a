"""A one-line progress bar for long runs, on rank 0's stderr (stdout stays a clean table)."""

from __future__ import annotations

import sys
import time
from typing import IO


class Progress:
    def __init__(self, total: int, enabled: bool, stream: IO[str] = sys.stderr, width: int = 30) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.stream = stream
        self.width = width
        self.start = time.monotonic()

    def advance(self, label: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        elapsed = time.monotonic() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {rate:5.1f} cases/s {label[:40]:<40}")
        self.stream.flush()

    def clear(self) -> None:
        """Erase the bar so a table line printed next does not land on top of it."""
        if self.enabled and self.done:
            self.stream.write("\r" + " " * (self.width + 70) + "\r")
            self.stream.flush()

    def finish(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
