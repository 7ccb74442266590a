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
import sys
import threading
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


@contextmanager
def watched(deadline_s: float, on_hang: Callable[[str], None]) -> Iterator[None]:
    """Run the body; if it has not finished after ``deadline_s``, call ``on_hang(stack)`` from a
    watchdog thread (once). The body itself is not interrupted: Python cannot stop a thread."""
    fired = threading.Event()
    done = threading.Event()

    def watch() -> None:
        if not done.wait(deadline_s):
            fired.set()
            on_hang(main_thread_stack())

    thread = threading.Thread(target=watch, name="clipcheck-watchdog", daemon=True)
    faulthandler.dump_traceback_later(deadline_s + BACKSTOP_GRACE_S, exit=True, file=_stderr_fd())
    thread.start()
    try:
        yield
    finally:
        done.set()
        faulthandler.cancel_dump_traceback_later()
        if not fired.is_set():
            thread.join()
