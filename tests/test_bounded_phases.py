"""Every phase of a case is bounded, not only the function under test's call, and so is the suite's every
test: a hang planted in the harness's own work (building the model, injecting) ends its case within the
case's bound as an ERROR that names the phase, the rank and its stack; the launch goes on with the later
cases, and ranks that hang again in the same phase end it with a record that says so. A test that times
out ends every process it started."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from harness_runs import run_clipcheck
from faulty_phases import HANG_NATIVE_ENV, HANG_ONCE_ENV

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = str(ROOT / "tests" / "faulty_phases.py")
TIMEOUT_S = 5
"""The runs' --timeout: a rank counts as stuck after 2 x 5 + 10 = 20 s (``DistWorld.hang_deadline_s``)."""


def hangs(run, phase):
    return [c for c in run.cases() if "hang" in c["checks"]
            and f"hung in the harness's {phase} phase" in c["checks"]["hang"]["detail"]]


def test_a_native_hang_in_the_build_phase_is_an_error_naming_it_and_the_later_cases_run(tmp_path, monkeypatch):
    monkeypatch.setenv(HANG_ONCE_ENV, str(tmp_path / "hung-once"))
    monkeypatch.setenv(HANG_NATIVE_ENV, "1")
    start = time.monotonic()
    run = run_clipcheck(2, ["--scenario", f"{SCENARIO}:HangInBuild", "--target", "reference", "--dtype", "fp32",
                            "--norm-type", "2", "--timeout", str(TIMEOUT_S)], tmp_path, timeout=240)
    assert time.monotonic() - start < 120
    assert run.returncode == 3, run.stdout[-3000:] + run.stderr[-3000:]  # a case not judged
    [hung] = hangs(run, "build")
    detail = hung["checks"]["hang"]["detail"]
    assert hung["index"] == 0 and hung["verdict"] == "ERROR"
    assert detail.startswith("rank 1: hung in the harness's build phase: no progress after 20 s")
    assert "in run_case" in detail and "_hang_on_rank_one" in detail  # the stack from the phase down
    later = [c for c in run.cases() if c["index"] != 0]
    assert later and all(c["verdict"] == "PASS" for c in later), [c["verdict"] for c in later]


def test_ranks_that_hang_again_in_the_same_phase_end_the_launch_saying_so(tmp_path):
    start = time.monotonic()
    run = run_clipcheck(2, ["--scenario", f"{SCENARIO}:HangInInject", "--target", "reference", "--dtype", "fp32",
                            "--norm-type", "2", "--timeout", str(TIMEOUT_S)], tmp_path, timeout=240)
    assert time.monotonic() - start < 150  # two hangs, not one per relaunch allowed
    assert run.returncode == 3, run.stdout[-3000:] + run.stderr[-3000:]
    assert [c["index"] for c in hangs(run, "inject")] == [0, 1]
    rest = [c for c in run.cases() if c["index"] > 1]
    assert rest and all(set(c["checks"]) == {"not_run"} for c in rest)
    assert all("hung in the harness's inject phase again (case 0, then case 1)" in c["checks"]["not_run"]["detail"]
               for c in rest)
    assert run.summary["unjudged"] == len(run.cases())


def test_ranks_that_die_again_in_the_same_phase_end_the_launch_saying_so(tmp_path):
    run = run_clipcheck(2, ["--scenario", f"{SCENARIO}:DieInBuild", "--target", "reference", "--dtype", "fp32",
                            "--norm-type", "2", "--timeout", str(TIMEOUT_S)], tmp_path, timeout=240)
    assert run.returncode == 3, run.stdout[-3000:] + run.stderr[-3000:]
    crashed = [c for c in run.cases() if "crash" in c["checks"]]
    assert [c["index"] for c in crashed] == [0, 1]
    assert all("rank 1 was killed by SIGKILL in the harness's build phase" in c["checks"]["crash"]["detail"]
               for c in crashed), [c["checks"]["crash"]["detail"] for c in crashed]
    rest = [c for c in run.cases() if c["index"] > 1]
    assert rest and all("died in the harness's build phase again (case 0, then case 1)"
                        in c["checks"]["not_run"]["detail"] for c in rest)


def test_a_framework_backward_that_never_returns_is_a_hang_saying_so_and_the_next_case_runs(tmp_path):
    run = run_clipcheck(2, ["--scenario", f"{ROOT / 'tests' / 'fake_framework.py'}:FakeFramework",
                            "--targets", "fake-stuck-backward,reference", "--variant", "stock", "--dtype", "fp32",
                            "--norm-type", "2", "--clip-ratio", "0.5", "--timeout", str(TIMEOUT_S)], tmp_path,
                        timeout=240)
    assert run.returncode == 3, run.stdout[-3000:] + run.stderr[-3000:]
    stuck = run.one(target="fake-stuck-backward")
    assert stuck["verdict"] == "ERROR"
    assert "rank 1: hung: no answer from the framework's backward after 20 s" in stuck["checks"]["hang"]["detail"]
    assert "deliver_stuck_on_rank_one" in stuck["checks"]["hang"]["detail"]
    assert run.one(target="reference")["verdict"] == "PASS"


INNER = '''
import subprocess


def test_hangs_with_grandchildren(tmp_path):
    subprocess.run(["bash", "-c", "sleep 1000 & echo $! >> {pids}; sleep 1000 & echo $! >> {pids}; wait"])
'''


def test_a_test_that_times_out_ends_every_process_it_started(tmp_path):
    """The suite's own bound (pytest-timeout, from pyproject.toml) and ``process_guard``: the shell the inner
    test started is killed at the timeout, its two sleepers (orphans by then) are ended by the guard."""
    pids = tmp_path / "pids"
    (tmp_path / "test_inner.py").write_text(INNER.format(pids=pids))
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'tests'}{os.pathsep}{ROOT}")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "process_guard", "-p", "no:cacheprovider", "-q",
                           "-o", "timeout=3", "test_inner.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "Timeout (>3.0s) from pytest-timeout" in proc.stdout, proc.stdout[-3000:]
    sleepers = [int(p) for p in pids.read_text().split()]
    assert len(sleepers) == 2
    alive = [p for p in sleepers if Path(f"/proc/{p}").exists()
             and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert alive == [], f"left running: {alive}\n{proc.stdout[-3000:]}"
