"""Counting established per group: a group whose miscount hides inside the band of its case is run alone,
where it holds the whole norm, so that its miscount fails at every dtype; a correct clip passes with every
group established, and the records say how each was."""

import pytest

from broken_targets import NAME_GROUPS
from harness.api import check
from harness.cases.scenario import ScenarioOptions
from harness.targets.registry import builtin_scenarios
from harness_runs import failed, run_harness
from harness.judge.establishment import MARGIN, counting_line, unseen, weakest_miscounts
from harness.judge.records import StatsTable

WORLD = 4
HYBRID = "=ep=2 ep_fsdp=2 plan=qwen3_moe hybrid_shared=True"
SHARED_LORA = ("model.layers.*.mlp.experts.gate_proj_lora_A", "model.layers.*.mlp.experts.up_proj_lora_A",
               "model.layers.*.mlp.experts.down_proj_lora_B")


def _table(rows: list[list[float]]) -> StatsTable:
    names = ["big", "small"]
    return StatsTable(names, [4, 4], [4, 4], rows)


def test_the_weakest_miscount_of_a_small_group_moves_the_norm_little():
    """Two ranks each holding their own half of 'big' and of 'small' (no copies): at p = 2 a group's weakest
    miscount is the group counted half; the small one is unseen in a band of 1e-3 and seen in one of 1e-5.
    For the inf norm only the group holding the max can move it."""
    stats = _table([[50.0, 0.01], [50.0, 0.01]])
    copies = [[[(0, 0)], [(0, 1)]], [[(1, 0)], [(1, 1)]]]
    truth = 100.02 ** 0.5
    moved = weakest_miscounts(stats, copies, 2.0, truth, {"big": ["big"], "small": ["small"]})
    assert moved["small"] == pytest.approx(0.02 / 100.02 / 4, rel=1e-3)
    assert moved["big"] > 0.1
    assert unseen(moved, 1e-3) == ["small"] and unseen(moved, 1e-5) == []
    assert unseen({"g": MARGIN * 1e-3}, 1e-3) == ["g"]  # exactly at the margin: the band may hide it
    inf = weakest_miscounts(_table([[3.0, 1.0], [2.0, 0.5]]), copies, float("inf"), 3.0,
                            {"big": ["big"], "small": ["small"]})
    assert inf == {"big": pytest.approx(1 - 1.0 / 3.0), "small": 0.0}


def test_the_run_says_how_each_group_was_established():
    line = counting_line([{"a": "by the case (its weakest miscount moves the norm 0.3)", "b": "in its own run"},
                          {"a": "in its own run on case 0", "b": "not established: its own run was not judged"}])
    assert line == ("counting established per group: 1 group(s) by their case, 2 in their own runs, "
                    "not established 1 (b)")
    assert counting_line([{}, {}]) is None


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["fp64", "fp32", "bf16", "fp16"])
def test_a_small_group_counted_twice_fails_at_every_dtype(world4, dtype):
    """xorl's hybrid_shared LoRA factors (ep=Replicate) summed over the EP group: under 1% of the norm, so in
    bf16 the whole case's norm is within its band and their own runs fail it, in the blame's words; where the
    band is narrower the case shows it itself (the norm check, blamed)."""
    report = check("tests/broken_targets.py:shared_lora_twice", scenarios=["xorl_ep_lora"], worlds=[WORLD],
                   pools={WORLD: world4}, dtypes=[dtype], norm_types=[2], clip_ratios=[0.5], variant=HYBRID)
    (case,) = report.cases
    assert case["verdict"] == "FAIL", report.describe()
    failed = {name: c["detail"] for name, c in case["checks"].items() if not c["passed"]}
    if "norm" in failed:  # the case shows it itself: the blame weighs the groups
        assert dtype != "bf16", failed
        blamed = {line["group"]: line["line"] for line in case["blame"]}
        assert all(blamed[group].endswith("counted 2 times") for group in SHARED_LORA), blamed
    else:  # inside the band: their own runs show it
        assert abs(case["ratio"] - 1) < 0.01, case["ratio"]
        assert all(f"{group}: counted 2 times" in failed["counting"] for group in SHARED_LORA), failed
        assert all(case["counting"][group].startswith("miscounted") for group in SHARED_LORA), case["counting"]


