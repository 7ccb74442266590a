"""The watchdog's own contract (``harness.run.guards.watchdog``): one thread per process serves every
watched call, so a call that finished must not be reported, a hang must be, and a forked child
(the pool's workers come from a fork server) must get a watchdog of its own."""

from __future__ import annotations

import os
import time

from harness.run.guards.watchdog import watched


def test_a_call_that_finishes_in_time_is_not_reported_and_a_hang_is_with_its_stack():
    reports: list[str] = []
    for _ in range(200):  # many short calls: each disarms its own deadline, none leaks into the next
        with watched(0.5, reports.append):
            pass
    with watched(0.2, reports.append):
        time.sleep(0.8)
    assert len(reports) == 1 and "time.sleep" in reports[0], reports


def test_the_call_after_a_hang_is_watched_again():
    reports: list[str] = []
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
        reports: list[str] = []
        with watched(0.2, reports.append):
            time.sleep(0.8)
        os._exit(0 if reports else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
