"""torchtune 0.6.1's distributed full-finetune recipe on real multi-rank jobs (``clipcheck run``): its llama3 builder, TP
plan and ``shard_model``, then the recipe's clip step. FSDP2 alone and a TP plan that covers every
parameter are exact; the base TP plan (norms left plain) crashes, with TP alone (torchtune #2420:
plain and DTensor gradients mixed in torch's foreach norm) and with FSDP (1-D and 2-D meshes mixed).
Where torchtune is not installed every case is a skip carrying the install hint."""


import pytest

from harness.scenarios.torchtune import FRAMEWORK as TORCHTUNE
from harness.scenarios.torchtune.adapter import TARGETS as TORCHTUNE_TARGETS
from harness_runs import expect_skips, failed, run_clipcheck
from repro_runs import stdout_lines

pytestmark = pytest.mark.distributed

MIXED_PLAIN = ("RuntimeError: aten._foreach_norm.Scalar got mixed torch.Tensor and DTensor, need to convert all "
               "torch.Tensor to DTensor before calling distributed operators!")
MIXED_MESH = ("RuntimeError: All operands in aten.stack.default must have the same mesh, but got "
              "DeviceMesh((dp=2), 'cpu', stride=(2,)) and DeviceMesh((dp=2, tp=2), 'cpu', stride=(2, 1))")


@pytest.fixture(scope="module")
def torchtune_world2(tmp_path_factory):
    return run_clipcheck(2, ["--scenario", "torchtune_tp", "--dtype", "fp32,bf16"], tmp_path_factory.mktemp("tt2"))


@pytest.fixture(scope="module")
def torchtune_world4(tmp_path_factory):
    return run_clipcheck(4, ["--scenario", "torchtune_tp", "--dtype", "fp32"], tmp_path_factory.mktemp("tt4"))






def expect_raised(case, message, ranks):
    assert case["verdict"] == "FAIL" and failed(case) == {"raised"}, (case["layout"], failed(case))
    assert case["checks"]["raised"]["detail"].startswith(f"ranks {ranks}: {message}"), case["checks"]["raised"]


def test_world2_fsdp_and_full_tp_plan_exact_base_tp_plan_crashes(torchtune_world2):
    run = torchtune_world2
    if TORCHTUNE.unavailable():
        expect_skips(run, TORCHTUNE, "torchtune")
        return
    assert {c["layout"] for c in run.cases(target="torchtune")} == {
        "dp=2 tp=1 fsdp", "dp=1 tp=2 tp sp-norms", "dp=1 tp=2 tp base plan"}
    assert {c["norm"] for c in run.cases(target="torchtune")} == {"L2"}  # the recipe passes no norm type
    assert all(c["framework"] == "torchtune 0.6.1" for c in run.cases(target="torchtune"))
    for layout in ("dp=2 tp=1 fsdp", "dp=1 tp=2 tp sp-norms"):
        cases = run.cases(target="torchtune", layout=layout)
        assert len(cases) == 4 and all(c["verdict"] == "PASS" for c in cases), [failed(c) for c in cases]
        assert all(abs(c["ratio"] - 1) < c["tolerance"] for c in cases)
    for case in run.cases(target="torchtune", layout="dp=1 tp=2 tp base plan"):
        expect_raised(case, MIXED_PLAIN, [0, 1])
        finding = case["finding"]
        assert finding["reach"] == "stock" and "tensor_parallel_dim=N clip_grad_norm=1.0" in finding["how"]
        assert finding["repro"] == "scenarios/torchtune/repro_tp_plain_norms.py"
    assert all(c["verdict"] == "PASS" for c in run.cases(target="reference"))
    assert run.summary["harness_errors"] == 0


def test_world4_tp_with_fsdp(torchtune_world4):
    run = torchtune_world4
    if TORCHTUNE.unavailable():
        expect_skips(run, TORCHTUNE, "torchtune")
        return
    for layout in ("dp=4 tp=1 fsdp", "dp=2 tp=2 tp+fsdp sp-norms", "dp=1 tp=4 tp sp-norms"):
        cases = run.cases(target="torchtune", layout=layout)
        assert len(cases) == 2 and all(c["verdict"] == "PASS" for c in cases), [failed(c) for c in cases]
        assert all(f"{c['ratio']:.6f}" == "1.000000" for c in cases)
    sp = run.one(target="torchtune", layout="dp=2 tp=2 tp+fsdp sp-norms", clip_ratio=0.5)
    assert sp["measured_placements"]["norm.scale"] == "replicated on tp; distinct on dp"
    for case in run.cases(target="torchtune", layout="dp=2 tp=2 tp+fsdp base plan"):
        expect_raised(case, MIXED_MESH, [0, 1, 2, 3])
    for case in run.cases(target="torchtune", layout="dp=1 tp=4 tp base plan"):
        expect_raised(case, MIXED_PLAIN, [0, 1, 2, 3])
    gaps = run.metamorphic(target="torchtune", norm="L2", dtype="fp32")
    assert gaps and all(g["passed"] for g in gaps)  # the layouts that run agree on the coefficient
    assert all(c["verdict"] == "PASS" for c in run.cases(target="reference"))
    assert run.summary["harness_errors"] == 0


def test_gradients_come_through_the_recipe_backward():
    """The layout's gradients are handed over by a backward through the sharded model (FSDP2's
    reduce-scatter acts between the recipe's ``loss.backward()`` and its clip), not written into ``.grad``."""
    assert all(t.backward is not None for t in TORCHTUNE_TARGETS)


@pytest.mark.skipif(bool(TORCHTUNE.unavailable()), reason=f"torchtune is not installed: {TORCHTUNE.install}")
@pytest.mark.parametrize("nproc, args, ranks, message", [
    (2, (), "[0, 1] of 2 (dp=1, tp=2", MIXED_PLAIN),
    (4, ("--dp", "2"), "[0, 1, 2, 3] of 4 (dp=2, tp=2", MIXED_MESH),
])
def test_repro_tp_plain_norms(nproc, args, ranks, message):
    """torchtune #2420 through the recipe's own class (``FullFinetuneRecipeDistributed``: setup, one
    training step) with ``tensor_parallel_dim`` and ``clip_grad_norm=1.0``: every rank raises at the
    clip, before touching a gradient (the true norm is still there to gather)."""
    lines = stdout_lines("scenarios/torchtune/repro_tp_plain_norms.py", nproc, *args)
    assert lines[-2].startswith(f"ranks raising: {ranks}"), lines
    reported, true, error = lines[-1].split(" ", 2)
    assert reported == "reported=raised" and float(true.removeprefix("true=")) > 0
    assert error.startswith("error=" + message), lines[-1]
