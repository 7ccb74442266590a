"""Bounded time for the function under test: a watchdog thread that notices a Python-level hang,
captures where the rank is stuck, and hands that to whoever can still report it.

Why a thread and not ``faulthandler.dump_traceback_later(exit=True)`` alone: faulthandler kills the
process, so the peers (and the launcher) learn only that a rank vanished, never in which case or
where. The watchdog runs while the main thread sleeps, waits on a lock or a store, or loops in
Python (the GIL is released every few milliseconds), takes the main thread's stack, and calls
``on_hang(stack)`` (a ``HungStack``: the whole stack, and which of its frames are the watched body's,
under the launcher's and the harness's own); the runner then tells the other ranks through the
rendezvous store, rank 0 writes the hung case's record and the summary, and the run ends with exit
status 3. faulthandler stays as a backstop, with a later deadline, for code that holds the GIL forever.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from types import FrameType, TracebackType
from contextlib import contextmanager
from typing import Callable, Iterator

BACKSTOP_GRACE_S = 60.0
"""How long after the watchdog faulthandler kills a rank the watchdog could not help."""


@dataclass(frozen=True)
class HungStack:
    """Where the main thread is stuck. ``frames`` is its whole stack, outermost first: under a launcher
    most of it is the launcher's and the harness's own frames (torchrun, multiprocessing, the case
    loop), and the frames that say what hung are the last few, those of the watched body. So the
    stack keeps where that body begins (``body_at``), for a report to lead with them."""

    frames: traceback.StackSummary
    body_at: int
    """The index in ``frames`` of the body's outermost frame (``len(frames)``: none is the body's)."""

    @property
    def body(self) -> list[traceback.FrameSummary]:
        """The watched body's frames, outermost first: the call it made, down to where it is stuck."""
        return list(self.frames[self.body_at:])

    def text(self) -> str:
        """The whole stack as a traceback prints it, innermost frame last."""
        return "".join(self.frames.format()).rstrip() or "(no stack: the main thread is gone)"


def main_thread_stack(entered: FrameType | None = None) -> HungStack:
    """The main thread's Python stack (the watchdog runs in another thread); the frames below
    ``entered`` (the frame that entered the watched block, which the main thread still runs) are the
    body's."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return HungStack(traceback.StackSummary(), 0)
    body = 0
    walk: FrameType | None = frame
    while walk is not None and walk is not entered:
        body, walk = body + 1, walk.f_back
    frames = traceback.extract_stack(frame)
    return HungStack(frames, len(frames) - body if walk is not None else len(frames))


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
        self._armed: tuple[int, float, Callable[[HungStack], None], FrameType] | None = None
        self._thread: threading.Thread | None = None

    def arm(self, deadline_s: float, on_hang: Callable[[HungStack], None], entered: FrameType) -> int:
        with self._changed:
            self._calls += 1
            self._armed = (self._calls, time.monotonic() + deadline_s, on_hang, entered)
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
                left = self._armed[1] - time.monotonic()
                if left > 0:  # waits holding nothing of the call: its frames, and their locals, die with it
                    self._changed.wait(left)
                    continue
                _, _, on_hang, entered = self._armed
                self._armed, self._thread = None, None  # this thread now belongs to on_hang
                break
        on_hang(main_thread_stack(entered))


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG._forget_thread)


class watched:
    """``with watched(deadline_s, on_hang): body``: if the body has not finished after ``deadline_s``,
    call ``on_hang(stack)`` from the watchdog thread (once). The body itself is not interrupted: Python
    cannot stop a thread. A class rather than a generator so that ``__enter__``'s caller is the frame
    of the ``with`` statement, whatever contextlib does: the frames below it are the body's."""

    def __init__(self, deadline_s: float, on_hang: Callable[[HungStack], None]) -> None:
        self.deadline_s = deadline_s
        self.on_hang = on_hang
        self._call = 0
        self._entered: FrameType | None = None

    def __enter__(self) -> None:
        self._arm(sys._getframe(1))

    def _arm(self, entered: FrameType) -> None:
        self._entered = entered
        faulthandler.dump_traceback_later(self.deadline_s + BACKSTOP_GRACE_S, exit=True, file=_stderr_fd())
        self._call = _WATCHDOG.arm(self.deadline_s, self.on_hang, entered)

    def _disarm(self) -> None:
        _WATCHDOG.disarm(self._call)
        faulthandler.cancel_dump_traceback_later()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._disarm()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """``with watch.paused(): wait``: time the body spends waiting for other processes, which are
        watched themselves, is not the body's: a rank waiting for a stuck peer must not be the one
        reported stuck. The deadline starts afresh after the wait; the watch is otherwise as it was
        (only the deadline is paused: a subclass's ``__exit__`` is not run)."""
        self._disarm()
        try:
            yield
        finally:
            assert self._entered is not None
            self._arm(self._entered)
