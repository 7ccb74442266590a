"""VeOmni's own clip (``veomni_clip_grad_norm``) on models VeOmni itself parallelized, with the gradients
delivered through VeOmni's own path (a backward through FSDP2's reduce-scatter and the EP SUM hook of
``LoraSharedExperts``), on real torchrun jobs. Where VeOmni is not installed its cases must be skips
carrying the install hint; where it is, the verdicts and ratios below are the ones verified by hand
(see the veomni adapter and scenario)."""

import math

import pytest

from harness.scenarios.veomni import FRAMEWORK as VEOMNI
from harness_runs import failed, run_clipcheck

pytestmark = pytest.mark.distributed

ONE = dict(target="veomni", norm="L2", dtype="fp32", clip_ratio=0.5)


@pytest.fixture(scope="module")
def veomni_world4(tmp_path_factory):
    return run_clipcheck(4, ["--scenario", "veomni_ep", "--target", "veomni,reference", "--dtype", "fp32",
                           "--norm-type", "2,inf"], tmp_path_factory.mktemp("veomni4"))


@pytest.fixture(scope="module")
def veomni_world2(tmp_path_factory):
    return run_clipcheck(2, ["--scenario", "veomni_ep", "--target", "veomni,reference", "--dtype", "bf16",
                           "--norm-type", "2,inf"], tmp_path_factory.mktemp("veomni2"))


@pytest.fixture(scope="module")
def veomni_synthetic4(tmp_path_factory):
    return run_clipcheck(4, ["--scenario", "veomni_ep", "--target", "veomni", "--dtype", "fp32", "--norm-type", "2",
                           "--variant", "shared-lora differing", "--synthetic"], tmp_path_factory.mktemp("veomni4s"))


def skipped_here(run):
    if not VEOMNI.unavailable():
        return False
    cases = run.cases(target="veomni")
    assert cases and all(c["verdict"] == "SKIP" for c in cases)
    assert all(VEOMNI.install in c["skip_reason"] for c in cases)
    assert run.summary["skipped"] >= len(cases)
    return True


def test_layouts_at_world4(veomni_world4):
    layouts = {c["layout"] for c in veomni_world4.cases(target="veomni")}
    assert layouts == {
        "dp_replicate=1 ep_fsdp=4 ep=1 experts", "dp_replicate=1 ep_fsdp=4 ep=1 shared-lora",
        "dp_replicate=1 ep_fsdp=2 ep=2 experts", "dp_replicate=1 ep_fsdp=2 ep=2 shared-lora",
        "dp_replicate=1 ep_fsdp=1 ep=4 experts", "dp_replicate=1 ep_fsdp=1 ep=4 shared-lora",
        "dp_replicate=2 ep_fsdp=2 ep=1 experts", "dp_replicate=2 ep_fsdp=2 ep=1 shared-lora",
        "dp_replicate=2 ep_fsdp=1 ep=2 experts", "dp_replicate=2 ep_fsdp=1 ep=2 shared-lora",
        "dp_replicate=1 ep_fsdp=1 ep=4 experts nan",
    }  # 'shared-lora differing' is synthetic: VeOmni's hook never lets a backward reach it
    assert all(c["synthetic"] is None for c in veomni_world4.cases(target="veomni"))
    assert "synthetic layouts of veomni_ep run only with --synthetic" in veomni_world4.stdout
    assert {c["layout"] for c in veomni_world4.cases(target="reference") if "differing" in c["layout"]} == {
        "dp_replicate=1 ep_fsdp=2 ep=2 shared-lora differing", "dp_replicate=1 ep_fsdp=1 ep=4 shared-lora differing",
        "dp_replicate=2 ep_fsdp=1 ep=2 shared-lora differing"}  # the harness's own targets still run it


def test_every_default_layout_arrives_through_veomnis_gradient_path(veomni_world4, veomni_world2):
    """The backward step's gradients passed the runner's bit-for-bit check on every rank (a difference is a
    harness ERROR naming the parameters), so what the clip saw is what VeOmni's trainer hands it."""
    for run in (veomni_world4, veomni_world2):
        if skipped_here(run):
            return
        assert run.summary["harness_errors"] == 0 and run.cases(target="veomni")
        assert all(c["verdict"] in ("PASS", "FAIL") for c in run.cases(target="veomni"))


