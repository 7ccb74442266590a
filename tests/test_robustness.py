"""A run never reports PASS when something broke: faults in the function under test fail their own
case (naming the rank and the cause), in bounded time, later cases still run, and the exit status
says what happened through `clipcheck run`, torchrun, `matrix` and `fuzz`.

The fault targets live in tests/broken_targets.py; each one's docstring starts with the check it must
fail ("params: ...", "contract: ...", "hang: ..."), which is what these tests read.
"""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import broken_targets
from harness_runs import ROOT, descendants, harness_process, run_clipcheck, run_harness

pytestmark = pytest.mark.distributed

BROKEN = "tests/broken_targets.py"
ONE_CASE = ["--scenario", "dense_dp", "--dtype", "fp32", "--norm-type", "2", "--clip-ratio", "0.5"]


def expected_check(name: str) -> str:
    return inspect.getdoc(getattr(broken_targets, name)).split(":", 1)[0]


def failed_checks(case: dict) -> set[str]:
    return {name for name, check in case["checks"].items() if not check["passed"]}


FSDP_LAYOUTS = 5
JUDGED_FAULTS = ["overwrite_params", "returns_none", "delete_grads", "destroy_default_group", "reshape_grad",
                 "raise_everywhere"]


@pytest.fixture(scope="module")
def faults_world2(tmp_path_factory):
    """Each judged fault, then the reference, on the five FSDP layouts (finite, DTensor, NaN on rank 0, NaN
    on the last rank, inf): the reference after each fault must pass (a fault is blamed on its own
    case, and the harness restores what it broke)."""
    targets = []
    for name in JUDGED_FAULTS:
        targets += [f"{BROKEN}:{name}", "reference"]
    return run_clipcheck(2, [*ONE_CASE, "--variant", "fsdp", "--target", ",".join(targets),
                             "--timeout", "10"], tmp_path_factory.mktemp("faults"))


@pytest.mark.parametrize("name", JUDGED_FAULTS)
def test_a_fault_fails_its_own_check_on_finite_and_nan_cases(faults_world2, name):
    cases = faults_world2.cases(target=f"{BROKEN}:{name}")
    assert len(cases) == FSDP_LAYOUTS and any("nan" in c["layout"] for c in cases)
    for case in cases:
        if name == "reshape_grad" and "dtensor" in case["layout"]:
            # to_local() is a view: resizing it leaves the DTensor gradient whole, so nothing is wrong
            assert case["verdict"] == "PASS", case["checks"]
            continue
        assert case["verdict"] == "FAIL", (case["layout"], case["checks"])
        assert expected_check(name) in failed_checks(case), (case["layout"], failed_checks(case))


def test_a_wrong_return_type_is_reported_at_the_users_function(faults_world2):
    for case in faults_world2.cases(target=f"{BROKEN}:returns_none"):
        detail = case["checks"]["contract"]["detail"]
        line = inspect.getsourcelines(broken_targets.returns_none)[1]
        assert f"returned by returns_none at {broken_targets.__file__}:{line}" in detail, detail
        assert "harness/" not in detail, detail


def test_the_reference_after_every_fault_passes(faults_world2):
    run = faults_world2
    assert [c["verdict"] for c in run.cases(target="reference")] == ["PASS"] * FSDP_LAYOUTS * len(JUDGED_FAULTS)
    assert run.summary["cases"] == 2 * FSDP_LAYOUTS * len(JUDGED_FAULTS) and run.summary["unjudged"] == 0
    assert run.returncode == 1 and "Traceback" not in run.stdout


def test_destroying_the_default_group_is_blamed_on_the_target_that_did_it(faults_world2):
    case = faults_world2.cases(target=f"{BROKEN}:destroy_default_group")[0]
    assert "default process group" in case["checks"]["contract"]["detail"]


BEYOND_VALUES = {  # fault -> (the layouts where it shows, the check it must fail)
    "zero_fills_missing_grads": ("deepspeed_autoep", "expert-no-grad"),
    "restores_from_a_thread": ("dense_dp", "fsdp dtensor"),  # finite: with a NaN, "leave" is a valid policy
    "freezes_params": ("dense_dp", "fsdp"),
    "swaps_dtensor_grad_data": ("dense_dp", "fsdp dtensor"),
}


