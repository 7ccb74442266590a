"""huggingface accelerate's ``Accelerator.clip_grad_norm_`` on real multi-rank jobs (``clipcheck run``): FSDP2, HSDP and
FSDP2+TP prepared by accelerate, and TP models with plain and DTensor parameters. Where accelerate is
not installed, its cases must be skips carrying the install hint."""

import importlib.metadata
import re

import pytest

from harness.scenarios.accelerate import FRAMEWORK as ACCELERATE
from harness.scenarios.accelerate.adapter import TARGETS as ACCELERATE_TARGETS
from harness.scenarios.accelerate.adapter import transformers_major
from harness_runs import ROOT, expect_skips, failed, run_clipcheck
from repro_runs import stdout_lines

pytestmark = pytest.mark.distributed

TARGETS = ("accelerate", "accelerate-tp")


@pytest.fixture(scope="module")
def accelerate_world4(tmp_path_factory):
    return run_clipcheck(4, ["--scenario", "accelerate_fsdp2", "--dtype", "fp32", "--norm-type", "2,inf"],
                       tmp_path_factory.mktemp("accelerate4"))


@pytest.fixture(scope="module")
def accelerate_world2(tmp_path_factory):
    return run_clipcheck(2, ["--scenario", "accelerate_fsdp2", "--dtype", "fp32", "--norm-type", "2",
                           "--clip-ratio", "0.5"], tmp_path_factory.mktemp("accelerate2"))






def test_fsdp2_hsdp_and_fsdp2_tp_are_exact(accelerate_world4):
    run = accelerate_world4
    if ACCELERATE.unavailable():
        expect_skips(run, ACCELERATE, *TARGETS)
        return
    cases = [c for c in run.cases(target="accelerate") if "nan" not in c["layout"]]
    layouts = {"dp_shard=4 fsdp2", "dp_replicate=2 dp_shard=2 hsdp"}
    if transformers_major() == 4:
        layouts.add("dp_shard=2 tp=2 fsdp2+tp")
    else:  # accelerate's FSDP2+TP prepare needs a class transformers 5 removed: refused with that reason
        assert "FSDP2+TP: accelerate's prepare (1.15.0, 1.16.0) imports" in run.stdout
    assert {c["layout"] for c in cases} == layouts
    assert len(cases) == 4 * len(layouts)  # L2/inf x bound below/above the norm
    assert all(c["framework"] == "accelerate 1.15.0" for c in cases)
    assert all(c["verdict"] == "PASS" for c in cases), [(c["layout"], c["norm"], failed(c)) for c in cases
                                                        if c["verdict"] != "PASS"]
    assert all(f"{c['ratio']:.6f}" == "1.000000" for c in cases)
    # the same unique gradients under FSDP2, HSDP and FSDP2+TP: one coefficient
    groups = run.metamorphic(target="accelerate", invariance_key="accelerate-dense")
    assert groups and all(g["passed"] for g in groups)


def test_tp_mixed_plain_and_dtensor_no_longer_crashes(accelerate_world4):
    """accelerate PR #4219's layout (foreach over mixed plain/DTensor grads raised): 1.15.0 groups the
    gradients by mesh and is exact while the plain parameters are true replicas."""
    run = accelerate_world4
    if ACCELERATE.unavailable():
        expect_skips(run, ACCELERATE, *TARGETS)
        return
    for layout in ("tp=4 tp mixed plain/DTensor", "tp=4 tp all DTensor"):
        cases = run.cases(target="accelerate-tp", layout=layout)
        assert len(cases) == 4
        assert all(c["verdict"] == "PASS" and "raised" not in failed(c) for c in cases), layout


