"""The guard around every call into the function under test (or its framework's setup), and the
agreement every rank reaches after it, through the store: a case's runner and ``harness.audit`` both
call a target this way, so a raise, a hang or a broken group is handled alike in both."""

from __future__ import annotations

import os
import sys
import time
import traceback
from contextlib import nullcontext
from types import TracebackType
from typing import Any, Callable

from harness.judge.checks import is_collateral
from harness.run.guards.watchdog import HungStack, watched
from harness.run.world.devices import settle
from harness.run.world.dist_world import DistWorld, WorldBroken


def describe_exception(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {message[:300]}{where}"


_CALLERS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), folder) + os.sep
                 for folder in ("case", "audit"))
"""The folders of the harness's code between the guard and the target (the runner's call, the audit's)."""


GUARDED_STEPS = {"dress": "the framework's setup (the target's dress)", "backward": "the framework's backward"}
"""What a guarded call is, by its topic, where it is not the function under test itself."""


def hang_message(stack: HungStack, deadline_s: float, topic: str = "status") -> str:
    """What a hung call says: where it is stuck, then its stack from the target's call down (the
    target's own frames, which say what hung, lead; the harness's frames that made the call are left
    out), then the whole stack, launcher frames included, for whoever needs it. The whole stack ends in
    the innermost frame, as a traceback does (``harness.run.audit.session`` reads it there)."""
    call = stack.body
    while call and call[0].filename.startswith(_CALLERS):
        call = call[1:]
    call = call or stack.body or list(stack.frames)
    where = f" in {call[-1].name} at {call[-1].filename}:{call[-1].lineno}" if call else ""
    lead = "".join(traceback.format_list(call)).rstrip()
    what = GUARDED_STEPS.get(topic, "the function under test")
    return (f"hung: no answer from {what} after {deadline_s:.0f} s, stuck{where}; "
            f"its stack from the call down (innermost last):\n{lead}\n"
            f"the whole stack, outermost first (the launcher's frames included):\n{stack.text()}")


IN_PHASE = "in the harness's {phase} phase"
"""How a hang or a death in one of the harness's own phases names it (``phase_hang_message``, the
launcher's crash detail); ``harness_phase_of`` reads it back."""


def phase_hang_message(phase: str, stack: HungStack, deadline_s: float) -> str:
    """What a hang in one of the harness's own phases says: the phase, where it is stuck, and the stack
    from the line of the case that began the phase down (the launcher's frames above it say nothing
    about the hang)."""
    frames = list(stack.frames[max(stack.body_at - 1, 0):])
    where = f" in {frames[-1].name} at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return (f"hung {IN_PHASE.format(phase=phase)}: no progress after {deadline_s:.0f} s, stuck{where}; "
            f"its stack from the phase down (innermost last):\n{''.join(traceback.format_list(frames)).rstrip()}")


def harness_phase_of(detail: str) -> str | None:
    """The phase of the harness's own work a hang's or a death's detail names (``IN_PHASE``), or None (the
    target hung or killed its rank, or no phase is known)."""
    head, _, tail = IN_PHASE.partition("{phase}")
    at = detail.find(head)
    if at < 0:
        return None
    phase = detail[at + len(head):].split(tail, 1)
    return phase[0] if len(phase) == 2 else None


class phase_watch(watched):
    """``with phase_watch(world, "build"): ...``: one phase of the harness's own work in a case, bounded as
    the target's call is. A hang there (a native deadlock as much as a Python loop) is posted for every
    rank (``DistWorld.post_phase_hang``): the case is recorded as a hang naming the phase and the rank's
    stack, and the launch goes on with the later cases in fresh ranks. The phase is also marked where
    the launcher can read it should the rank die in it (``DistWorld.phase_marks``). The phase's waits
    for other ranks in the store do not count (``watched.paused``: the rank they wait for is the one
    stuck). Never around a ``guarded`` call: one watch at a time."""

    def __init__(self, world: DistWorld, phase: str) -> None:
        def on_hang(stack: HungStack) -> None:
            world.post_phase_hang(phase_hang_message(phase, stack, world.hang_deadline_s))

        super().__init__(world.hang_deadline_s, on_hang)
        self.world = world
        self.phase = phase

    def __enter__(self) -> None:
        self.world.while_waiting = self.paused
        self.world.phase_marks.mark(self.phase)
        self._arm(sys._getframe(1))

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.world.while_waiting = nullcontext
        self.world.phase_marks.mark("")
        super().__exit__(kind, exc, tb)


def guarded(world: DistWorld, topic: str, fn: Callable[[], Any]) -> tuple[Any, str | None, float]:
    """Run a piece of the function under test (or its framework's setup) on this rank without
    letting a failure leave the rank out of step: an exception is caught and the rank abandons its
    groups at once, so peers blocked in a collective with it fail fast; a hang past the deadline is
    posted as this rank's entry of the ``topic`` exchange, with its stack. GPU work queued by ``fn``
    is settled inside the guard (``devices.settle``): on nccl it is where an error or a stuck kernel
    of the target's shows up."""
    start = time.perf_counter()

    def on_hang(stack: HungStack) -> None:
        world.post_hung(topic, {"error": hang_message(stack, world.hang_deadline_s, topic), "fault": None,
                                "broken": True})

    with watched(world.hang_deadline_s, on_hang):
        try:
            value = fn()
            settle(world.device)
        except Exception as exc:  # the code under test may raise anything
            error = describe_exception(exc)
            world.left_call(raised=True)  # abandons the groups unless every rank has left the call
            return None, error, time.perf_counter() - start
    world.left_call(raised=False)
    return value, None, time.perf_counter() - start


def agree(world: DistWorld, topic: str, status: dict[str, Any], case_done: bool = False) -> list[dict[str, Any]]:
    """Every rank learns every rank's status (through the store). A hung rank ends the run; a rank that
    abandoned its groups, a broken default group, ranks that disagree (some raised, some did not) or a
    raise that a broken connection caused mean a fresh generation of groups on every rank, at once. At a
    case's end (``case_done``: the target's call has returned) a rank holding more than ``GROUP_BUDGET``
    groups makes a renewal due on every rank, done before a later case (``DistWorld.before_case``), once
    this case's model no longer holds them. A raise on every rank, nobody abandoned, keeps the groups: a
    target that built its own (once, as Megatron and DeepSpeed do) still has them at its next call."""
    statuses = world.allgather_json(topic, dict(status, abandoned=world.abandoned, groups=world.groups_alive()),
                                    world.exchange_deadline_s)
    hung = [r for r, s in enumerate(statuses) if s.get("hung")]
    if hung:  # those that raised meanwhile are named too: often what left the others waiting
        raised = [f"rank {r} raised {s['error']}" for r, s in enumerate(statuses) if r not in hung and s.get("error")]
        raise WorldBroken(hung, "; ".join([*(f"rank {r}: {statuses[r]['error']}" for r in hung), *raised]))
    failed = [s["error"] is not None for s in statuses]
    if (any(s.get("broken") or s.get("abandoned") for s in statuses) or any(failed) != all(failed)
            or any(is_collateral(s["error"]) for s in statuses if s["error"] is not None)):
        world.regenerate()
    elif case_done:
        world.groups_at_case_end = max(s.get("groups", 0) for s in statuses)  # alike on every rank
    return statuses
