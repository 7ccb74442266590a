"""One launch's case loop on one rank: run every planned case, rank 0 reports, and a run that breaks
still ends with a record for every planned case and an honest exit status.

How a run can break, and what each rank does:

* a rank hangs in the function under test: its watchdog posts the hang through the store; the other
  ranks raise ``WorldBroken`` at the next exchange. A rank stuck in the harness's own work (building
  the model, injecting, measuring, judging: ``guard.phase_watch``) posts it in the place of its next
  exchanges, and a peer whose collective with it timed out meanwhile reports that hang, not its own
  error. Rank 0 (or rank 0's watchdog, if rank 0 is the one that hung) writes the hung case as an
  ERROR (``hang``, naming the rank and its stack), every later case as ERROR (``not_run``), the
  summary, then sets ``ENDED_KEY``; every rank exits 3;
* a rank stops answering in the store (it died in C code, or hung holding the GIL):
  ``DeadRankError``, handled the same way (``crash``);
* the launcher stops the ranks (SIGTERM: torchrun does that when one rank dies): rank 0 records the
  case in flight as a ``crash`` and the rest as ``not_run`` before it exits;
* the run is interrupted (SIGINT, which torchrun and ``clipcheck run`` pass on to every rank): rank 0
  records the case in flight as ``interrupted`` and the rest as ``not_run``, with the summary; every
  rank exits 130, quietly;
* the target left a thread running (``leftovers``): its case is judged (a ``contract`` fault), then
  the rest are ``not_run`` and the run ends, so that the thread cannot reach another case
  (``clipcheck run`` resumes the launch at the next case in fresh processes);
* rank 0 dies outright (gloo aborts it): nobody is left to write, so before each case rank 0 writes
  an ``in_flight`` marker, and a file that ends with one counts that case as not judged.

Exit status (the same on every rank: ``DistWorld.leave_together``): 0 every case passed, 1 some case
or metamorphic group failed (or a harness error), 3 some planned case was not judged (hang, crash,
not run), 4 nothing was judged, 5 a results file could not be written, 130 interrupted.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from harness.cases.variant import CaseSpec
from harness.judge.records import CaseResult
from harness.judge.checks import amend_late, unjudged_result
from harness.plan.planner import Plan
from harness.report.progress import Progress
from harness.report.reporter import Reporter
from harness.run.case.blame_reruns import run_case_with_blame
from harness.run.case.guard import phase_watch
from harness.run.case.launch_state import LaunchState
from harness.run.world.dist_world import DeadRankError, DistWorld, WorldBroken


STOPPED_DETAIL = ("stopped by SIGTERM while this case ran: under torchrun, another rank died (see the launcher's "
                  "output for its exit code) or the run was interrupted")
INTERRUPTED_DETAIL = "interrupted by SIGINT while this case ran"
EXIT_INTERRUPTED = 128 + signal.SIGINT
PEER_HANG_GRACE_S = 10.0
"""After a harness error, how much longer than a phase's deadline a rank looks for a peer's posted hang:
a collective with a stuck peer times out before that peer's watchdog speaks."""


class StopWatcher:
    """Calls ``on_stop(signum)`` from its own thread as soon as one of ``signals`` arrives, even while
    the main thread is blocked in C++ (a gloo collective waiting for a dead peer), where a Python signal
    handler would only run after torchrun's grace period has already ended in SIGKILL.

    Python's C-level handler writes the signal number to the wakeup fd from whichever thread took the
    signal; this thread reads it."""

    def __init__(self, signals: tuple[signal.Signals, ...], on_stop: Any) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous_handlers = {s: signal.signal(s, lambda signum, frame: None) for s in signals}
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._on_stop = on_stop
        threading.Thread(target=self._watch, name="clipcheck-stop-watcher", daemon=True).start()

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data:
                return
            for signum in self._previous_handlers:
                if signum in data:
                    self._on_stop(signum)
                    return

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        os.close(self._write)  # the watcher's read sees end of file and returns


def _leave_quietly(signum: int) -> None:
    """A rank other than rank 0, interrupted: no traceback, the status of an interruption."""
    os._exit(128 + signum)