@pytest.mark.parametrize("name", sorted(BEYOND_VALUES))
def test_a_fault_beyond_the_gradients_values_fails_its_check_and_the_next_case_passes(tmp_path, name):
    scenario, variant = BEYOND_VALUES[name]
    run = run_clipcheck(2, ["--scenario", scenario, "--variant", variant, "--dtype", "fp32", "--norm-type", "2",
                            "--clip-ratio", "0.5", "--target", f"{BROKEN}:{name},reference"], tmp_path, timeout=240)
    faulty = run.cases(target=f"{BROKEN}:{name}")
    assert faulty and all(c["verdict"] == "FAIL" and expected_check(name) in failed_checks(c) for c in faulty), \
        [(c["layout"], c["checks"]) for c in faulty]
    assert all(c["verdict"] == "PASS" for c in run.cases(target="reference")), run.stdout
    if name == "restores_from_a_thread":
        assert "changed after the clip returned" in faulty[0]["checks"]["late"]["detail"]
    if name == "swaps_dtensor_grad_data":
        assert "DTensor wrapper says (19,) float64" in faulty[0]["checks"]["contract"]["detail"]


def first_frame(detail: str) -> str:
    """The first ``File ...`` line of a hang's stack, as the report prints it."""
    return next(line.strip() for line in detail.splitlines() if line.strip().startswith("File "))


def clip_frame(fn, code: str) -> str:
    """The ``File ...`` line a traceback prints for ``fn`` at the line holding ``code``."""
    lines, start = inspect.getsourcelines(fn)
    line = start + next(i for i, text in enumerate(lines) if code in text)
    return f'File "{inspect.getsourcefile(fn)}", line {line}, in {fn.__name__}'


@pytest.mark.parametrize("name, check, rank", [
    ("hang_on_rank1", "hang", 1),
    ("new_group_on_rank1", "hang", 1),
    ("exit_on_rank1", "crash", 1),
    ("stray_collective_of_another_size", "crash", None),
])
def test_a_hung_or_dead_rank_is_an_error_naming_it_and_the_next_case_runs(tmp_path, name, check, rank):
    start = time.monotonic()
    run = run_clipcheck(2, [*ONE_CASE, "--variant", "replicated", "--target", f"{BROKEN}:{name},reference",
                            "--timeout", "3"], tmp_path, timeout=240)
    seconds = time.monotonic() - start
    broken, after = run.cases()
    assert broken["verdict"] == "ERROR" and failed_checks(broken) == {check}, broken["checks"]
    detail = broken["checks"][check]["detail"]
    if rank is not None:
        assert f"rank {rank}" in detail, detail
    if name == "hang_on_rank1":  # the hung rank's stack leads with the clip's own frame, not torchrun's
        assert first_frame(detail) == clip_frame(broken_targets.hang_on_rank1, "time.sleep(3600)"), detail
        assert "the whole stack" in detail and "torch/distributed" in detail  # the launcher's frames, below
    assert after["verdict"] == "PASS"  # the launch was resumed at the next case
    assert run.summary["unjudged"] == 1 and run.summary["status"] == 3
    assert run.returncode == 3, run.stderr
    assert seconds < 120


def test_an_import_error_on_one_rank_is_printed_with_its_rank(tmp_path):
    target = tmp_path / "rank1_breaks.py"
    target.write_text("import os\nif os.environ.get('RANK') == '1':\n    raise ImportError('only rank 1 lacks it')\n"
                      "from harness.reference import reference as clip\n")
    run = run_harness(2, [*ONE_CASE, "--target", f"{target}:clip"], tmp_path, timeout=120)
    assert "clipcheck: error: rank 1: " in run.stderr and "only rank 1 lacks it" in run.stderr
    assert not run.cases()


