"""One launch's case loop on one rank: run every planned case, rank 0 reports, and a run that breaks
still ends with a record for every planned case and an honest exit status.

How a run can break, and what each rank does:

* a rank hangs in the function under test: its watchdog posts the hang through the store; the other
  ranks raise ``WorldBroken`` at the next exchange. Rank 0 (or rank 0's watchdog, if rank 0 is the
  one that hung) writes the hung case as an ERROR (``hang``, naming the rank and its stack), every
  later case as ERROR (``not_run``), the summary, then sets ``ENDED_KEY``; every rank exits 3;
* a rank stops answering in the store (it died in C code, or hung holding the GIL):
  ``DeadRankError``, handled the same way (``crash``);
* the launcher stops the ranks (SIGTERM: torchrun does that when one rank dies): rank 0 records the
  case in flight as a ``crash`` and the rest as ``not_run`` before it exits.

Exit status: 0 every case passed, 1 some case or metamorphic group failed (or a harness error),
3 some planned case was not judged (hang, crash, not run).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from harness.cases.variant import CaseSpec
from harness.judge.checks import CaseResult, amend_late, unjudged_result
from harness.cases.plan import Plan
from harness.report.progress import Progress
from harness.report.reporter import Reporter
from harness.run.blame import run_case_with_blame
from harness.run.world import DeadRankError, DistWorld, WorldBroken


STOPPED_DETAIL = ("stopped by SIGTERM while this case ran: under torchrun, another rank died (see the launcher's "
                  "output for its exit code) or the run was interrupted")


class SigtermWatcher:
    """Calls ``on_stop`` from its own thread as soon as SIGTERM arrives, even while the main thread is
    blocked in C++ (a gloo collective waiting for a dead peer), where a Python signal handler would
    only run after torchrun's grace period has already ended in SIGKILL.

    Python's C-level handler writes the signal number to the wakeup fd from whichever thread took the
    signal; this thread reads it."""

    def __init__(self, on_stop: Any) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous_handler = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._on_stop = on_stop
        threading.Thread(target=self._watch, name="clipcheck-sigterm", daemon=True).start()

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                self._on_stop()
                return

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        signal.signal(signal.SIGTERM, self._previous_handler)
        os.close(self._write)  # the watcher's read sees end of file and returns


class Executor:
    """Runs a plan's cases from ``start_at`` on, in order, on this rank."""

    def __init__(self, world: DistWorld, plan: Plan, reporter: Reporter | None, progress: Progress,
                 start_at: int = 0, blame: bool | str = "auto") -> None:
        self.world = world
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
        watcher = SigtermWatcher(self._rank0_stopped) if self.world.rank == 0 else None
        try:
            for case in self.cases:
                self._report_pending()  # the previous case, once its model is checked again
                self.current = case
                result = run_case_with_blame(self.world, case, self.plan.scenarios[case.scenario],
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
        finally:
            if watcher is not None:
                watcher.close()

    def _report_pending(self) -> None:
        """Check the last case's model once more on every rank (``aftermath.LateWatch``: a change that
        came after its own exchanges), then rank 0 reports that case: a few milliseconds after it ended,
        before the next one starts."""
        watch, self.world.late_watch = self.world.late_watch, None
        changes = self.world.allgather_json("late", watch.changes() if watch is not None else [],
                                            self.world.exchange_deadline_s)
        with self._reporting:
            result, self.pending = self.pending, None
            if self.reporter is not None and result is not None:
                self.progress.clear()
                self.reporter.case(amend_late(result, changes))
                self.results.append(result)

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

    def _rank0_stopped(self) -> None:
        """SIGTERM on rank 0 (from the watcher thread): record what is left, then end the process; once
        every case is recorded the main thread is only finishing the report, so let it."""
        if self.current is None:
            return
        self.end_broken("crash", STOPPED_DETAIL)
        os._exit(3)

    def _rank0_hung(self, message: str) -> None:
        """Rank 0's own watchdog: its main thread is stuck, so this thread reports, then ends it."""
        self.end_broken("hang", f"rank 0: {message}")
        os._exit(3)