def test_plain_expert_shards_are_counted_rank_locally(accelerate_world4, accelerate_world2):
    """Experts kept as plain local tensors (transformers' ``grouped_gemm`` style, use_dtensor=False)
    fall into accelerate's plain group, whose norm is never reduced: each rank clips with its own,
    too small norm, and the replicated parameters diverge."""
    if ACCELERATE.unavailable():
        expect_skips(accelerate_world4, ACCELERATE, *TARGETS)
        expect_skips(accelerate_world2, ACCELERATE, *TARGETS)
        return
    one = dict(target="accelerate-tp", dtype="fp32", clip_ratio=0.5)
    l2 = accelerate_world4.one(layout="tp=4 tp experts plain", norm="L2", **one)
    assert l2["verdict"] == "FAIL"
    assert failed(l2) == {"norm", "agree", "coefficient", "replicas"}
    # sqrt(DTensor part, reduced + this rank's plain part), checked by hand for every rank
    assert [f"{r / l2['true_norm']:.6f}" for r in l2["reported"]] == ["0.562924", "0.556664", "0.548153", "0.566730"]
    assert "layers.0.input_layernorm.weight on tp" in l2["checks"]["replicas"]["detail"]
    inf = accelerate_world4.one(layout="tp=4 tp experts plain", norm="Linf", **one)
    assert inf["verdict"] == "FAIL" and {"agree", "replicas"} <= failed(inf)
    two = accelerate_world2.one(layout="tp=2 tp experts plain", norm="L2", **one)
    assert two["verdict"] == "FAIL" and f"{two['ratio']:.6f}" == "0.740771"
    assert [f"{r:.4f}" for r in two["reported"]] == ["21.5087", "21.2339"]
    # whose it is and who reaches it: transformers' unmarked shards (filed under transformers), stock with 4.x
    # for L2 (transformers' Trainer clips with L2 only), a direct call for inf; reproduced without clipcheck
    for case in (l2, inf, two):
        finding = case["finding"]
        assert finding["owner"] == "huggingface/transformers" and finding["upstream"] is None, finding
        if case["norm"] == "L2":
            assert finding["reach"] == "stock" and "transformers 4.x" in finding["how"], finding
            assert "not with transformers from 5.16" in finding["how"]
        else:
            assert finding["reach"] == "direct-call" and "L2 norm only" in finding["how"], finding
        assert finding["repro"] == "scenarios/accelerate/repro_tp_plain_experts.py"
        assert (ROOT / finding["repro"]).is_file()


def test_every_tp_shard_plain_is_clipped_rank_locally(accelerate_world4, accelerate_world2):
    """Every TP shard a plain local tensor (what transformers 5.3 to 5.14 leave): accelerate has one
    plain group and clips each rank by the norm of its own shards."""
    if ACCELERATE.unavailable():
        expect_skips(accelerate_world4, ACCELERATE, *TARGETS)
        return
    one = dict(target="accelerate-tp", dtype="fp32", clip_ratio=0.5, norm="L2")
    four = accelerate_world4.one(layout="tp=4 tp all plain", **one)
    assert four["verdict"] == "FAIL" and failed(four) == {"norm", "agree", "coefficient", "replicas"}
    assert four["ratio"] < 0.9 and len(set(four["reported"])) == 4
    two = accelerate_world2.one(layout="tp=2 tp all plain", **one)
    assert two["verdict"] == "FAIL" and f"{two['ratio']:.6f}" == "0.916868"
    for case in (four, two):
        finding = case["finding"]
        assert finding["reach"] == "stock" and "transformers 5.3 to 5.14" in finding["how"], finding
        assert finding["owner"] == "huggingface/transformers"
        assert finding["repro"] == "scenarios/accelerate/repro_tp_plain_experts.py"


def test_each_target_only_runs_its_call_path(accelerate_world4):
    run = accelerate_world4
    assert "target accelerate refuses some accelerate_fsdp2 layouts: a TP-only layout" in run.stdout
    assert "target accelerate-tp refuses some accelerate_fsdp2 layouts: an FSDP2 layout" in run.stdout
    assert not {c["layout"] for c in run.cases(target="accelerate-tp")} & {"dp_shard=4 fsdp2"}


def test_reference_passes_and_no_harness_errors(accelerate_world4, accelerate_world2):
    for run in (accelerate_world4, accelerate_world2):
        assert all(c["verdict"] == "PASS" for c in run.cases(target="reference"))
        assert run.summary["harness_errors"] == 0


