"""Threads and processes the function under test leaves running after it returns.

A clip that starts a thread doing collectives on the default group, and returns while it runs, once
made the *next*, correct target fail: the leaked thread's all-reduces met the next case's (3 of its
cases failed). A clip that forks a child (a sleeper, or one running collectives on the sockets it
inherited) kept ``clipcheck run`` waiting long past every timeout. Both are the target's own fault
(``contract``), named on its case:

* a process it left is killed at once, and every rank builds fresh groups (the child may have used
  the inherited ones): ``census`` before the call, ``left_behind`` after it;
* a thread cannot be stopped in Python, and fresh groups do not help (its next ``dist.all_reduce``
  uses the new default group). A thread still running once the case has waited for it
  (``aftermath.settled_changes``) therefore stops the world after the case
  (``DistWorld.stop_after_case``): ``clipcheck run`` resumes in fresh processes, a warm world
  (``RankPool``) restarts, plain torchrun records the remaining cases as not run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from harness.run.guards.family import descendants, end_descendants, has_children

LEFTOVER_GRACE_S = 1.0
"""How long a child the target started may take to end after it returned before it is killed."""


@dataclass(frozen=True)
class Census:
    """The child processes alive before the target was called."""

    processes: frozenset[int]


def census() -> Census:
    """Cheap when there is nothing to count: /proc is read only if this process has children."""
    return Census(frozenset(descendants() if has_children() else ()))


def left_behind(before: Census, grace_s: float = LEFTOVER_GRACE_S) -> str | None:
    """The fault of a target that left processes running (started since ``before``, alive ``grace_s``
    from now): they are killed, and named; None when it left none."""
    if not has_children() or not descendants() - before.processes:
        return None
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and descendants() - before.processes:
        time.sleep(0.05)
    killed = end_descendants(spare=before.processes)
    if not killed:
        return None
    return f"left {len(killed)} process(es) running after it returned (pids {', '.join(map(str, killed[:4]))}; killed)"


def threads_fault(running: list[str]) -> str:
    shown = ", ".join(running[:3]) + (", ..." if len(running) > 3 else "")
    return (f"left {len(running)} thread(s) running after it returned ({shown}): whatever they do next would "
            "reach the next case, so this world runs no other case")
