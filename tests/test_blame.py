"""Per-parameter blame: the weight a clip gives each parameter group, from one-group re-runs.

The weights are shown right on the seeds (xorl: the forgotten LoRA factors counted 1/ep; a correct
clip: nothing blamed), on every catalogue mutant that is linear in the groups' p-th powers (a group
with its factor, and the weights add up), and honestly where they cannot be attributed (DeepSpeed's
mean of local roots is not linear: a note says so)."""

import dataclasses

import pytest

from harness.api import check
from harness.judge.blame import describe_weight, group_name, group_only, parameter_groups
from harness.targets.mutants.catalogue import CATALOGUE
from harness.targets.registry import builtin_scenarios
from harness.cases.scenario import ScenarioOptions

WORLD = 4
ONE_CASE_EACH = dict(dtypes=["fp32"], norm_types=["2"], clip_ratios=[0.5])

# linear in each group's norm^p: blame names a group with a factor and the weights add up
LINEAR = {
    "mutant-fallback-replicated": "of its true weight (declared Replicate on ep, measured distinct)",
    "mutant-tp-replicas-summed": "counted 2 times",
    "mutant-stage-local-norm": "counted 1/2 of its true weight",
    "mutant-tied-counted-twice": "counted 2 times",
    "mutant-hsdp-replicas-summed": "counted 2 times",
    "mutant-cp-replicas-summed": "counted 2 times",
    "mutant-experts-dropped": "not counted at all",
    "mutant-empty-rank-zero": "not counted at all",
    "mutant-missing-ep-reduction": "of its true weight",
    "mutant-tp-filter-drops-shards": "of its true weight",
    "mutant-reports-local-norm": "of its true weight",
    "mutant-weights-misaligned": "moe.experts.*.weight (ranks",  # experts owned by different ranks: one group each
}
# not linear in them: blamed, with the note that the weights hold for each group alone
NOT_LINEAR = ("mutant-local-root-mean", "mutant-norms-added-linearly", "mutant-pp-max-reduce")


def test_weights_read_as_multiplicities():
    tol = 4e-5
    assert describe_weight(1.0, tol) == "counted once (its true weight)"
    assert describe_weight(0.25, tol) == "counted 1/4 of its true weight"
    assert describe_weight(2.0 + 1e-6, tol) == "counted 2 times"
    assert describe_weight(0.0, tol) == "not counted at all"
    assert describe_weight(0.3, tol) == "counted 0.3 of its true weight"
    assert describe_weight(1.5, tol) == "counted 1.5x its true weight"


def test_groups_fold_indices_and_the_sub_case_zeroes_the_rest():
    assert group_name("model.layers.0.mlp.experts.gate_proj_lora_A") == "model.layers.*.mlp.experts.gate_proj_lora_A"
    assert group_name("moe.experts.12.weight") == "moe.experts.*.weight"
    assert group_name("0.weight") == "*.weight" and group_name("w2") == "w2"
    variant = builtin_scenarios()["deepspeed_autoep"].variants(WORLD, ScenarioOptions())[0]
    groups = parameter_groups([s.name for s in variant.layout.trainable])
    assert list(groups) == ["dense.weight", "moe.gate.weight", "moe.experts.*.weight"]
    from harness.cases.variant import CaseSpec

    case = CaseSpec(0, "deepspeed_autoep", variant, "reference", 2.0, 1.0)
    sub = group_only(case, groups["moe.experts.*.weight"])
    assert sub.injection.zero == {"dense.weight", "moe.gate.weight"}
    assert dataclasses.replace(sub.injection, zero=case.injection.zero) == case.injection


def _blamed(report):
    return [c for c in report.cases if c["blame"]]


def test_the_xorl_seed_is_blamed_on_the_forgotten_lora_factors(world4):
    report = check("xorl-style", scenarios=["xorl_ep_lora"], worlds=[WORLD], pools={WORLD: world4}, blame=True,
                   variant="experts=4", **ONE_CASE_EACH)
    (case,) = [c for c in _blamed(report) if c["layout"].startswith("ep=4")]
    assert len(case["blame"]) == 6 and not case["blame_note"]
    for group in case["blame"]:
        assert group["weight"] == pytest.approx(1 / 4)
        assert group["line"].endswith("counted 1/4 of its true weight (declared Replicate on ep, measured distinct)")
    assert "blame: model.layers.*.mlp.experts.gate_proj_lora_A: counted 1/4" in report.text


def test_a_correct_clip_and_a_right_norm_are_not_blamed(world4):
    for target in ("reference", "mutant-generator-exhausted"):  # the second: norm right, nothing clipped
        report = check(target, scenarios=["dense_dp"], worlds=[WORLD], pools={WORLD: world4}, blame=True,
                       **ONE_CASE_EACH)
        assert report.cases and not _blamed(report), target


@pytest.mark.parametrize("mutant", sorted(LINEAR) + list(NOT_LINEAR))
def test_catalogue_mutants_are_blamed_on_their_guilty_group(world4, mutant):
    (mechanism,) = [m for m in CATALOGUE if m.mutant == mutant]
    report = check(mutant, scenarios=[mechanism.caught_by], worlds=[WORLD], pools={WORLD: world4}, blame=True,
                   **ONE_CASE_EACH)
    blamed = _blamed(report)
    assert blamed, f"{mutant}: no case blamed"
    if mutant in LINEAR:
        additive = [c for c in blamed if not c["blame_note"]]
        lines = [b["line"] for c in additive for b in c["blame"] if b["weight"] is not None]
        assert any(LINEAR[mutant] in line and "once" not in line for line in lines), lines
    else:
        assert any("not additive over the groups" in c["blame_note"] for c in blamed), blamed[0]["blame_note"]


def test_a_failing_norm_is_blamed_by_default_once_per_layout_and_the_other_bound_reuses_it(world4):
    report = check("mutant-local-root-mean", scenarios=["deepspeed_autoep"], worlds=[WORLD], pools={WORLD: world4},
                   dtypes=["fp32"], norm_types=["2"], clip_ratios=[0.5, 2.0], variant="owner-sharded")
    first, second = [c for c in report.cases if c["layout"] == "edp=2 ep=2 owner-sharded"]
    assert first["blame"] and second["blame"] == first["blame"]
    assert f"weighed on case {first['index']} (bound x0.5)" in second["blame_note"]
    # the table prints the blame's one-line summary under every failing norm
    assert all(c["blame"] for c in report.failures if not c["checks"]["norm"]["passed"])
    assert report.text.count("      blame: moe.experts.*.weight (ranks ") == len(report.failures)
    off = check("mutant-local-root-mean", scenarios=["deepspeed_autoep"], worlds=[WORLD], pools={WORLD: world4},
                blame="off", variant="owner-sharded", **ONE_CASE_EACH)
    assert not _blamed(off)


def test_a_clip_that_drops_later_stages_is_blamed_on_them_and_not_signed_a_max(world4):
    report = check("tests/broken_targets.py:drops_later_stages", scenarios=["pipeline_stages"], worlds=[WORLD],
                   pools={WORLD: world4}, variant="pp=2 dp=2 untied", **ONE_CASE_EACH)
    (case,) = report.failures
    assert not any("MAX" in line for line in case["signature"]), case["signature"]
    lines = [b["line"] for b in case["blame"]]
    assert any(line.endswith("(ranks 2, 3): not counted at all") for line in lines), lines
    assert any(line.endswith("(ranks 0, 1): counted once (its true weight)") for line in lines), lines