def test_a_nan_on_one_rank(accelerate_world4):
    """L2: the NaN reaches every rank (the DTensor norm is a SUM). inf: the DTensor norm is a MAX
    all-reduce, and gloo's MAX drops a NaN that is not on the first rank (checked with a bare
    ``all_reduce(MAX)``: NaN on rank 0 -> nan, NaN on rank 3 -> 3.0), so every rank clips with a finite
    norm and the NaN stays in the gradient. In plain experts the NaN never leaves its rank."""
    run = accelerate_world4
    if ACCELERATE.unavailable():
        expect_skips(run, ACCELERATE, *TARGETS)
        return
    one = dict(dtype="fp32", clip_ratio=0.5)
    for target, layout in (("accelerate", "dp_shard=4 fsdp2 nan"), ("accelerate-tp", "tp=4 tp mixed plain/DTensor nan")):
        assert run.one(target=target, layout=layout, norm="L2", **one)["verdict"] == "PASS", layout
        inf = run.one(target=target, layout=layout, norm="Linf", **one)
        assert inf["verdict"] == "FAIL" and failed(inf) == {"nonfinite"}, (layout, failed(inf))
        assert inf["finding"]["owner"] == "pytorch/pytorch"  # torch's MAX drops the NaN, filed once under torch
        assert all(f"{r:.6f}" == "1.066019" for r in inf["reported"])
    for norm in ("L2", "Linf"):
        experts = run.one(target="accelerate-tp", layout="tp=4 tp experts plain nan", norm=norm, **one)
        assert {"agree", "nonfinite"} <= failed(experts), norm
        assert "3: reported a non-finite norm" in experts["checks"]["nonfinite"]["detail"]
        assert "0: reported a finite norm" in experts["checks"]["nonfinite"]["detail"]


def test_gradients_come_through_accelerate_backward():
    """Both targets hand the layout's gradients over through ``accelerator.backward`` on the prepared
    model (FSDP2's reduce-scatter acts between backward and clip), not by writing ``.grad``."""
    assert all(t.backward is not None for t in ACCELERATE_TARGETS)
    assert {t.name for t in ACCELERATE_TARGETS} == set(TARGETS)


REPORT = re.compile(r"reported=(\S+) true=(\S+) ratio=(\S+)$")


def transformers_minor() -> tuple[int, int]:
    major, minor = importlib.metadata.version("transformers").split(".")[:2]
    return int(major), int(minor)


@pytest.mark.skipif(bool(ACCELERATE.unavailable()), reason=f"accelerate is not installed: {ACCELERATE.install}")
def test_repro_tp_plain_experts():
    """The standalone reproduction: a dots.llm1 loaded with ``tp_plan="auto"``, a real backward,
    accelerate's clip, the true norm gathered on rank 0. Where transformers leaves TP shards plain
    (4.x: its local_* expert styles; 5.3 to 5.14: every shard; the ratios per release checked:
    docs/frameworks.md, "Findings", accelerate) each rank reports its own, too small norm; with
    transformers from 5.16 (the pinned 5.18.0) every TP shard is a DTensor, no plain shard arises and
    the clip is exact."""
    lines = stdout_lines("scenarios/accelerate/repro_tp_plain_experts.py", 2)
    match = REPORT.match(lines[-1])
    assert match, lines
    reported, true, ratio = (float(x) for x in match.groups())
    by_rank = [float(x) for x in lines[-2].removeprefix("reported by rank: ").split()]
    version = transformers_minor()
    if version[0] == 4 or (5, 3) <= version < (5, 16):
        assert "plain TP-sharded gradients" in lines[-3]
        assert ratio < 0.99 and by_rank[0] != by_rank[1], lines
    else:
        assert "no plain shards, the layout does not arise" in lines[-3]
        assert abs(ratio - 1) < 1e-5 and by_rank[0] == by_rank[1], lines
    assert reported == by_rank[0] and true > 0
