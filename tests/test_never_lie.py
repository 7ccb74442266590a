"""A run never exits as a pass, nor leaves a file that reads as one, when it did not judge: two runs on
one output, nothing judged, an interrupted run, a full disk, rank 0 dying under plain torchrun, through
each launcher they apply to.

Fault targets: tests/fault_targets.py. Each test's docstring names the false pass or lost result it holds."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

import harness
from harness.judge.verdicts import EXIT_BROKEN, EXIT_NOTHING_JUDGED, EXIT_OUTPUT, count
from harness_runs import alive, descendants, jsonl, listening_addresses, run_cli, run_harness, start_harness, \
    torchrun_harness, wait_until

pytestmark = pytest.mark.distributed

FAULTS = "tests/fault_targets.py"
BROKEN = "tests/broken_targets.py"
ONE_CASE = ["--scenario", "dense_dp", "--dtype", "fp32", "--norm-type", "2", "--clip-ratio", "0.5", "--variant",
            "replicated"]
ABSENT = ["--scenario", f"{FAULTS}:AbsentFramework", "--dtype", "fp32"]
LOOPBACK = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it


def _stop(proc, signum: int, timeout: float = 150) -> tuple[str, str]:
    family = descendants(proc.pid)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=timeout)
    wait_until(lambda: not alive(family), 30, f"no process left behind (left: {alive(family)})")
    return out, err


# -- two runs on one output: the second is refused -------------------------------------------------------
def test_a_second_run_on_the_same_results_file_is_refused_and_the_first_keeps_its_own(tmp_path):
    """Two `clipcheck run` on one --json file, the first then stopped by SIGTERM: the second is one line,
    exit 2, before any rank; the first's file holds its own records only, the case SIGTERM cut short, and a
    summary. While it runs, every socket the launcher and its ranks listen on is bound to 127.0.0.1 (the
    elastic agent's stores, left to themselves, listen on every interface, IPv4 and IPv6)."""
    shared = tmp_path / "same.jsonl"
    first = start_harness(["run", "--nproc", "2", *ONE_CASE, "--target", f"reference,{FAULTS}:slow_reference",
                           "--json", str(shared), "--timeout", "600"], CLIPCHECK_TEST_SLEEP="600")
    try:
        wait_until(lambda: any(r.get("target") == "reference" for r in jsonl(shared)), 240, "the first case's record")
        listening = listening_addresses({first.pid} | descendants(first.pid))
        assert listening and set(listening) == {LOOPBACK}, listening
        second = run_cli(["run", "--nproc", "2", *ONE_CASE, "--target", f"{FAULTS}:half_norm", "--json", str(shared)],
                         timeout=240)
        assert second.returncode == 2, second.stdout + second.stderr
        assert second.stderr.count("\n") == 1 and "another clipcheck run is writing it" in second.stderr
        assert "clipcheck:" not in second.stdout  # no rank started
    finally:
        out, err = _stop(first, signal.SIGTERM)
    assert first.returncode == 128 + signal.SIGTERM, out + err
    records = jsonl(shared)
    assert {r["target"] for r in records if r["type"] == "case"} == {"reference", f"{FAULTS}:slow_reference"}
    verdicts = {r["target"]: r["verdict"] for r in records if r["type"] == "case"}
    assert verdicts == {"reference": "PASS", f"{FAULTS}:slow_reference": "ERROR"}
    assert records[-1]["type"] == "summary" and records[-1]["status"] == EXIT_BROKEN
    assert "Traceback" not in err


def test_a_second_matrix_on_the_same_out_folder_is_refused(tmp_path):
    """Two `clipcheck matrix` on one --out (each would read the other's per-launch records, and the one
    testing a half-norm clip print PASS): the second is refused; the first is interrupted (130)."""
    out = tmp_path / "results"
    matrix = ["matrix", "--nproc-list", "2", *ONE_CASE, "--out", str(out), "--timeout", "600"]
    first = start_harness([*matrix, "--target", f"{FAULTS}:half_norm,{FAULTS}:slow_reference"],
                          CLIPCHECK_TEST_SLEEP="600")
    try:
        wait_until(lambda: any(r.get("target") == f"{FAULTS}:half_norm" for r in jsonl(out / "world2-gloo.jsonl")),
                   240, "the first matrix's first record")
        listening = listening_addresses({first.pid} | descendants(first.pid))  # loopback only, via the matrix too
        assert listening and set(listening) == {LOOPBACK}, listening
        second = run_cli([*matrix, "--target", "reference"], timeout=240)
        assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stdout + second.stderr
        assert "another clipcheck run is writing it" in second.stderr and "launch:" not in second.stdout
    finally:
        output, err = _stop(first, signal.SIGINT)
    assert first.returncode == 128 + signal.SIGINT, output + err
    merged = jsonl(out / "results.jsonl")
    assert {r["target"] for r in merged if r["type"] == "case"} == {f"{FAULTS}:half_norm", f"{FAULTS}:slow_reference"}
    assert "=> PASS" not in output


# -- nothing judged is its own status, never a pass -------------------------------------------------------
def test_nothing_judged_is_its_own_status_through_every_launcher(tmp_path):
    """--start-at past the plan with a target that raises everywhere, and a selection of SKIPs only, exit
    EXIT_NOTHING_JUDGED (4), not 0 ("0 cases => PASS"), and harness.check has not passed."""
    start_past = run_cli(["--start-at", "99", *ONE_CASE, "--target", f"{BROKEN}:raise_everywhere"], timeout=240)
    assert start_past.returncode == EXIT_NOTHING_JUDGED and "=> NOTHING JUDGED" in start_past.stdout
    torchrun = run_harness(2, ["--start-at", "99", *ONE_CASE, "--target", f"{BROKEN}:raise_everywhere"], tmp_path)
    assert torchrun.summary["status"] == EXIT_NOTHING_JUDGED and not torchrun.summary["ok"] and torchrun.returncode
    skips = run_cli(["run", "--nproc", "2", *ABSENT], timeout=240)
    assert skips.returncode == EXIT_NOTHING_JUDGED, skips.stdout + skips.stderr
    matrix = run_cli(["matrix", "--nproc-list", "1", *ABSENT, "--out", str(tmp_path / "m")], timeout=240)
    assert matrix.returncode == EXIT_NOTHING_JUDGED and "NOTHING JUDGED" in matrix.stdout, matrix.stdout
    report = harness.check("absent-clip", scenarios=["fault_targets:AbsentFramework"], worlds=[1], dtypes=["fp32"])
    assert report.cases and all(c["verdict"] == "SKIP" for c in report.cases)
    assert not report.passed and report.status == EXIT_NOTHING_JUDGED


# -- an interrupted run records the case in flight and a summary -----------------------------------------
@pytest.mark.parametrize("launcher", ["clipcheck-run", "torchrun"])
def test_an_interrupted_run_records_the_case_in_flight_and_a_summary(tmp_path, launcher):
    """After SIGINT the case in flight is an ERROR (interrupted) and the summary says not judged, never a
    JSONL of N passes without either; `clipcheck run` exits 130, no SignalException traceback. Plain torchrun's own exit
    status is torchrun's (non-zero), but its ranks write the same file."""
    results = tmp_path / "results.jsonl"
    args = [*ONE_CASE, "--target", f"reference,{FAULTS}:sleep_forever_on_rank1", "--timeout", "600",
            "--json", str(results)]
    if launcher == "torchrun":
        proc = start_harness(args, torchrun_harness(2))
    else:
        proc = start_harness(["run", "--nproc", "2", *args])
    wait_until(lambda: any(r.get("type") == "case" and r.get("target") == "reference" for r in jsonl(results)), 240,
               "the first case's record")  # its record, not its in_flight marker (which names the target too)
    out, err = _stop(proc, signal.SIGINT)
    records = jsonl(results)
    cut = [r for r in records if r["type"] == "case" and r["target"] == f"{FAULTS}:sleep_forever_on_rank1"]
    assert len(cut) == 1 and cut[0]["verdict"] == "ERROR" and "interrupted" in cut[0]["checks"], records
    assert records[-1]["type"] == "summary" and records[-1]["status"] == EXIT_BROKEN and not records[-1]["ok"]
    if launcher == "clipcheck-run":
        assert proc.returncode == 128 + signal.SIGINT and "Traceback" not in err, err
    else:
        assert proc.returncode != 0


def test_an_interrupted_runs_two_summary_lines_agree_on_the_metamorphic_groups(tmp_path):
    """After SIGINT, rank 0's summary and the launcher's line over every planned case say the same counts,
    metamorphic groups included (the launcher once recounted the case records alone: "metamorphic
    groups: 0" under rank 0's 2), and so does the file's summary. Every dense_dp layout: the reference
    of three layouts is judged before the stop, so there are groups to count."""
    results = tmp_path / "results.jsonl"
    proc = start_harness(["run", "--nproc", "2", "--scenario", "dense_dp", "--dtype", "fp32", "--norm-type", "2",
                          "--clip-ratio", "0.5", "--target", f"reference,{FAULTS}:slow_reference", "--timeout", "600",
                          "--json", str(results)], CLIPCHECK_TEST_SLEEP="2")
    wait_until(lambda: sum(r.get("type") == "case" and r.get("target") == "reference" for r in jsonl(results)) >= 3,
               240, "three layouts' reference cases")
    out, err = _stop(proc, signal.SIGINT)
    assert proc.returncode == 128 + signal.SIGINT, out + err
    printed = (out + err).splitlines()
    rank0 = [line.removeprefix("summary: ") for line in printed if line.startswith("summary: ")]
    launcher = [line.split("results written for every planned case: ", 1)[1] for line in printed
                if line.startswith("clipcheck run: interrupted by SIGINT")]
    assert len(rank0) == 1 and rank0 == launcher, out + err
    summary = jsonl(results)[-1]
    assert summary["type"] == "summary" and summary["metamorphic_groups"] >= 1, summary
    assert f"metamorphic groups: {summary['metamorphic_groups']}, {summary['metamorphic_failed']} failed" in rank0[0]


# -- a full disk is one line and its own status ----------------------------------------------------------
def test_a_full_disk_is_one_line_and_its_own_status(tmp_path):
    """--json / --junit on a full disk (here /dev/full, through links): every verdict is printed, each
    unwritable file is one line, and the status is EXIT_OUTPUT (5); no OSError traceback, and the passing
    case is not called a crash and relaunched."""
    full_json, full_junit = tmp_path / "results.jsonl", tmp_path / "junit.xml"
    full_json.symlink_to("/dev/full")
    full_junit.symlink_to("/dev/full")
    files = ["--json", str(full_json), "--junit", str(full_junit)]
    launched = run_cli(["run", "--nproc", "2", *ONE_CASE, "--target", "reference", *files], timeout=300)
    alone = run_cli([*ONE_CASE, "--target", "reference", *files], timeout=300)
    for proc in (launched, alone):
        assert proc.returncode == EXIT_OUTPUT, proc.stdout + proc.stderr
        assert "PASS" in proc.stdout and "relaunching" not in proc.stderr and "Traceback" not in proc.stderr
        problems = proc.stderr.strip().splitlines()
        assert len(problems) == 2 and all("No space left on device" in p for p in problems), proc.stderr
    assert Path("/dev/full").is_char_device()  # the link, never the device, was the launcher's to touch


# -- rank 0 dying under plain torchrun leaves a case not judged, never a clean file -----------------------
def test_rank_0_dying_under_plain_torchrun_leaves_a_case_not_judged(tmp_path):
    """Rank 0 killed mid-case (a gloo abort; here os._exit) under plain torchrun writes neither that case's
    record nor a summary, so the JSONL would read as a clean run: rank 0 writes an in-flight marker before
    each case, and a marker no record follows counts as a case not judged."""
    run = run_harness(2, [*ONE_CASE, "--target", f"reference,{FAULTS}:exit_on_rank0", "--timeout", "20"], tmp_path)
    assert run.returncode != 0
    assert [r["type"] for r in run.records][-1] == "in_flight"
    counted = count(run.records)
    assert counted.passed == 1 and counted.unjudged == 1 and counted.status == EXIT_BROKEN


def test_the_in_flight_marker_is_counted_only_when_no_record_follows():
    marker = {"type": "in_flight", "index": 0, "scenario": "s", "layout": "l", "target": "t", "world_size": 2}
    judged = dict(marker, type="case", verdict="PASS", checks={})
    assert count([marker, judged]).status == 0 and count([marker, judged]).cases == 1
    assert count([judged, dict(marker, index=1)]).unjudged == 1
    assert count([]).status == EXIT_NOTHING_JUDGED

