"""``--plans honest|all``: most real clips trust the declared placements by design, so a lying plan is
the parallelization's bug, not the clip's. ``honest`` asks whether a plan-trusting clip's arithmetic is
right (every declared plan replaced by the truth); under ``all`` a failure that only the lie causes
says so (the same case passes with the true placements declared)."""

from __future__ import annotations

import pytest

import harness
from harness.cases.matrix import spec_from_mapping
from harness.plan.planner import plan_cases
from harness.cases.variant import HONEST_PLAN, plan_lies
from harness.errors import ClipcheckInputError
from harness.fuzz import fuzz
from harness.targets.mutants.catalogue import FUZZ_BUDGET

pytestmark = pytest.mark.distributed

XORL = dict(scenarios=["xorl_ep_lora"], worlds=[2], dtypes=["fp32"], norm_types=[2], clip_ratios=[0.5])


def test_the_honest_profile_plans_every_layout_with_the_truth_declared():
    spec = spec_from_mapping({"scenarios": ["xorl_ep_lora"], "targets": ["xorl-style"], "dtypes": ["fp32"],
                              "plans": "honest"})
    variants = {c.variant.label: c.variant for c in plan_cases(spec, 2, "gloo").cases}
    assert any(label.endswith(HONEST_PLAN) for label in variants)
    assert not any(plan_lies(v) for v in variants.values())
    with pytest.raises(ClipcheckInputError, match="plans must be one of all, honest"):
        spec_from_mapping({"plans": "sometimes"})


def test_a_plan_trusting_clip_passes_on_honest_plans_and_its_lie_only_failures_say_so(rank_pool):
    honest = harness.check("xorl-style", plans="honest", pools={2: rank_pool(2)}, **XORL)
    assert honest.passed and honest.cases, honest.describe()
    every = harness.check("xorl-style", pools={2: rank_pool(2)}, **XORL)
    failures = every.failures
    assert failures and all(any(s.startswith("lying plan: exact on the honest plan") for s in c["signature"])
                            for c in failures), [c["signature"] for c in failures]
    # a clip wrong in its own arithmetic gets no such line: it fails on the honest plan too
    wrong = harness.check("mutant-local-root-mean", pools={2: rank_pool(2)}, **XORL)
    assert wrong.failures and not any(s.startswith("lying plan") for c in wrong.failures for s in c["signature"])


def test_the_fuzzer_on_honest_plans_passes_a_plan_trusting_clip_the_drawn_lies_fail(rank_pool):
    trusting = "tests/plan_trusting.py:clip"
    honest = fuzz(trusting, rank_pool(2), 40, derandomize=True, plans="honest", blame=False)
    assert honest.passed, honest.result and honest.result.checks
    # the fuzzer's budget: a lie that changes a count at world 2 is about one draw in tens (found at 90)
    assert not fuzz(trusting, rank_pool(2), FUZZ_BUDGET, derandomize=True, blame=False).passed