def test_ep_fsdp_and_hsdp_are_exact(veomni_world4):
    """EP buckets over ep_fsdp then ep, HSDP dense bucket over the shard group only (VeOmni #184 /
    PRs #185, #862 are in 0.1.12: no x sqrt(dp_replicate))."""
    run = veomni_world4
    if skipped_here(run):
        return
    for layout in ("dp_replicate=1 ep_fsdp=2 ep=2 experts", "dp_replicate=1 ep_fsdp=1 ep=4 experts",
                   "dp_replicate=2 ep_fsdp=1 ep=2 experts", "dp_replicate=2 ep_fsdp=2 ep=1 experts",
                   "dp_replicate=1 ep_fsdp=4 ep=1 experts"):
        cases = run.cases(target="veomni", layout=layout)
        assert len(cases) == 4 and all(c["verdict"] == "PASS" for c in cases), layout  # L2/inf x 2 bounds
        assert all(c["framework"] == "veomni 0.1.12" for c in cases)
    hsdp = run.one(layout="dp_replicate=2 ep_fsdp=1 ep=2 experts", **ONE)
    assert f"{hsdp['ratio']:.6f}" == "1.000000"


def test_shared_lora_counted_once_over_ep(veomni_world4):
    """The LoraSharedExperts bucket skips the ep reduction (the PR #758 review's x sqrt(ep) is fixed), and
    the inf path folds three buckets without the torch.maximum TypeError."""
    run = veomni_world4
    if skipped_here(run):
        return
    for ep in (1, 2, 4):
        for case in run.cases(target="veomni", layout_has=f"ep={ep} shared-lora"):
            if "differing" not in case["layout"]:
                assert case["verdict"] == "PASS", (case["layout"], case["norm"], failed(case))
    gap = run.metamorphic(target="veomni", norm="L2", dtype="fp32", invariance_key="veomni-shared-lora",
                          bound="x0.5")
    assert gap and all(g["passed"] for g in gap)


@pytest.mark.parametrize("layout, ranks", [
    ("dp_replicate=1 ep_fsdp=2 ep=2 shared-lora differing", ("0.755065", "0.753606", "0.755065", "0.753606")),
    ("dp_replicate=1 ep_fsdp=1 ep=4 shared-lora differing", ("0.548460", "0.547400", "0.555657", "0.556145")),
    ("dp_replicate=2 ep_fsdp=1 ep=2 shared-lora differing", ("0.755065", "0.753606", "0.755065", "0.753606")),
])
def test_shared_lora_differing_is_a_synthetic_regression_layout(veomni_synthetic4, layout, ranks):
    """Shared factors whose gradients differ per EP rank (only with --synthetic: written into .grad after the
    setup, VeOmni's EP SUM hook never runs): VeOmni skips the ep reduction, so each EP rank reports
    sqrt(dense + its own shared-LoRA part) and clips by its own coefficient. Its finding is synthetic."""
    run = veomni_synthetic4
    if skipped_here(run):
        return
    case = run.one(layout=layout, **ONE)
    assert case["synthetic"] and "SUMs each shared factor's gradient over the EP group" in case["synthetic"]
    assert case["verdict"] == "FAIL" and failed(case) == {"norm", "agree", "coefficient"}
    truth = case["true_norm"]
    assert tuple(f"{v / truth:.6f}" for v in case["reported"]) == ranks
    assert case["declared_mismatches"][0].startswith("declared Replicate on ep, measured distinct")
    assert case["finding"]["reach"] == "synthetic" and "new finding" not in case["finding"]["text"]
    assert "report to" not in case["finding"]["text"]


def test_inf_norm_loses_a_nan_on_a_nonzero_rank(veomni_world4):
    """A NaN in an expert on the last EP rank: the L2 path reports NaN everywhere; the inf path's MAX
    all-reduce (gloo keeps a NaN only when it arrives first) drops it, and every rank reports a finite
    norm computed without that rank's experts."""
    run = veomni_world4
    if skipped_here(run):
        return
    layout = "dp_replicate=1 ep_fsdp=1 ep=4 experts nan"
    for case in run.cases(target="veomni", layout=layout, norm="L2"):
        assert case["verdict"] == "PASS"
    for case in run.cases(target="veomni", layout=layout, norm="Linf"):
        assert case["verdict"] == "FAIL" and failed(case) == {"nonfinite"}
        assert all(isinstance(v, float) and math.isfinite(v) for v in case["reported"])
        assert len(set(case["reported"])) == 1
        assert "0: reported a finite norm and changed the gradients otherwise" in case["checks"]["nonfinite"]["detail"]
        assert case["finding"]["owner"] == "pytorch/pytorch" and case["finding"]["reach"] == "direct-call"


def test_bf16_at_world2(veomni_world2):
    run = veomni_world2
    if skipped_here(run):
        return
    assert not run.cases(target="veomni", layout_has="differing")
    for case in run.cases(target="veomni"):
        layout, norm = case["layout"], case["norm"]
        if "nan" in layout and norm == "Linf":
            assert case["verdict"] == "FAIL" and failed(case) == {"nonfinite"}, layout
        else:
            assert case["verdict"] == "PASS", (layout, norm, failed(case))


def test_every_reference_case_passes(veomni_world4, veomni_world2):
    for run in (veomni_world4, veomni_world2):
        assert all(c["verdict"] == "PASS" for c in run.cases(target="reference"))
        assert run.summary["harness_errors"] == 0
