"""Bounded time for the function under test: a watchdog thread that notices a Python-level hang,
captures where the rank is stuck, and hands that to whoever can still report it.

Why a thread and not ``faulthandler.dump_traceback_later(exit=True)`` alone: faulthandler kills the
process, so the peers (and the launcher) learn only that a rank vanished, never in which case or
where. The watchdog runs while the main thread sleeps, waits on a lock or a store, or loops in
Python (the GIL is released every few milliseconds), formats the main thread's stack, and calls
``on_hang(stack)``; the runner then tells the other ranks through the rendezvous store, rank 0 writes
the hung case's record and the summary, and the run ends with exit status 3. faulthandler stays as a
backstop, with a later deadline, for code that holds the GIL forever.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Callable, Iterator

BACKSTOP_GRACE_S = 60.0
"""How long after the watchdog faulthandler kills a rank the watchdog could not help."""

def main_thread_stack() -> str:
    """The main thread's Python stack, innermost frame last (the watchdog runs in another thread)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "(no stack: the main thread is gone)"
    return "".join(traceback.format_stack(frame)).rstrip()


def _stderr_fd() -> int:
    """faulthandler needs a real descriptor; a captured sys.stderr (pytest's capsys) has none."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        return 2


class _Watchdog:
    """One thread per process, armed for each watched call and disarmed after it: starting and
    joining a thread per call cost as much as a small clip function itself (``bench/phase_profile.py``).
    A watchdog that fired stays with its ``on_hang`` (which may never return) and the next call gets
    a new one."""

    def __init__(self) -> None:
        self._forget_thread()
        self._calls = 0

    def _forget_thread(self) -> None:
        """A fresh lock and no thread: also what a forked child needs, since fork copies the
        object but not the thread (nor a lock state it could have been holding)."""
        self._changed = threading.Condition()
        self._armed: tuple[int, float, Callable[[str], None]] | None = None
        self._thread: threading.Thread | None = None

    def arm(self, deadline_s: float, on_hang: Callable[[str], None]) -> int:
        with self._changed:
            self._calls += 1
            self._armed = (self._calls, time.monotonic() + deadline_s, on_hang)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="clipcheck-watchdog", daemon=True)
                self._thread.start()
            self._changed.notify()
            return self._calls

    def disarm(self, call: int) -> None:
        with self._changed:
            if self._armed is not None and self._armed[0] == call:
                self._armed = None
                self._changed.notify()

    def _watch(self) -> None:
        with self._changed:
            while True:
                if self._armed is None:
                    self._changed.wait()
                    continue
                _, deadline, on_hang = self._armed
                left = deadline - time.monotonic()
                if left > 0:
                    self._changed.wait(left)
                    continue
                self._armed, self._thread = None, None  # this thread now belongs to on_hang
                break
        on_hang(main_thread_stack())


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG._forget_thread)


@contextmanager
def watched(deadline_s: float, on_hang: Callable[[str], None]) -> Iterator[None]:
    """Run the body; if it has not finished after ``deadline_s``, call ``on_hang(stack)`` from the
    watchdog thread (once). The body itself is not interrupted: Python cannot stop a thread."""
    faulthandler.dump_traceback_later(deadline_s + BACKSTOP_GRACE_S, exit=True, file=_stderr_fd())
    call = _WATCHDOG.arm(deadline_s, on_hang)
    try:
        yield
    finally:
        _WATCHDOG.disarm(call)
        faulthandler.cancel_dump_traceback_later()
