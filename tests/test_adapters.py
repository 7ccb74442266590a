"""Adapters for real frameworks, on real torchrun jobs. Where a framework is installed (CI installs
DeepSpeed, torchtitan and megatron-core) its clip is run and judged; where it is not, its cases must
be skips carrying the install hint, never failures."""

import pytest

from harness.report.compat import compat_rows, markdown
from harness.scenarios.xorl import FRAMEWORK as XORL
from harness.cases.frameworks import Framework
from harness_runs import expect_skips, run_clipcheck

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def adapters_world4(tmp_path_factory):
    return run_clipcheck(4, ["--scenario", "torchtitan_ep,megatron_moe_tp,fsdp2_meshes,xorl_ep_lora",
                           "--target", "torchtitan,megatron,torch-fsdp2,xorl,reference", "--ep-size", "2"],
                       tmp_path_factory.mktemp("adapters"))


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