class Executor:
    """Runs a plan's cases from ``start_at`` on, in order, on this rank."""

    def __init__(self, world: DistWorld, plan: Plan, reporter: Reporter | None, progress: Progress,
                 start_at: int = 0, blame: bool | str = "auto") -> None:
        self.world = world
        self.launch = LaunchState()
        self.blame = blame
        self.plan = plan
        self.reporter = reporter
        self.progress = progress
        self.cases = [c for c in plan.cases if c.index >= start_at]
        self.results: list[CaseResult] = []
        self.pending: CaseResult | None = None  # judged, reported once its model is checked again
        self.current: CaseSpec | None = None
        self._ended = threading.Lock()
        self._reporting = threading.Lock()  # the main thread and a watcher thread both write records
        if world.rank == 0:
            world.hang_handler = self._rank0_hung

    def run(self) -> int:
        watcher = (StopWatcher((signal.SIGTERM, signal.SIGINT), self._rank0_stopped) if self.world.rank == 0
                   else StopWatcher((signal.SIGINT,), _leave_quietly))
        try:
            for case in self.cases:
                stop = self._report_pending()  # the previous case, once its model is checked again
                if stop is not None:
                    return self._stop_before(case, stop)
                self.current = case
                if self.reporter is not None:
                    with self._reporting:
                        self.reporter.in_flight(case)
                result = run_case_with_blame(self.world, self.launch, case, self.plan.scenarios[case.scenario],
                                             self.plan.targets[case.target], self.blame)
                with self._reporting:
                    self.pending = result
                self.progress.advance(f"{case.scenario} {case.target}")
            self._report_pending()
            self.current = None
            self.progress.finish()
            return self._finish()
        except WorldBroken as exc:
            return self.end_broken("hang", exc.detail)
        except DeadRankError as exc:
            return self.end_broken("crash", str(exc))
        except RuntimeError:  # torch's collective and store errors: one with a rank stuck in the harness's own
            # work timed out here, and that rank's hang, posted by its deadline, is the cause
            hung = self.world.posted_hang(within_s=self.world.hang_deadline_s + PEER_HANG_GRACE_S)
            if hung is None:
                raise
            return self.end_broken("hang", hung.detail)
        finally:
            watcher.close()

    def _stop_before(self, case: CaseSpec, reason: str) -> int:
        """This world runs nothing more (``DistWorld.stop_after_case``, on some rank): ``case`` and the
        cases after it are not run, and say why."""
        self.progress.finish()
        if self.reporter is None:
            return 0
        with self._reporting:
            for later in self.cases[self.cases.index(case):]:
                self.reporter.case(unjudged_result(
                    later, "not_run", f"not run: the world was stopped before case {case.index}: {reason}",
                    self.world.world_size))
            status = self.reporter.finish(self.results)
        print(f"clipcheck: the run stopped before case {case.index}: {reason}", file=sys.stderr, flush=True)
        return status

    def _report_pending(self) -> str | None:
        """Check the last case's model once more on every rank (``model_state.LateWatch``: a change that
        came after its own exchanges), then rank 0 reports that case: a few milliseconds after it ended,
        before the next one starts. The same exchange tells every rank whether some rank's world must
        stop (its target left a thread running: ``leftovers``); the reason, or None."""
        watch, self.launch.late_watch = self.launch.late_watch, None
        with phase_watch(self.world, "late check"):
            changes = watch.changes() if watch is not None else []
        posts = self.world.allgather_json("late", {"changes": changes, "stop": self.world.stop_reason},
                                          self.world.exchange_deadline_s)
        with self._reporting:
            result, self.pending = self.pending, None
            if self.reporter is not None and result is not None:
                self.progress.clear()
                self.reporter.case(amend_late(result, [p["changes"] for p in posts]))
                self.results.append(result)
        stops = [f"rank {r}: {p['stop']}" for r, p in enumerate(posts) if p["stop"]]
        return "; ".join(stops) if stops else None

    def _finish(self) -> int:
        if self.reporter is None:
            return 0
        return self.reporter.finish(self.results)

    def end_broken(self, check: str, detail: str) -> int:
        """Record the case in flight as unjudged and every later case as not run, then end (once)."""
        if not self._ended.acquire(blocking=False):
            return 3
        self.progress.clear()
        if self.reporter is None:
            self.world.wait_ended()
            return 3
        with self._reporting:
            self._record_the_rest(check, detail)
        self.world.signal_ended()
        print(f"clipcheck: rank {self.world.rank}: the run ended early ({check}): {detail.splitlines()[0]}",
              file=sys.stderr, flush=True)
        return 3

    def _record_the_rest(self, check: str, detail: str) -> None:
        """The case in flight as unjudged and the later ones as not run; a case already judged when the
        run broke (its model's second check pending) is reported as it was judged."""
        assert self.reporter is not None
        if self.current is not None:
            broken = self.current
            later = self.cases[self.cases.index(broken) + 1:]
            if self.pending is not None and self.pending.case.index == broken.index:
                self.reporter.case(self.pending)
                self.results.append(self.pending)
                self.pending = None
                reason = f"not run: the run ended after case {broken.index} ({check}: {detail.splitlines()[0]})"
            else:
                self.reporter.case(unjudged_result(broken, check, detail, self.world.world_size))
                reason = f"not run: the run ended at case {broken.index} ({check})"
            for case in later:
                self.reporter.case(unjudged_result(case, "not_run", reason, self.world.world_size))
        self.reporter.finish(self.results)

    def _rank0_stopped(self, signum: int) -> None:
        """SIGTERM or SIGINT on rank 0 (from the watcher thread): record what is left, then end the
        process, whatever the recording met (a store already gone); once every case is recorded the
        main thread is only finishing the report, so let it."""
        if self.current is None:
            return
        interrupted = signum == signal.SIGINT
        try:
            self.end_broken("interrupted" if interrupted else "crash",
                            INTERRUPTED_DETAIL if interrupted else STOPPED_DETAIL)
        finally:
            os._exit(EXIT_INTERRUPTED if interrupted else 3)

    def _rank0_hung(self, message: str) -> None:
        """Rank 0's own watchdog: its main thread is stuck, so this thread reports, then ends it."""
        self.end_broken("hang", f"rank 0: {message}")
        os._exit(3)
