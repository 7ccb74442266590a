"""megatron-core's clip on real multi-rank jobs (``clipcheck run``) (world 4), on parameters built and marked by megatron-core's
own layers and functions. Where megatron-core is not installed, its cases are skips carrying the
install hint."""

from __future__ import annotations

import pytest

from harness.scenarios.megatron import FRAMEWORK as MEGATRON
from harness.scenarios.megatron.framework import RELEASES
from harness_runs import expect_skips, run_clipcheck

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def megatron_world4(tmp_path_factory):
    return run_clipcheck(4, ["--scenario", "megatron_moe_tp", "--target", "megatron,reference", "--ep-size", "1,2"],
                       tmp_path_factory.mktemp("megatron"))


def _has_pr_5916() -> bool:
    try:
        from megatron.core.extensions.transformer_engine import _set_expert_parameter_attributes  # noqa: F401
    except ImportError:
        return False
    return True


def test_megatron_marks_come_from_megatron(megatron_world4):
    run = megatron_world4
    if MEGATRON.unavailable():
        expect_skips(run, MEGATRON, "megatron")
        return
    cases = run.cases(target="megatron")
    assert {c["framework"] for c in cases} == {f"megatron-core {MEGATRON.version()}"}
    sequential = [c for c in cases if "experts TP-linear (SequentialMLP)" in c["layout"]]
    grouped = [c for c in cases if "experts grouped GEMM (TE)" in c["layout"]]
    assert len(sequential) == 2 * 2 * 5 and len(grouped) == 2 * 2 * 3  # L2 x fp32/bf16 x 2 bounds per layout
    assert all(c["verdict"] == "PASS" for c in sequential), [c["layout"] for c in sequential if c["verdict"] != "PASS"]
    if _has_pr_5916():  # the grouped-GEMM experts marked by megatron's _set_expert_parameter_attributes
        assert all(c["verdict"] == "PASS" for c in grouped)
    else:  # 0.16.1 marks them inside TEGroupedLinear, Transformer Engine only: not built here, never judged
        assert all(c["verdict"] == "SKIP" and "needs Transformer Engine" in str(c["errors"] or c["skip_reason"])
                   for c in grouped), [(c["verdict"], c["errors"]) for c in grouped]
    assert run.summary["harness_errors"] == 0
    assert all(c["verdict"] == "PASS" for c in run.cases(target="reference"))


def test_releases_are_listed_oldest_first():
    versions = [tuple(int(x) for x in v.split(".")) for v in RELEASES]
    assert versions == sorted(versions) and RELEASES[0] == "0.16.1" and RELEASES[-1] == "0.19.2"
    assert f"megatron-core=={RELEASES[0]}" in MEGATRON.recipe[0]
