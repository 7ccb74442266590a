"""What a clip starts, leaves or breaks around it is its own fault, in bounded time, and no process
outlives the command that started it: a clip's child processes, a launcher killed outright, a thread a
clip leaves running, and a rank that raised while the others waited on it.

Fault targets: tests/fault_targets.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import harness
from fault_targets import SLEEPER_SECONDS
from harness.judge.verdicts import EXIT_BROKEN
from harness_runs import ROOT, alive, descendants, failed, harness_env, run_clipcheck, run_harness, start_harness, \
    torchrun_harness, wait_until

pytestmark = pytest.mark.distributed

FAULTS = "tests/fault_targets.py"
ONE_CASE = ["--scenario", "dense_dp", "--dtype", "fp32", "--norm-type", "2", "--clip-ratio", "0.5", "--variant",
            "replicated"]
CHILDREN = ["forks_a_sleeper", "spawns_a_sleeper", "forked_child_runs_collectives"]


class FamilyWatch:
    """Every process seen under ``pid`` while it runs (polled), to check none outlives it."""

    def __init__(self, pid: int) -> None:
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(pid,), daemon=True)
        self._thread.start()

    def _watch(self, pid: int) -> None:
        while not self._stop.wait(0.3):
            self.seen |= descendants(pid)

    def survivors(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        deadline = time.monotonic() + 20
        while alive(self.seen) and time.monotonic() < deadline:
            time.sleep(0.5)
        return alive(self.seen)


# -- a clip's own child processes fail its case and are killed, in bounded time ---------------------------
@pytest.mark.parametrize("launcher", ["clipcheck-run", "torchrun"])
def test_a_clips_child_processes_fail_its_case_and_are_gone_in_bounded_time(tmp_path, launcher):
    """A clip that leaves child processes behind fails its own case (contract, naming what it left), what
    it left is killed, the next case passes, and the command ends in bounded time with nothing left behind.
    A child forked from a rank inherits the pipe whose closing tells the agent the rank ended, so a launcher
    that waited for every descendant would be held far past `--timeout` by a sleeper, and deadlocked for good
    by a child running collectives."""
    targets = ",".join([*(f"{FAULTS}:{name}" for name in CHILDREN), "reference"])
    args = [*ONE_CASE, "--target", targets, "--timeout", "10"]
    start = time.monotonic()
    run = (run_clipcheck if launcher == "clipcheck-run" else run_harness)(2, args, tmp_path, timeout=400)
    seconds = time.monotonic() - start
    for name in CHILDREN:
        case = run.one(target=f"{FAULTS}:{name}")
        assert case["verdict"] == "FAIL" and "contract" in failed(case), (name, case["checks"])
        detail = case["checks"]["contract"]["detail"]
        assert "process(es)" in detail and "killed" in detail, detail
    assert run.one(target="reference")["verdict"] == "PASS"
    assert seconds < 300, seconds
    assert not [line for line in _sleepers()], _sleepers()


def _sleepers() -> list[str]:
    """The sleepers spawns_a_sleeper starts, anywhere on this machine: found by their argument, which no other
    process passes (a shell waiting in a plain `sleep 400` is not one of them)."""
    from pathlib import Path

    wanted = b"sleep\x00" + SLEEPER_SECONDS.encode() + b"\x00"
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes() == wanted:
                found.append(entry.name)
        except OSError:
            continue
    return found


# -- every process a launcher starts dies with it ---------------------------------------------------------------
LAUNCHERS = {  # command line, processes under the killed one once the case runs
    "run --spawn-ranks": (["run", "--nproc", "2", "--spawn-ranks"], 2),
    "run": (["run", "--nproc", "2"], 2),
    "matrix --spawn-ranks": (["matrix", "--nproc-list", "2", "--spawn-ranks"], 3),
    "matrix": (["matrix", "--nproc-list", "2"], 3),
    "torchrun": ([], 2),
}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_no_process_outlives_a_launcher_killed_outright(tmp_path, launcher):
    """Whatever a launcher starts (its `clipcheck run` child, the ranks, spawned or forked) dies with it
    when it is SIGKILLed while a case runs, through every launcher. Spawned ranks start in a session of
    their own, so nothing else ends them: a `clipcheck matrix --spawn-ranks` killed outright would leave
    its launcher and both ranks alive. Each process dies with its parent twice over: the kernel's
    parent-death signal and a thread watching the parent (`run.guards.family.watch_parent`)."""
    head, expected = LAUNCHERS[launcher]
    if head and head[0] == "matrix":
        head = [*head, "--out", str(tmp_path / "m")]
    args = [*ONE_CASE, "--target", f"{FAULTS}:sleep_forever_on_rank1", "--timeout", "600"]
    marker = str(tmp_path / "in-the-case-")
    proc = start_harness([*head, *args], launcher=torchrun_harness(2) if launcher == "torchrun" else None,
                         CLIPCHECK_TEST_MARKER=marker)
    try:  # killed once both ranks are in the case (a rank still starting cannot yet know whom to die with)
        wait_until(lambda: all(os.path.exists(f"{marker}{r}") for r in (0, 1)), 240, "both ranks in the case")
        family = descendants(proc.pid)
        assert len(family) >= expected, family
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    wait_until(lambda: not alive(family), 15, f"no process left behind (left: {alive(family)})")


def test_a_process_whose_parent_died_ends_itself_and_its_children(tmp_path):
    """The watch alone (as where the kernel's parent-death signal is refused): a process watching a parent
    that dies ends its own child and itself within seconds."""
    script = tmp_path / "watched.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "from harness.run.guards.family import adopt_orphans, watch_parent\n"
        "pid = os.fork()\n"
        "if pid:\n"
        "    time.sleep(3600)\n"  # the parent: killed by the test
        "parent = os.getppid()\n"
        "adopt_orphans()\n"
        "child = subprocess.Popen(['sleep', '3600'])\n"
        "watch_parent(parent)\n"
        "print(os.getpid(), child.pid, flush=True)\n"
        "time.sleep(3600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=harness_env(), stdout=subprocess.PIPE,
                            text=True)
    try:
        watcher, child = (int(x) for x in proc.stdout.readline().split())
    finally:
        proc.kill()
        proc.wait(timeout=30)
    wait_until(lambda: not alive({watcher, child}), 15, f"the watcher and its child gone (left: "
                                                        f"{alive({watcher, child})})")


# -- a thread a clip leaves running fails that clip, never the next one ----------------------------------
TWO_BOUNDS = ["--scenario", "dense_dp", "--dtype", "fp32", "--norm-type", "2", "--clip-ratio", "0.5,2",
              "--variant", "replicated"]


@pytest.mark.parametrize("launcher", ["clipcheck-run", "torchrun"])
def test_a_leaked_collective_thread_fails_its_own_target_never_the_next(tmp_path, launcher):
    """A thread a target leaves all-reducing on the default group is that target's fault (contract), never
    a failure of the next, correct target, and its world is stopped after that case: `clipcheck run`
    resumes in fresh processes (the reference passes), plain torchrun, which cannot, records the rest as
    not run (exit 3) rather than judge them in that world."""
    args = [*TWO_BOUNDS, "--target", f"{FAULTS}:leaks_a_collective_thread,reference", "--timeout", "10"]
    run = (run_clipcheck if launcher == "clipcheck-run" else run_harness)(2, args, tmp_path, timeout=400)
    leaks = run.cases(target=f"{FAULTS}:leaks_a_collective_thread")
    assert leaks and all("contract" in failed(c) for c in leaks[:1]), [c["checks"] for c in leaks]
    assert "thread(s) running after it returned (leaked-allreduce" in leaks[0]["checks"]["contract"]["detail"]
    references = run.cases(target="reference")
    assert len(references) == 2
    if launcher == "clipcheck-run":
        assert all(c["verdict"] in ("PASS", "FAIL") for c in leaks)
        assert [c["verdict"] for c in references] == ["PASS", "PASS"], [c["checks"] for c in references]
        assert "relaunching" in run.stderr
    else:
        assert all(c["verdict"] != "PASS" for c in references)  # never judged in the contaminated world
        assert run.summary["status"] == EXIT_BROKEN


def test_a_leaked_thread_restarts_a_warm_world():
    """A leaked thread through harness.check (a RankPool): the pool is restarted before the next case."""
    report = harness.check("tests/fault_targets.py:leaks_a_collective_thread", scenarios=["dense_dp"], worlds=[2],
                           dtypes=["fp32"], norm_types=[2], clip_ratios=[0.5, 2.0], variant="replicated",
                           timeout_s=10)
    assert [c["verdict"] for c in report.cases] == ["FAIL", "FAIL"], report.describe()
    assert all("thread(s)" in c["checks"]["contract"]["detail"] for c in report.cases)


# -- a rank that raised and a rank left waiting on it are both named -------------------------------------
def test_a_rank_that_raised_and_a_rank_left_waiting_are_both_named(tmp_path):
    """A rank raises while the others hang in a collective (as DeepSpeed 0.19.8's inf branch does on a rank
    holding no gradient): the case names both sides, who raised (and what), and who was left waiting, with
    its stack."""
    run = run_clipcheck(2, [*ONE_CASE, "--target", f"{FAULTS}:raise_on_rank1_while_rank0_waits,reference",
                            "--timeout", "3"], tmp_path, timeout=400)
    case = run.one(target=f"{FAULTS}:raise_on_rank1_while_rank0_waits")
    assert case["verdict"] == "ERROR" and "hang" in case["checks"], case["checks"]
    detail = case["checks"]["hang"]["detail"]
    assert "rank 0: hung" in detail and "new_group" in detail, detail
    assert "rank 1 raised IndexError: no gradient on this rank" in detail, detail
    assert run.one(target="reference")["verdict"] == "PASS"


def test_a_warm_world_names_both_sides_too():
    """The same through harness.check: the pool's record names the hung rank and the one that raised."""
    report = harness.check("tests/fault_targets.py:raise_on_rank1_while_rank0_waits", scenarios=["dense_dp"],
                           worlds=[2], dtypes=["fp32"], norm_types=[2], clip_ratios=[0.5], variant="replicated",
                           timeout_s=3)
    (case,) = report.cases
    detail = case["checks"]["hang"]["detail"]
    assert "rank 0 hung" in detail and "IndexError" in detail, detail


def test_interrupting_leaves_no_process_even_mid_hang(tmp_path):
    """SIGTERM to a launch whose rank hangs ends every process it started."""
    proc = start_harness(["run", "--nproc", "2", *ONE_CASE, "--target", f"{FAULTS}:sleep_forever_on_rank1",
                          "--timeout", "600"])
    watch = FamilyWatch(proc.pid)
    wait_until(lambda: len(watch.seen) >= 2, 240, "the ranks")
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=150)
    assert proc.returncode == 128 + signal.SIGTERM
    assert not watch.survivors()


def test_interrupting_fuzz_is_quiet_and_leaves_no_rank(tmp_path):
    """SIGINT ends `clipcheck fuzz` with 130, one line, no traceback (neither its own nor a rank's), and its
    warm world goes with it."""
    proc = start_harness(["fuzz", "--target", f"{FAULTS}:slow_reference", "--world", "2", "--examples", "5"],
                         CLIPCHECK_TEST_SLEEP="600")
    watch = FamilyWatch(proc.pid)
    wait_until(lambda: len(watch.seen) >= 3, 240, "the warm world")  # its fork server and two ranks
    time.sleep(5)  # into the first example
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT and "Traceback" not in err, out + err
    assert not watch.survivors()
