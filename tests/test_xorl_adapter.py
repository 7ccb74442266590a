"""xorl's own clip on a model xorl built and parallelized in its trainer's order (meta, global shapes, its
plan slicing to EP-local), with the gradients delivered through its own path (FSDP2's reduce-scatter,
``synchronize_ep_replicated_gradients``), on real torchrun jobs; and the standalone reproduction of the
seed finding. xorl is git-only (no recipe, not in CI): where it is not importable (its ``src/`` not on
``PYTHONPATH``) the cases are skips carrying the install hint and the repro tests skip with the reason."""

import ast
import re

import pytest

from harness.scenarios.xorl import FRAMEWORK as XORL
from harness_runs import ROOT, expect_skips, run_clipcheck
from repro_runs import stdout_lines

pytestmark = pytest.mark.distributed

REPRO = ROOT / "scenarios" / "xorl" / "repro_ep_lora_undercount.py"
needs_xorl = pytest.mark.skipif(XORL.unavailable() is not None, reason=f"xorl is not importable: {XORL.install}")


@pytest.fixture(scope="module")
def xorl_world4(tmp_path_factory):
    return run_clipcheck(4, ["--scenario", "xorl_ep_lora", "--target", "xorl", "--dtype", "fp32", "--clip-ratio", "0.5"],
                       tmp_path_factory.mktemp("xorl4"))


@pytest.fixture(scope="module")
def xorl_world2(tmp_path_factory):
    return run_clipcheck(2, ["--scenario", "xorl_ep_lora", "--target", "xorl", "--dtype", "bf16", "--clip-ratio", "0.5"],
                       tmp_path_factory.mktemp("xorl2"))


def test_layouts_xorl_never_builds_are_refused_with_the_reason(xorl_world4):
    layouts = {c["layout"] for c in xorl_world4.cases(target="xorl")}
    assert layouts == {
        "ep=2 ep_fsdp=2 plan=qwen3_moe hybrid_shared=False", "ep=2 ep_fsdp=2 plan=qwen3_moe hybrid_shared=True",
        "ep=2 ep_fsdp=2 plan=minimax_m3 hybrid_shared=False",
        "ep=4 ep_fsdp=1 plan=qwen3_moe hybrid_shared=False", "ep=4 ep_fsdp=1 plan=qwen3_moe hybrid_shared=True",
        "ep=4 ep_fsdp=1 plan=minimax_m3 hybrid_shared=False",
        "ep=4 ep_fsdp=1 plan=qwen3_moe hybrid_shared=False experts=4 (1 per ep rank)",
    }
    assert "4 x target xorl refuses some xorl_ep_lora layouts: xorl turns EP off at ep_size 1" in xorl_world4.stdout
    assert "2 x target xorl refuses some xorl_ep_lora layouts: under minimax_m3's plan" in xorl_world4.stdout


def test_minimax_plan_undercounts_through_xorls_own_path(xorl_world4, xorl_world2):
    """The seed: minimax_m3's plan lists no LoRA factor, each EP rank keeps a global-shape copy whose
    gradient is its own, and the clip averages them over EP: 1/sqrt(ep), in fp32 and bf16."""
    for run, expected in ((xorl_world4, {2: "0.707107", 4: "0.500000"}), (xorl_world2, {2: "0.707107"})):
        if XORL.unavailable():
            expect_skips(run, XORL, "xorl")
            continue
        assert run.summary["harness_errors"] == 0  # every delivered gradient bit-exact
        for ep, ratio in expected.items():
            (case,) = [c for c in run.cases(target="xorl", layout_has="plan=minimax_m3")
                       if c["layout"].startswith(f"ep={ep} ")]
            assert case["verdict"] == "FAIL" and case["checks"]["norm"]["passed"] is False
            assert abs(case["ratio"] - float(ratio)) < 2e-6, case["ratio"]
            assert any("declared Replicate on ep, measured distinct" in s for s in case["signature"])
            finding = case["finding"]
            assert finding["reach"] == "stock" and "minimax_m3" in finding["how"]
            assert finding["repro"] == "scenarios/xorl/repro_ep_lora_undercount.py"
            assert (ROOT / finding["repro"]).exists()


def test_every_other_layout_is_exact(xorl_world4, xorl_world2):
    """qwen3_moe (its plan lists every factor; hybrid shared factors summed over EP by
    synchronize_ep_replicated_gradients) and the one-local-expert layout, which xorl builds at global
    shape and slices (Shard), unlike the seed's construction at EP-local shape (0.500000 there)."""
    for run in (xorl_world4, xorl_world2):
        if XORL.unavailable():
            continue
        others = [c for c in run.cases(target="xorl") if "plan=minimax_m3" not in c["layout"]]
        assert others and all(c["verdict"] == "PASS" and f"{c['ratio']:.6f}" == "1.000000" for c in others)
    if not XORL.unavailable():
        one_local = xorl_world4.one(target="xorl", layout_has="(1 per ep rank)")
        assert one_local["framework"].startswith("xorl") and one_local["finding"] is None


def test_the_repro_imports_no_clipcheck():
    tree = ast.parse(REPRO.read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name.split(".")[0] == "harness" for name in imported), imported


@needs_xorl
@pytest.mark.parametrize("nproc, plan, ratio", [(2, "minimax_m3", "0.707107"), (4, "minimax_m3", "0.500000"),
                                                (2, "qwen3_moe", "1.000000")])
def test_repro_prints_the_seed_ratio(nproc, plan, ratio):
    last = stdout_lines(str(REPRO.relative_to(ROOT)), nproc, plan)[-1]
    match = re.fullmatch(r"reported=([\d.]+) true=([\d.]+) ratio=([\d.]+)", last)
    assert match, last
    assert match.group(3) == ratio
