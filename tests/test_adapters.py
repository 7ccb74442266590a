"""Adapters for real frameworks, on real torchrun jobs. Where a framework is installed (CI installs
DeepSpeed, torchtitan and megatron-core) its clip is run and judged; where it is not, its cases must
be skips carrying the install hint, never failures."""

import pytest

from harness.report.compat import compat_rows, markdown
from harness.scenarios.torchtitan import FRAMEWORK as TORCHTITAN
from harness.scenarios.xorl import FRAMEWORK as XORL
from harness.targets.frameworks import Framework
from harness_runs import expect_skips, failed, run_harness

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def adapters_world4(tmp_path_factory):
    return run_harness(4, ["--scenario", "torchtitan_ep,megatron_moe_tp,fsdp2_meshes,xorl_ep_lora",
                           "--target", "torchtitan,megatron,torch-fsdp2,xorl,reference", "--ep-size", "2"],
                       tmp_path_factory.mktemp("adapters"))






def test_torchtitan_trusts_placements(adapters_world4):
    run = adapters_world4
    if TORCHTITAN.unavailable():
        expect_skips(run, TORCHTITAN, "torchtitan")
        return
    honest = run.cases(target="torchtitan", layout="efsdp=2 ep=2 honest")
    assert len(honest) == 8 and all(c["verdict"] == "PASS" for c in honest)  # L2/inf x fp32/bf16 x 2 bounds
    one = dict(norm="L2", dtype="fp32", clip_ratio=0.5)
    lies = run.one(target="torchtitan", layout="efsdp=2 ep=2 placement lies", **one)
    assert lies["verdict"] == "FAIL"
    assert lies["declared_mismatches"] == ["declared Replicate on ep, measured distinct: shared_lora_A"]
    assert any("declared placements" in s for s in lies["signature"])
    no_ep = run.one(target="torchtitan", layout="efsdp=2 ep=2 experts without ep dim", **one)
    assert "raised" in failed(no_ep) and "must have the same mesh" in no_ep["checks"]["raised"]["detail"]


@pytest.fixture(scope="module")
def stages_world4(tmp_path_factory):
    return run_harness(4, ["--scenario", "pipeline_stages", "--target", "torchtitan-pp,reference", "--dtype", "fp32"],
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


def test_fsdp2_one_mesh_exact_mixed_meshes_raise_clearly(adapters_world4):
    run = adapters_world4
    for layout in ("dp=4 fsdp", "dp_replicate=2 dp_shard=2 hsdp"):
        assert all(c["verdict"] == "PASS" for c in run.cases(target="torch-fsdp2", layout=layout))
    for case in run.cases(target="torch-fsdp2", layout="ep=2 ep_fsdp=2 mixed meshes"):
        assert case["verdict"] == "FAIL" and failed(case) == {"raised"}
        detail = case["checks"]["raised"]["detail"]
        assert detail.startswith("ranks [0, 1, 2, 3]: RuntimeError: All operands in aten.stack.default must have "
                                 "the same mesh")
    assert run.summary["harness_errors"] == 0


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
