"""Adapters for real frameworks, on real torchrun jobs. Where a framework is installed (CI installs
DeepSpeed, torchtitan and megatron-core) its clip is run and judged; where it is not, its cases must
be skips carrying the install hint, never failures."""

import pytest

from harness.report.compat import compat_rows, markdown
from harness.scenarios.deepspeed import FRAMEWORK as DEEPSPEED
from harness.scenarios.megatron import FRAMEWORK as MEGATRON
from harness.scenarios.xorl import FRAMEWORK as XORL
from harness.targets.frameworks import Framework
from harness_runs import expect_skips, failed, run_harness

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def adapters_world4(tmp_path_factory):
    return run_harness(4, ["--scenario", "torchtitan_ep,megatron_moe_tp,fsdp2_meshes,xorl_ep_lora",
                           "--target", "torchtitan,megatron,torch-fsdp2,xorl,reference", "--ep-size", "2"],
                       tmp_path_factory.mktemp("adapters"))






def test_deepspeed_fp32_clip_averages_local_norms(deepspeed_world2):
    run = deepspeed_world2
    if DEEPSPEED.unavailable():
        expect_skips(run, DEEPSPEED, "deepspeed")
        return
    for target in ("deepspeed", "deepspeed-engine"):
        for case in run.cases(target=target):
            assert case["framework"].startswith("deepspeed ")
            if "replicated" in case["layout"] or "nan" in case["layout"]:
                assert case["verdict"] == "PASS", case["layout"]
            elif "frozen-dense" in case["layout"]:
                # a finding: DeepSpeed's clip indexes into an empty list on the rank that holds no gradient
                assert failed(case) == {"raised"}, case["layout"]
                assert "rank 1: " in case["checks"]["raised"]["detail"]
            else:
                assert case["verdict"] == "FAIL", case["layout"]
                assert any("mean of the rank-local norms" in s for s in case["signature"])
    gap = run.metamorphic(target="deepspeed", norm="L2", dtype="fp32", invariance_key="autoep", bound="x0.5")[0]
    assert {c["dtype"] for c in run.cases(target="deepspeed-engine")} == {"fp32"}
    assert not gap["passed"] and gap["gap"] > 0
    assert all(c["verdict"] == "PASS" for c in run.cases(target="reference"))


def test_deepspeed_engine_is_l2_only(deepspeed_world2):
    assert {c["norm_type"] for c in deepspeed_world2.cases(target="deepspeed-engine")} == {2.0}
    assert "target deepspeed-engine supports norm types L2 only" in deepspeed_world2.stdout


def test_megatron_tp_duplicate_filter(adapters_world4):
    run = adapters_world4
    if MEGATRON.unavailable():
        expect_skips(run, MEGATRON, "megatron")
        return
    for case in run.cases(target="megatron"):
        assert case["framework"] == "megatron-core 0.16.1"
        expected = "FAIL" if "unmarked" in case["layout"] else "PASS"
        assert case["verdict"] == expected, case["layout"]
    unmarked = run.one(target="megatron", layout="dp=1 ep=2 tp=2 experts unmarked (grouped GEMM)", norm="L2",
                       dtype="fp32", clip_ratio=0.5)
    assert unmarked["ratio"] < 0.95 and failed(unmarked) == {"norm", "coefficient"}


def test_xorl_runs_where_importable_and_skips_with_the_hint_elsewhere(adapters_world4):
    run = adapters_world4
    if XORL.unavailable():
        expect_skips(run, XORL, "xorl")
        assert "the PyPI 'xorl' is another project" in run.cases(target="xorl")[0]["skip_reason"]
        return
    minimax = run.one(target="xorl", layout="ep=2 ep_fsdp=2 plan=minimax_m3 hybrid_shared=False")
    assert f"{minimax['ratio']:.6f}" == "0.707107"


def test_every_reference_case_passes(adapters_world4):
    assert all(c["verdict"] == "PASS" for c in adapters_world4.cases(target="reference"))


def test_compat_table_lists_real_frameworks_only(deepspeed_world2, adapters_world4):
    rows = compat_rows(deepspeed_world2.records + adapters_world4.records)
    targets = {r[1] for r in rows}
    assert "reference" not in targets and "torch-fsdp2" in targets
    table = markdown(rows)
    assert table.splitlines()[0].startswith("| framework | target | scenario |")


def test_probing_for_a_framework_imports_nothing(tmp_path, monkeypatch):
    pkg = tmp_path / "fakefw" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "fakefw" / "__init__.py").write_text("raise RuntimeError('imported!')\n")
    (pkg / "__init__.py").write_text("")
    (pkg / "clip.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert Framework("fake", "fakefw.sub.clip", None, "hint").unavailable() is None
    assert "hint" in Framework("fake", "fakefw.sub.other", None, "hint").unavailable()
    assert "hint" in Framework("fake", "nothere.x", None, "hint").unavailable()