# -- matrix -------------------------------------------------------------------------------------------------
def run_matrix(args: list[str], out: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return harness_process([sys.executable, "-m", "harness", "matrix", *args, "--out", str(out)], env, timeout)


def test_a_matrix_whose_rank_died_is_not_a_pass(tmp_path):
    out = tmp_path / "results"
    proc = run_matrix(["--nproc-list", "2", "--scenario", "dense_dp", "--dtype", "fp32", "--norm-type", "2",
                       "--clip-ratio", "0.5", "--variant", "replicated", "--target",
                       f"{BROKEN}:exit_on_rank1,reference", "--timeout", "5"], out)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "=> PASS" not in proc.stdout
    records = [__import__("json").loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    crash = [r for r in records if r.get("type") == "case" and r["verdict"] == "ERROR"]
    assert len(crash) == 1 and "crash" in crash[0]["checks"], (crash, proc.stdout, proc.stderr)
    assert "rank 1" in crash[0]["checks"]["crash"]["detail"]
    suite = ET.parse(out / "junit.xml").getroot()
    suites = [suite] if suite.tag == "testsuite" else list(suite)
    assert sum(int(s.get("errors", 0)) for s in suites) == 1


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_matrix_leaves_no_process_and_merges_what_finished(tmp_path, signum):
    out = tmp_path / "results"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "harness", "matrix", "--nproc-list", "2", "--scenario", "dense_dp",
                             "--dtype", "fp32", "--norm-type", "2", "--clip-ratio", "0.5", "--variant", "replicated",
                             "--target", f"reference,{BROKEN}:hang_on_rank1", "--timeout", "120", "--out", str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and len(descendants(proc.pid)) < 3:  # the launch and its two ranks
        time.sleep(0.5)
    # the reference case is written as soon as it is judged; then the hang begins (poll, not a fixed
    # sleep: on a loaded machine the first case can take far longer than usual)
    launch_results = out / "world2-gloo.jsonl"
    while time.monotonic() < deadline and '"target": "reference"' not in (
            launch_results.read_text() if launch_results.exists() else ""):
        time.sleep(0.5)
    time.sleep(1)
    family = descendants(proc.pid)
    proc.send_signal(signum)
    output, _ = proc.communicate(timeout=90)
    time.sleep(1)
    alive = [p for p in family if Path(f"/proc/{p}").exists()]
    assert not alive, f"orphans left: {alive}\n{output}"
    assert proc.returncode != 0
    merged = out / "results.jsonl"
    assert merged.exists(), output
    text = merged.read_text()
    assert '"target": "reference"' in text and '"verdict": "PASS"' in text


# -- fuzz ---------------------------------------------------------------------------------------------------
def test_fuzz_with_a_target_that_kills_a_rank_ends_in_bounded_time(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    start = time.monotonic()
    proc = harness_process([sys.executable, "-m", "harness", "fuzz", "--target", f"{BROKEN}:exit_on_rank1",
                            "--examples", "5", "--world", "2", "--timeout", "10"], env, timeout=180)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "crash" in proc.stdout + proc.stderr
    assert time.monotonic() - start < 90


def _rank_zero_raises_outside_a_case() -> None:
    if os.environ["RANK"] == "0":
        from harness.run.world.dist_world import DeadRankError

        raise DeadRankError("rank(s) [1] did not report for startup within 120 s: they hung or died")
    time.sleep(60)  # stopped by the launcher once rank 0 has failed


def test_a_rank_that_raises_outside_a_case_is_named_with_its_exception():
    """A crash record names the rank and what it raised, not only its exit code (the exception is in
    the error file torchelastic's record wrote, which the launcher reads back)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from harness.commands.launcher import rank_exits
    from harness.commands.rendezvous import launch_config

    with pytest.raises(ChildFailedError) as failed:
        elastic_launch(launch_config(2), _rank_zero_raises_outside_a_case)()
    described = {e.rank: e.describe() for e in rank_exits(failed.value)}
    assert described[0] == ("rank 0 exited with code 1 (DeadRankError: rank(s) [1] did not report for startup "
                            "within 120 s: they hung or died)")
    assert described.get(1, "rank 1 was killed by SIGTERM") == "rank 1 was killed by SIGTERM"


CORRECT = "tests/correct_targets.py"
RED_TEAM = {  # faults a red team (an adversarial review) got past the judge -> (scenario, variant, dtype) to fail
    "overflows_in_the_gradient_dtype": ("dense_edges", "loss-scaled", "fp16"),
    "poisons_a_finite_case": ("dense_dp", "fsdp dtensor", "fp32"),
    "scales_then_raises": ("dense_dp", "fsdp n", "fp32"),  # the NaN and inf layouts
    "unwraps_dtensor_grads": ("dense_edges", "replicated dtensor", "fp32"),
    "wraps_plain_grads_as_dtensors": ("dense_edges", "replicated dtensor", "fp32"),
    "scales_into_a_new_tensor": ("dense_dp", "fsdp dtensor", "fp32"),
    "zero_grads_for_frozen_params": ("xorl_ep_lora", "ep=2", "fp32"),  # frozen base experts, LoRA trainable
    "rescales_five_seconds_later": ("dense_dp", "fsdp dtensor", "fp32"),  # a thread still alive after the case
    "leaves_grad_mode_off": ("dense_dp", "replicated", "fp32"),
    "leaves_default_dtype_fp64": ("dense_dp", "replicated", "fp32"),
    "sparse_gradients": ("dense_dp", "replicated", "fp32"),  # once a rank crash, every case
    "returns_a_huge_int": ("dense_dp", "replicated", "fp32"),  # once a rank crash, every case
}
CORRECT_POLICIES = ["reference", f"{CORRECT}:raise_on_nonfinite", f"{CORRECT}:raise_in_apex_words", f"{CORRECT}:poison_on_nonfinite",
                    f"{CORRECT}:skip_step_on_nonfinite", f"{CORRECT}:gathered_sum_leave_nonfinite",
                    f"{CORRECT}:grad_dtype_accumulation", f"{CORRECT}:foreach_kernels"]


@pytest.fixture(scope="module")
def red_team_runs(tmp_path_factory):
    """One launch per (scenario, variant, dtype) of ``RED_TEAM``: its escapes, then the correct clips, which
    judge every layout once however many escapes share it (and must pass after whatever the escapes did)."""
    runs = {}
    for where in sorted(set(RED_TEAM.values())):
        scenario, variant, dtype = where
        escapes = [f"{BROKEN}:{name}" for name in sorted(RED_TEAM) if RED_TEAM[name] == where]
        runs[where] = run_clipcheck(2, ["--scenario", scenario, "--variant", variant, "--dtype", dtype, "--norm-type",
                                        "2", "--clip-ratio", "0.5", "--target", ",".join([*escapes, *CORRECT_POLICIES])],
                                    tmp_path_factory.mktemp("red-team"), timeout=400)
    return runs


@pytest.mark.parametrize("name", sorted(RED_TEAM))
def test_a_red_team_escape_fails_its_check_and_correct_clips_written_differently_pass(red_team_runs, name):
    run = red_team_runs[RED_TEAM[name]]
    faulty = run.cases(target=f"{BROKEN}:{name}")
    assert faulty and all(c["verdict"] == "FAIL" and expected_check(name) in failed_checks(c) for c in faulty), \
        [(c["layout"], c["checks"]) for c in faulty]
    passing = [c for t in CORRECT_POLICIES for c in run.cases(target=t)]
    assert passing and all(c["verdict"] == "PASS" for c in passing), \
        [(c["target"], c["layout"], failed_checks(c)) for c in passing if c["verdict"] != "PASS"]


def test_a_raise_on_every_rank_keeps_the_groups_a_target_built_once(tmp_path):
    """A clip that builds its group once, at init, as Megatron and DeepSpeed do, passes after a case in
    which every rank raised (a documented non-finite raise included): nobody is left waiting, so no group is
    destroyed and rebuilt."""
    once = f"{CORRECT}:group_built_once"
    run = run_clipcheck(2, [*ONE_CASE, "--variant", "fsdp", "--target",
                            f"{BROKEN}:raise_everywhere,{once},{CORRECT}:raise_on_nonfinite,{once}"],
                        tmp_path, timeout=240)
    assert all(c["verdict"] == "FAIL" for c in run.cases(target=f"{BROKEN}:raise_everywhere")), run.stdout
    cases = run.cases(target=once)
    assert len(cases) == 2 * FSDP_LAYOUTS and all(c["verdict"] == "PASS" for c in cases), \
        [(c["layout"], failed_checks(c)) for c in cases if c["verdict"] != "PASS"]


def test_a_global_setting_a_target_leaves_changed_is_restored_for_the_next_target(tmp_path):
    """A default dtype a target leaves at float64 is restored: kept, it would make the next target's float32
    coefficient exact, and ``mutant-fp32-copy``-like slips would pass at fp64 after it."""
    run = run_clipcheck(2, [*ONE_CASE[:2], "--variant", "replicated", "--dtype", "fp64", "--norm-type", "2",
                            "--clip-ratio", "0.5", "--target",
                            f"{BROKEN}:leaves_default_dtype_fp64,{BROKEN}:coefficient_in_default_dtype"], tmp_path)
    leak = run.cases(target=f"{BROKEN}:leaves_default_dtype_fp64")
    assert leak and "default dtype float32 -> float64" in leak[0]["checks"]["contract"]["detail"], leak[0]["checks"]
    slipped = run.cases(target=f"{BROKEN}:coefficient_in_default_dtype")
    assert slipped and all(c["verdict"] == "FAIL" and "coefficient" in failed_checks(c) for c in slipped), \
        [(c["layout"], c["checks"]) for c in slipped]


def test_a_target_cannot_rewrite_the_plan_later_targets_are_judged_on(tmp_path):
    """The declared plan is read-only: a target writing the true placements into ctx.declared (the variant's
    shared plan) would make a later plan-trusting target (xorl-style) pass cases it fails alone."""
    args = ["--scenario", "xorl_ep_lora", "--dtype", "fp32", "--norm-type", "2", "--clip-ratio", "0.5"]
    alone = run_clipcheck(2, [*args, "--target", "xorl-style"], tmp_path)
    after = run_clipcheck(2, [*args, "--target", f"{BROKEN}:rewrites_the_plan,xorl-style"], tmp_path)
    fails = [sum(c["verdict"] == "FAIL" for c in run.cases(target="xorl-style")) for run in (alone, after)]
    assert fails[0] > 0 and fails[0] == fails[1], fails
    rewriting = after.cases(target=f"{BROKEN}:rewrites_the_plan")
    assert rewriting and all("TypeError" in c["checks"]["raised"]["detail"] for c in rewriting)


EDGE_LAYOUTS = {  # a clip wrong only on one of dense_edges' newer layouts -> that variant
    "assumes_plain_grads_replicated": "plain sharded weights, replicated dtensor biases",
    "counts_tied_weights_twice": "tied head, empty parameter",
    "inf_norm_without_empty_guard": "tied head, empty parameter",
    "coefficient_in_param_dtype": "bf16 parameters",
}


def test_the_edge_layouts_fail_the_clips_wrong_only_there_and_pass_the_correct_ones(tmp_path):
    run = run_clipcheck(2, ["--scenario", "dense_edges", "--dtype", "fp32", "--clip-ratio", "0.5", "--target",
                            ",".join([*(f"{BROKEN}:{name}" for name in EDGE_LAYOUTS), *CORRECT_POLICIES])],
                        tmp_path, timeout=400)
    for name, variant in EDGE_LAYOUTS.items():
        cases = run.cases(target=f"{BROKEN}:{name}")
        # counting mistakes do not move a maximum; the missing guard is on the inf path only
        there = [c for c in cases if variant in c["layout"]
                 and (c["clip_ratio"] == 0.5 if name.startswith("coefficient")  # nothing to scale at x2
                      else (c["norm"] == "Linf") == name.startswith("inf"))]
        assert there and all(c["verdict"] == "FAIL" and expected_check(name) in failed_checks(c) for c in there), \
            (name, [(c["layout"], c["norm"], failed_checks(c)) for c in there])
        elsewhere = [c for c in cases if variant not in c["layout"] and "x64" not in c["layout"]]
        assert all(c["verdict"] == "PASS" for c in elsewhere), (name, [c["layout"] for c in elsewhere
                                                                       if c["verdict"] != "PASS"])
    passing = [c for t in CORRECT_POLICIES for c in run.cases(target=t)]
    assert passing and all(c["verdict"] == "PASS" for c in passing), \
        [(c["target"], c["layout"], c["norm"], failed_checks(c)) for c in passing if c["verdict"] != "PASS"]


def test_a_clip_that_skips_every_other_call_fails_the_fixed_cases(tmp_path):
    """A clip that clips only on odd calls fails the fixed cases: every other bound group is reversed (with
    x0.5, x2 alternating, it would skip exactly the cases that need no clipping and pass every one)."""
    run = run_clipcheck(2, ["--scenario", "dense_dp", "--variant", "fsdp", "--dtype", "fp32", "--norm-type", "2,inf",
                            "--target", f"{BROKEN}:clips_on_odd_calls_only"], tmp_path)
    ratios = [c["clip_ratio"] for c in run.cases()]
    assert ratios[:4] == [0.5, 2.0, 2.0, 0.5], ratios
    assert any(c["verdict"] == "FAIL" and "coefficient" in failed_checks(c) for c in run.cases()), run.stdout