@pytest.mark.distributed
def test_a_correct_clip_passes_with_every_group_established(world4):
    """The reference at every dtype on the same layout, at the inf norm too (where a group that does not hold
    the max is run alone): every group established, by its case or in its own run, none miscounted."""
    report = check("reference", scenarios=["xorl_ep_lora"], worlds=[WORLD], pools={WORLD: world4},
                   dtypes=["fp64", "fp32", "bf16", "fp16"], norm_types=[2, "inf"], clip_ratios=[0.5], variant=HYBRID)
    assert report.passed, report.describe()
    for case in report.cases:
        hows = case["counting"].values()
        assert hows and all(how.startswith(("by the case", "in its own run")) for how in hows), case["counting"]
    assert any(how.startswith("in its own run") for case in report.cases for how in case["counting"].values())
    assert "counting established per group" in report.text


def _holds_gradient(scenario: str, label: str, picked) -> bool:
    """Whether a picked parameter of the layout ``label`` of ``scenario`` (world 2) gets a gradient at all (a
    frozen router or one whose gradient is zero or None everywhere counts the same once or twice)."""
    variant = next(v for v in builtin_scenarios()[scenario].variants(2, ScenarioOptions()) if v.label == label)
    none_everywhere = {name for name, ranks in variant.injection.none_on if len(ranks) == 2}
    return any(picked(s.name) and s.name not in variant.injection.zero and s.name not in none_everywhere
               for s in variant.layout.trainable)


@pytest.mark.distributed
def test_each_small_group_counted_twice_fails_in_bf16(tmp_path):
    """Seven clips, each the reference but for one group picked by name counted twice (biases, norms, the
    router, embeddings, the output head, LoRA factors, shared experts), on every layout at world 2 in bf16 of
    five scenarios that hold all but the last: each fails wherever its group holds a gradient (the whole
    case's norm, or the group's own run), and passes only where it holds none."""
    targets = [f"tests/broken_targets.py:double_counts_{group}" for group in NAME_GROUPS]
    scenarios = "dense_dp,pipeline_stages,torchtune_tp,torchtitan_ep,xorl_ep_lora"
    run = run_harness(2, ["--scenario", scenarios, "--target", ",".join(targets), "--dtype", "bf16", "--norm-type", "2",
                          "--clip-ratio", "0.5"], tmp_path)
    judged = [c for c in run.cases() if c["true_norm"] not in ("nan", "inf")]
    assert judged and run.summary["harness_errors"] == 0
    caught_by_counting = 0
    for case in judged:
        group = case["target"].rsplit("double_counts_", 1)[1]
        counted = _holds_gradient(case["scenario"], case["layout"], NAME_GROUPS[group])
        assert (case["verdict"] == "FAIL") == counted, (group, case["scenario"], case["layout"], case["checks"])
        caught_by_counting += "counting" in failed(case)
    assert caught_by_counting  # some only through a group's own run: inside the band of the whole case


@pytest.mark.distributed
def test_with_the_re_runs_off_the_groups_a_case_cannot_see_are_said_not_established(world4):
    """``blame="off"`` runs no group alone: the double count inside bf16's band then passes, and its record says
    which groups were not established instead of claiming them."""
    report = check("tests/broken_targets.py:shared_lora_twice", scenarios=["xorl_ep_lora"], worlds=[WORLD],
                   pools={WORLD: world4}, dtypes=["bf16"], norm_types=[2], clip_ratios=[0.5], variant=HYBRID,
                   blame="off")
    (case,) = report.cases
    assert case["verdict"] == "PASS", report.describe()
    assert all(case["counting"][group].startswith("not established") for group in SHARED_LORA), case["counting"]
    assert "not established" in report.text
