"""torchtitan 0.3.0 on real multi-rank jobs (``clipcheck run``): its EP clip on a model parallelized in its trainer's order
(meta build, experts over ep, its own ``apply_fsdp_to_decoder``) with gradients through FSDP2's
reduce-scatter, its PP clip on FSDP-wrapped stages, and the standalone reproduction of the one
finding that is not synthetic. Where torchtitan is not installed every case is a skip carrying the
install hint, and the reproduction is skipped with it."""

import re

import pytest

from harness.scenarios.torchtitan import FRAMEWORK as TORCHTITAN
from harness.scenarios.torchtitan import TARGETS
from harness_runs import ROOT, expect_skips, failed, run_clipcheck
from repro_runs import stdout_lines

pytestmark = pytest.mark.distributed

MIXED_MESH = "RuntimeError: All operands in aten.stack.default must have the same mesh"


@pytest.fixture(scope="module")
def titan_world4(tmp_path_factory):
    return run_clipcheck(4, ["--scenario", "torchtitan_ep", "--target", "torchtitan,reference", "--ep-size", "2",
                           "--synthetic"], tmp_path_factory.mktemp("titan4"))


@pytest.fixture(scope="module")
def titan_world2(tmp_path_factory):
    return run_clipcheck(2, ["--scenario", "torchtitan_ep", "--target", "torchtitan", "--dtype", "fp32"],
                       tmp_path_factory.mktemp("titan2"))


def test_every_target_takes_the_gradients_through_fsdp():
    assert all(t.backward is not None for t in TARGETS)


def test_honest_layout_exact_through_torchtitans_own_fsdp(titan_world4):
    run = titan_world4
    if TORCHTITAN.unavailable():
        expect_skips(run, TORCHTITAN, "torchtitan")
        return
    honest = run.cases(target="torchtitan", layout="efsdp=2 ep=2 honest")
    assert len(honest) == 8 and all(c["verdict"] == "PASS" for c in honest)  # L2/inf x fp32/bf16 x 2 bounds
    assert all(c["framework"] == "torchtitan 0.3.0" for c in honest)
    assert run.summary["harness_errors"] == 0  # the backward delivered every layout's gradients bit for bit
    assert all(c["verdict"] == "PASS" for c in run.cases(target="reference"))


def test_placement_lies_is_a_synthetic_regression_layout(titan_world4):
    run = titan_world4
    if TORCHTITAN.unavailable():
        return
    lies = run.one(target="torchtitan", layout="efsdp=2 ep=2 placement lies", norm="L2", dtype="fp32", clip_ratio=0.5)
    assert lies["verdict"] == "FAIL" and lies["synthetic"]
    assert lies["declared_mismatches"] == ["declared Replicate on ep, measured distinct: shared_lora_A"]
    assert lies["finding"]["reach"] == "synthetic" and "new finding" not in lies["finding"]["text"]


def test_experts_without_ep_dim_raise_through_torchs_stack(titan_world4):
    run = titan_world4
    if TORCHTITAN.unavailable():
        return
    for case in run.cases(target="torchtitan", layout="efsdp=2 ep=2 experts without ep dim"):
        assert case["verdict"] == "FAIL" and failed(case) == {"raised"}, case["checks"]
        assert MIXED_MESH in case["checks"]["raised"]["detail"]
        finding = case["finding"]
        assert (finding["reach"], finding["owner"], finding["upstream"]) == (
            "direct-call", "pytorch/pytorch", "pytorch/pytorch #180346")
        assert (ROOT / finding["repro"]).is_file()


def test_synthetic_layouts_stay_out_by_default(titan_world2):
    run = titan_world2
    if TORCHTITAN.unavailable():
        expect_skips(run, TORCHTITAN, "torchtitan")
        return
    assert {c["layout"] for c in run.cases(target="torchtitan")} == {
        "efsdp=2 ep=1 honest", "efsdp=1 ep=2 honest", "efsdp=1 ep=2 experts without ep dim"}
    assert "synthetic layouts of torchtitan_ep run only with --synthetic" in run.stdout
    assert all(c["verdict"] == "PASS" for c in run.cases(target="torchtitan", layout_has="honest"))
    assert run.summary["harness_errors"] == 0


@pytest.fixture(scope="module")
def stages_world4(tmp_path_factory):
    return run_clipcheck(4, ["--scenario", "pipeline_stages", "--target", "torchtitan-pp,reference", "--dtype", "fp32"],
                       tmp_path_factory.mktemp("stages"))


def test_torchtitan_reduces_over_pipeline_stages(stages_world4):
    run = stages_world4
    if TORCHTITAN.unavailable():
        expect_skips(run, TORCHTITAN, "torchtitan-pp")
        return
    cases = run.cases(target="torchtitan-pp")
    layouts = {c["layout"] for c in cases}
    # pp=1, 2, 4 untied and the single-stage tied control: L2 and inf, bound below and above
    assert layouts == {"pp=1 dp=4 tied embedding", "pp=1 dp=4 untied", "pp=2 dp=2 untied", "pp=4 dp=1 untied"}
    assert len(cases) == 16 and all(c["verdict"] == "PASS" for c in cases), [
        (c["layout"], failed(c)) for c in cases if c["verdict"] != "PASS"]
    # layouts torchtitan itself rejects are refused with its reason, not judged
    assert "refuses some pipeline_stages layouts: a weight tied across stages" in run.stdout
    assert "expert stages (EP with PP) are not modelled" in run.stdout
    assert all(c["verdict"] == "PASS" for c in run.cases(target="reference"))
    assert run.summary["harness_errors"] == 0


def torchrun(script: str, nproc: int, *args: str) -> list[str]:
    """The lines rank 0 printed, from a standalone run of one of the repository's scripts."""
    return [line for line in stdout_lines(script, nproc, *args)
            if line.startswith(("reported=", "world "))]


@pytest.mark.parametrize("nproc", [2, 4])
def test_repro_experts_without_ep_dim(nproc):
    if TORCHTITAN.unavailable():
        pytest.skip(TORCHTITAN.unavailable())
    lines = torchrun("scenarios/torchtitan/repro_experts_without_ep_dim.py", nproc)
    control, finding = lines[1], lines[3]
    reported, true = re.fullmatch(r"reported=(\S+) true=(\S+) error=", control).groups()  # torchtitan's own layout
    assert abs(float(reported) / float(true) - 1) < 1e-5
    assert finding.startswith(f"reported=raised true={true} error={MIXED_MESH}")
