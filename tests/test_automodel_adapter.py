"""NeMo Automodel's ``scale_grads_and_clip_grad_norm`` on real multi-rank jobs (``clipcheck run``) (the ``automodel_ep``
scenario), the model built, marked and parallelized by Automodel's own code and its gradients
delivered by a backward through its FSDP2 units. Where nemo-automodel 0.7.0 is installed it must be
exact on every layout its MoE parallelizer produces (dense FSDP2 on dp_shard_cp; TE experts as plain
tensors or ep_shard DTensors, marked by ``GroupedExpertsTE`` itself; torch experts as ep DTensors);
the pre-#3817 state (TE experts without the marker) is a synthetic layout, run only on request, and
fails exactly as NVIDIA-NeMo/Automodel #3816 describes. The standalone reproduction runs too (on
0.7.0 it must show the fix). Where Automodel is not installed, every case is a skip with the hint."""

import importlib.metadata

import pytest

from harness.scenarios.automodel import FRAMEWORK as AUTOMODEL
from harness.scenarios.automodel.framework import RELEASES
from harness_runs import expect_skips, failed, run_clipcheck
from repro_runs import run_repro

pytestmark = pytest.mark.distributed

REPRO = "scenarios/automodel/repro_te_experts_ep_norm.py"
LAYOUTS = {"dp_shard_cp=4 dense fsdp",
           *(f"{mesh} {kind}" for mesh in ("ep_fsdp=2 ep=2", "ep_fsdp=1 ep=4") for kind in ("te experts", "torch experts"))}


@pytest.fixture(scope="module")
def automodel_world4(tmp_path_factory):
    return run_clipcheck(4, ["--scenario", "automodel_ep", "--dtype", "fp32", "--clip-ratio", "0.5"],
                       tmp_path_factory.mktemp("automodel4"))


@pytest.fixture(scope="module")
def automodel_world2_synthetic(tmp_path_factory):
    # seed 1 puts the largest gradient element in an expert tensor, so Linf sees #3816 too
    return run_clipcheck(2, ["--scenario", "automodel_ep", "--target", "automodel", "--seed", "1", "--synthetic",
                           "--dtype", "fp32,bf16", "--clip-ratio", "0.5"], tmp_path_factory.mktemp("automodel2"))


def _version() -> str:
    return importlib.metadata.version("nemo-automodel")


def test_releases_tuple_names_the_pin_last():
    assert RELEASES == tuple(sorted(RELEASES, key=lambda v: tuple(int(x) for x in v.split("."))))
    assert f"nemo-automodel=={RELEASES[-1]}" in " ".join(AUTOMODEL.recipe)


@pytest.mark.parametrize("target", ["automodel", "automodel-torch-clip"])
def test_automodel_070_exact_on_every_layout_its_parallelizer_builds(automodel_world4, target):
    run = automodel_world4
    if AUTOMODEL.unavailable():
        expect_skips(run, AUTOMODEL, target)
        return
    if _version() != RELEASES[-1]:
        pytest.skip(f"nemo-automodel {_version()} installed; these verdicts are {RELEASES[-1]}'s")
    cases = run.cases(target=target)
    assert {c["layout"] for c in cases} == LAYOUTS  # the synthetic 'unmarked' layouts are not run by default
    assert len(cases) == 10  # 5 layouts x (L2, Linf)
    for case in cases:
        assert case["verdict"] == "PASS", (case["layout"], case["norm"], failed(case))
        assert not case["synthetic"]
    assert {c["framework"] for c in cases} == {"nemo-automodel 0.7.0"}
    # the torch experts give the dense-FSDP control's coefficient (same unique gradients)
    groups = run.metamorphic(target=target, invariance_key="automodel-torch")
    assert len(groups) == 2 and all(g["passed"] for g in groups), groups  # L2 and Linf
    assert all(c["verdict"] == "PASS" for c in run.cases(target="reference"))
    assert run.summary["harness_errors"] == 0  # the backward delivered every layout's gradients bit for bit


def test_unmarked_te_experts_are_synthetic_and_fail_as_in_issue_3816(automodel_world2_synthetic):
    run = automodel_world2_synthetic
    if AUTOMODEL.unavailable():
        expect_skips(run, AUTOMODEL, "automodel")
        return
    for dtype in ("fp32", "bf16"):
        for norm in ("L2", "Linf"):
            for kind in ("te experts", "torch experts"):
                case = run.one(target="automodel", layout=f"ep_fsdp=1 ep=2 {kind}", norm=norm, dtype=dtype)
                if kind == "te experts" and _version() < "0.7.0":  # 0.6.0: no marker, the stock #3816
                    unmarked = run.one(target="automodel", layout="ep_fsdp=1 ep=2 te experts unmarked", norm=norm,
                                       dtype=dtype)  # the same state as the synthetic layout on 0.7.0
                    assert (case["verdict"], case["ratio"]) == (unmarked["verdict"], unmarked["ratio"])
                    if case["verdict"] == "FAIL":
                        assert case["finding"]["reach"] == "stock", (norm, dtype)
                else:
                    assert case["verdict"] == "PASS", (kind, norm, dtype, failed(case))
    l2 = run.one(target="automodel", layout="ep_fsdp=1 ep=2 te experts unmarked", norm="L2", dtype="fp32")
    assert l2["synthetic"] and l2["finding"]["reach"] == "synthetic"
    assert l2["verdict"] == "FAIL" and {"norm", "agree", "coefficient"} <= failed(l2)
    # each EP coordinate reports sqrt(dense^2 + its own experts^2)
    assert f"{l2['ratio']:.6f}" == "0.714563"
    assert "rank 1: 0.704687" in l2["checks"]["norm"]["detail"]
    linf = run.one(target="automodel", layout="ep_fsdp=1 ep=2 te experts unmarked", norm="Linf", dtype="fp32")
    assert linf["verdict"] == "FAIL" and f"{linf['ratio']:.6f}" == "0.997916"
    assert l2["finding"]["repro"] == REPRO


@pytest.mark.parametrize("nproc", [2])
def test_repro_te_experts_ep_norm(nproc):
    """The standalone reproduction of #3816 (no clipcheck): on 0.7.0 every rank reports the true norm;
    before it (0.6.0) the norm misses the other EP ranks' experts."""
    if AUTOMODEL.unavailable():
        pytest.skip(AUTOMODEL.unavailable())
    _, reported, true, ratio = run_repro(REPRO, nproc, nested_imports=False)  # it puts CPU stand-ins in place first
    if _version() >= "0.7.0":
        assert ratio == "1.000000", (reported, true)  # PR #3817 holds
    else:
        assert float(ratio) < 0.9, (reported, true)  # #3816: the other EP rank's experts are missing
