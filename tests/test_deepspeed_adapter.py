"""DeepSpeed's fp32 clip on real multi-rank jobs (``clipcheck run``): ``clip_grad_norm_`` called directly (direct-call reach)
and ``DeepSpeedEngine.clip_fp32_gradients`` after ``engine.backward`` (the engine's own all-reduce
delivers the gradients), and the standalone reproductions in ``scenarios/deepspeed/``. Where DeepSpeed
is not installed, its cases are skips carrying the install hint and the reproductions are skipped."""

from __future__ import annotations

import re

import pytest

from harness.scenarios.deepspeed import FRAMEWORK as DEEPSPEED
from harness.scenarios.deepspeed.framework import RELEASES
from harness_runs import expect_skips, failed, run_clipcheck
from repro_runs import run_script

pytestmark = pytest.mark.distributed


def test_deepspeed_fp32_clip_averages_local_norms(deepspeed_world2):
    run = deepspeed_world2
    if DEEPSPEED.unavailable():
        expect_skips(run, DEEPSPEED, "deepspeed", "deepspeed-engine")
        return
    for target in ("deepspeed", "deepspeed-engine"):
        for case in run.cases(target=target):
            assert case["framework"].startswith("deepspeed ")
            assert not case["synthetic"], case["layout"]  # no-expert-rank: opt-in only
            reach = case["finding"]["reach"] if case["finding"] else None
            if "replicated" in case["layout"] or "nan" in case["layout"]:
                assert case["verdict"] == "PASS", case["layout"]
            elif "frozen-dense idle-rank" in case["layout"]:
                # the rank holding no gradient raises (L2: IndexError after the all-reduce, the healthy rank
                # returns the mean with a zero in it; inf: RuntimeError before it)
                assert target == "deepspeed" and "raised" in failed(case), case["layout"]
                detail = case["checks"]["raised"]["detail"]
                assert ("IndexError" if case["norm"] == "L2" else "RuntimeError: stack expects a non-empty") in detail
                assert reach == "direct-call" and case["finding"]["repro"].endswith("repro_idle_rank_crash.py")
            else:
                assert case["verdict"] == "FAIL", case["layout"]
                assert any("mean of the rank-local norms" in s for s in case["signature"])
                assert reach == ("direct-call" if "no-grad" in case["layout"] else "stock"), case["layout"]
    gap = run.metamorphic(target="deepspeed", norm="L2", dtype="fp32", invariance_key="autoep", bound="x0.5")[0]
    assert not gap["passed"] and gap["gap"] > 0
    assert all(c["verdict"] == "PASS" for c in run.cases(target="reference"))


def test_deepspeed_engine_runs_its_own_backward(deepspeed_world2):
    run = deepspeed_world2
    engine = run.cases(target="deepspeed-engine")
    assert {c["norm_type"] for c in engine} == {2.0} and {c["dtype"] for c in engine} == {"fp32"}
    assert "target deepspeed-engine supports norm types L2 only" in run.stdout
    # a None gradient never reaches the engine's clip: its all-reduce zero-fills it
    assert "DeepSpeedEngine never hands its clip a None gradient" in run.stdout
    assert not any("no-grad" in c["layout"] or "idle-rank" in c["layout"] for c in engine)
    assert "synthetic layouts of deepspeed_autoep run only with --synthetic" in run.stdout
    if DEEPSPEED.unavailable():
        return
    assert run.summary["harness_errors"] == 0  # what engine.backward delivered is bit for bit the layout's
    sharded = run.one(target="deepspeed-engine", layout="edp=1 ep=2 owner-sharded", clip_ratio=0.5)
    direct = run.one(target="deepspeed", layout="edp=1 ep=2 owner-sharded", norm="L2", dtype="fp32", clip_ratio=0.5)
    assert sharded["verdict"] == "FAIL" and sharded["reported"] == pytest.approx(direct["reported"], rel=1e-6)


@pytest.fixture(scope="module")
def engine_world4(tmp_path_factory):
    return run_clipcheck(4, ["--scenario", "deepspeed_autoep", "--target", "deepspeed-engine", "--dtype", "fp32",
                           "--ep-size", "2,4", "--clip-ratio", "0.5"], tmp_path_factory.mktemp("ds4"))


def test_deepspeed_engine_reduces_experts_over_their_data_parallel_group(engine_world4):
    """World 4, ep=2: every expert has two replicas, all-reduced by the engine over its expert-data-parallel
    group (a wrong group or divisor would be a harness error: the delivery check)."""
    run = engine_world4
    if DEEPSPEED.unavailable():
        expect_skips(run, DEEPSPEED, "deepspeed-engine")
        return
    assert run.summary["harness_errors"] == 0
    for layout, ratio in (("edp=2 ep=2 owner-sharded", 0.729227), ("edp=1 ep=4 owner-sharded", 0.546597)):
        case = run.one(target="deepspeed-engine", layout=layout)
        assert case["verdict"] == "FAIL" and f"{case['ratio']:.6f}" == f"{ratio:.6f}", layout
        assert case["finding"]["reach"] == "stock"


def _repro(script: str, nproc: int) -> str:
    if DEEPSPEED.unavailable():
        pytest.skip(f"deepspeed is not installed: {DEEPSPEED.install}")
    return run_script(f"scenarios/deepspeed/{script}", nproc,
                      env={"DS_ACCELERATOR": "cpu"}, timeout=240).stdout


@pytest.mark.parametrize("nproc", [2, 4])
def test_repro_engine_mean_of_norms(nproc):
    out = _repro("repro_engine_mean_of_norms.py", nproc)
    line = re.search(r"^reported=([\d.]+) true=([\d.]+) ratio=([\d.]+)$", out, re.M)
    assert line, out
    reported, true, ratio = map(float, line.groups())
    assert ratio < 0.97 and reported == pytest.approx(ratio * true, rel=1e-5)
    mean = re.search(r"their mean ([\d.]+);", out)
    assert mean and float(mean.group(1)) == pytest.approx(reported, rel=1e-5)  # the mean of per-rank norms


def test_repro_idle_rank_crash():
    out = _repro("repro_idle_rank_crash.py", 2)
    assert re.search(r"^l2_idle=IndexError l2_ratio=0\.500000 inf_idle=RuntimeError inf_healthy=blocked>=5s$",
                     out, re.M), out


def test_releases_are_listed_oldest_first():
    versions = [tuple(int(x) for x in v.split(".")) for v in RELEASES]
    assert versions == sorted(versions) and RELEASES[-1] == "0.19.8" and len(RELEASES) >= 2
    assert f"deepspeed=={RELEASES[-1]}" in DEEPSPEED.recipe[0]  # the pin is the newest release swept
