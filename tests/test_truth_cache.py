"""Ground truth is measured once per layout variant, and reuse is only ever of bit-identical gradients."""

import math

import torch

from harness.cases.matrix import MatrixSpec
from harness.plan.planner import plan_cases
from harness.run.case.truth_cache import TruthCache, same_bits


def _cases():
    plan = plan_cases(MatrixSpec(scenarios=("dense_dp",), targets=("reference", "torch"), dtypes=("fp32",)), 2, "gloo")
    return plan.cases


def test_one_measurement_per_variant_and_norm_type_and_stale_gradients_are_flagged():
    cases = _cases()
    calls = {"stats": 0, "replication": 0, "for replication": 0}

    def stats(for_replication):
        calls["stats"] += 1
        calls["for replication"] += for_replication
        return "stats"

    def replication(_):
        calls["replication"] += 1
        return "replication"

    cache = TruthCache()
    grads = {"w": torch.tensor([1.0, math.nan]), "b": None}
    variants = {c.variant.label for c in cases}
    norms = {c.norm_type for c in cases}
    for case in cases:
        _, _, stale = cache.measure(case, {"w": grads["w"].clone(), "b": None}, stats, replication)
        assert not stale  # NaN payloads compare by bits, so a NaN gradient is not "different"
    assert calls["replication"] == len(variants) and calls["stats"] == len(variants) * len(norms)
    assert calls["for replication"] == len(variants)  # the digests are taken once per variant
    assert len(cases) > calls["stats"]  # two targets x two bounds share each measurement
    other_nan = grads["w"].clone()
    other_nan.view(torch.int32)[1] ^= -2**31  # the NaN's sign bit: what a framework's reduction may deliver
    assert not same_bits({"w": other_nan}, {"w": grads["w"]})
    _, _, stale = cache.measure(cases[-1], {"w": other_nan, "b": None}, stats, replication)
    assert not stale  # the same gradient: NaNs compare as NaNs
    _, _, stale = cache.measure(cases[-1], {"w": torch.tensor([1.0, 2.0]), "b": None}, stats, replication)
    assert stale


def test_same_bits():
    assert same_bits({"a": torch.tensor([0.0])}, {"a": torch.tensor([0.0])})
    assert not same_bits({"a": torch.tensor([0.0])}, {"a": torch.tensor([-0.0])})
    assert not same_bits({"a": None}, {"a": torch.tensor([0.0])})
    assert not same_bits({"a": torch.tensor([1.0])}, {"a": torch.tensor([1.0], dtype=torch.float64)})
