"""The watchdog's own contract (``harness.run.guards.watchdog``): one thread per process serves every
watched call, so a call that finished must not be reported, a hang must be, and a forked child
(the pool's workers come from a fork server) must get a watchdog of its own."""

from __future__ import annotations

import gc
import os
import time
import weakref

from harness.run.guards.watchdog import HungStack, watched


def test_a_call_that_finishes_in_time_is_not_reported_and_a_hang_is_with_its_stack():
    reports: list[HungStack] = []
    for _ in range(200):  # many short calls: each disarms its own deadline, none leaks into the next
        with watched(0.5, reports.append):
            pass
    with watched(0.2, reports.append):
        time.sleep(0.8)
    assert len(reports) == 1 and "time.sleep" in reports[0].text(), reports


def _stuck() -> None:
    time.sleep(0.8)


def test_a_hangs_stack_says_which_of_its_frames_are_the_watched_bodys():
    """The frames below the ``with`` statement are the body's: what a report leads with (the rest is
    pytest's, or a launcher's)."""
    reports: list[HungStack] = []
    with watched(0.2, reports.append):
        _stuck()
    (stack,) = reports
    assert [f.name for f in stack.body] == ["_stuck"]
    assert stack.frames[stack.body_at - 1].name == "test_a_hangs_stack_says_which_of_its_frames_are_the_watched_bodys"
    assert len(stack.frames) > len(stack.body) + 5  # pytest's frames above it
    assert stack.text().endswith("time.sleep(0.8)")  # innermost last, as a traceback


def test_the_call_after_a_hang_is_watched_again():
    reports: list[HungStack] = []
    with watched(0.1, reports.append):
        time.sleep(0.4)
    with watched(0.1, reports.append):
        time.sleep(0.4)
    assert len(reports) == 2


def test_a_forked_child_has_a_working_watchdog():
    with watched(5.0, lambda stack: None):  # the parent's watchdog thread exists now
        pass
    pid = os.fork()
    if pid == 0:  # the child: its copy of the watchdog must not think the parent's thread is its own
        reports: list[HungStack] = []
        with watched(0.2, reports.append):
            time.sleep(0.8)
        os._exit(0 if reports else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


class _Big:
    """Stands for what a watched call's caller holds (``harness.audit``'s copy of the gradients)."""


def _call_holding(keep: list["weakref.ref[_Big]"]) -> None:
    held = _Big()
    keep.append(weakref.ref(held))
    with watched(30.0, lambda stack: None):
        time.sleep(0.2)  # the watchdog thread takes the call up (and, before, kept what it took)


def test_a_finished_call_leaves_nothing_of_its_callers_alive():
    """The watchdog thread waits for the next call holding nothing of the last one: it kept the frame
    that entered the watched block, and with it every local of the functions that called it, until the
    next call (harness.audit's restore=True copy of the gradients outlived the audit: two copies at the
    next audit's peak)."""
    keep: list[weakref.ref[_Big]] = []
    with watched(30.0, lambda stack: None):  # the watchdog thread exists and waits
        pass
    _call_holding(keep)
    deadline = time.monotonic() + 5
    while keep[0]() is not None and time.monotonic() < deadline:  # the thread lets go once it wakes
        gc.collect()
        time.sleep(0.01)
    assert keep[0]() is None, "the watchdog still holds the frames of a call that has returned"


class _World:
    """What a phase watch needs of a world: its deadline, marks and where waits look for a pause."""

    def __init__(self) -> None:
        from contextlib import nullcontext

        self.hang_deadline_s = 0.3
        self.while_waiting = nullcontext
        self.marks: list[str] = []
        self.hangs: list[str] = []
        self.phase_marks = self

    def mark(self, phase: str) -> None:
        self.marks.append(phase)

    def post_phase_hang(self, message: str) -> None:
        self.hangs.append(message)


def test_a_phase_stays_watched_and_marked_through_each_of_its_waits_for_peers():
    """Two waits for peers inside one phase (the measure phase has a stats and a replication round): each is
    paused, the phase stays marked, and time spent waiting never counts as the phase's own."""
    from harness.run.case.guard import phase_watch

    world = _World()
    with phase_watch(world, "measure"):  # type: ignore[arg-type]
        for _ in range(2):
            with world.while_waiting():
                time.sleep(0.5)  # past the deadline, but waiting for peers
    assert world.hangs == []
    assert world.marks == ["measure", ""]
    with phase_watch(world, "judge"):  # type: ignore[arg-type]
        time.sleep(0.6)  # its own work past the deadline: reported
    assert len(world.hangs) == 1 and "hung in the harness's judge phase" in world.hangs[0]
