"""Judging a case on rank 0: the oracle arithmetic, every check on fabricated per-rank records (each
shown failing on the record a broken clip would produce, and passing on a correct one), and the
signatures that explain a wrong ratio."""

import math

import pytest
import torch

from harness.cases.variant import CaseSpec, Variant, declared_from_layout
from harness.judge.checks import CHECKS, POLICY_WORDS, Judgement, evaluate
from harness.run.case.effects import POLICIES, FromSnapshot, changed_params, rank_effects
from harness.clipmath import clip_coefficient, pow_sum
from harness.cases.injection import Injection, local_grad
from harness.cases.layout import Layout, MeshSpec, Replicate, Shard, param
from harness.judge.records import Evidence, Replication, StatsTable
from harness.judge.truth import declared_norm, measured_norm
from harness.cases.constructive import constructive_norm
from harness.judge.signatures import explain, replica_factor


def simulated_stats(layout, injection, norm_type):
    """What gather_stats would produce on every rank, computed in-process."""
    names = [s.name for s in layout.trainable]
    numel, itemsize, powsum = [], [], []
    for r in range(layout.mesh.world_size):
        grads = [local_grad(layout, injection, s, r) for s in layout.trainable]
        numel.append([-1 if g is None else g.numel() for g in grads])
        itemsize.append([0 if g is None else g.element_size() for g in grads])
        powsum.append([0.0 if g is None else pow_sum(g, norm_type) for g in grads])
    return StatsTable(names, numel, itemsize, powsum)


def true_replication(layout):
    return Replication({
        dim: {s.name: isinstance(s.placement(dim), Shard) for s in layout.trainable} for dim in layout.mesh.names
    })


def ep_layout():
    mesh = MeshSpec.of(ep=4)
    return Layout(mesh, (param("experts.w", (8, 6), ep=Shard(0)), param("dense.w", (6,))))


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_measured_truth_equals_constructive_truth(norm_type):
    layout = ep_layout()
    injection = Injection(seed=5)
    stats = simulated_stats(layout, injection, norm_type)
    measured = measured_norm(stats, true_replication(layout), layout.mesh, norm_type)
    assert measured == pytest.approx(constructive_norm(layout, injection, norm_type), rel=1e-12)


def test_a_wrong_replication_reading_breaks_the_cross_check():
    layout = ep_layout()
    injection = Injection(seed=5)
    stats = simulated_stats(layout, injection, 2.0)
    wrong = Replication({"ep": {"experts.w": False, "dense.w": False}})  # experts read as replicated
    assert measured_norm(stats, wrong, layout.mesh, 2.0) != pytest.approx(constructive_norm(layout, injection, 2.0))


def test_declared_norm_of_a_fallback_replicate_is_one_over_sqrt_ep():
    layout = Layout(MeshSpec.of(ep=4), (param("experts.w", (8, 6), ep=Shard(0)),))
    stats = simulated_stats(layout, Injection(), 2.0)
    truth = constructive_norm(layout, Injection(), 2.0)
    assert declared_norm(stats, layout.mesh, {"experts.w": {"ep": Replicate()}}, 2.0) / truth == pytest.approx(0.5)


# -- signatures ---------------------------------------------------------------------------------------
def evidence(mesh, truth=10.0, norm_type=2.0, local=(5.0, 5.0), declared=10.0, mismatches=()):
    return Evidence(truth, norm_type, mesh, list(local), declared, list(mismatches))


def test_replica_factor_names_the_mesh_dim():
    ev = evidence(MeshSpec.of(ep=4, ep_fsdp=1))
    assert replica_factor(0.5, ev, 1e-5) == "0.500000 = 1/sqrt(4): a group counted once instead of ep_size times"
    assert replica_factor(2**-0.5, ev, 1e-5).startswith("0.707107 = 1/sqrt(2): a group counted once instead of 2")
    tp = evidence(MeshSpec.of(dp=2, tp=4))
    assert replica_factor(2.0, tp, 1e-5) == "2.000000 = sqrt(4): a group counted tp_size times instead of once"
    l1 = evidence(MeshSpec.of(ep=4), norm_type=1.0)
    assert replica_factor(0.25, l1, 1e-5) == "0.250000 = 1/4: a group counted once instead of ep_size times"
    assert replica_factor(0.9, ev, 1e-5) is None


def test_explain_picks_the_closest_mechanism():
    mesh = MeshSpec.of(dp=2)
    local = (3.0, 4.0)  # truth 5 = sqrt(9 + 16)
    mean = explain([3.5, 3.5], evidence(mesh, truth=5.0, local=local), 1e-5)
    assert mean == ["equals the mean of the rank-local norms: a root taken before the cross-rank average"]
    assert explain([3.0, 4.0], evidence(mesh, truth=5.0, local=local), 1e-5) == [
        "each rank reports its rank-local norm: no cross-rank reduction"]
    assert explain([4.0, 4.0], evidence(mesh, truth=5.0, local=local), 1e-5) == [
        "equals the largest rank-local norm: partial norms merged with MAX"]
    declared = explain([2.5, 2.5], evidence(mesh, truth=5.0, local=local, declared=2.5,
                                            mismatches=["declared Replicate on dp, measured distinct: w"]), 1e-5)
    assert declared == ["equals the norm implied by the declared placements, which are wrong: "
                        "declared Replicate on dp, measured distinct: w"]
    assert explain([5.0, 5.0], evidence(mesh, truth=5.0, local=local), 1e-5) == []


# -- checks on fabricated records -----------------------------------------------------------------------
def dense_case(nonfinite=()):
    layout = Layout(MeshSpec.of(dp=2), (param("a", (4, 3)), param("b", (3,))))
    injection = Injection(seed=2, nonfinite=nonfinite)
    variant = Variant("dp=2", layout, injection, declared_from_layout(layout))
    return CaseSpec(0, "test", variant, "t", 2.0, 0.5)


def rank_record(case, rank, reported, transform, error=None, fault=None, params_changed=()):
    """One rank's record as the runner builds it, for a target that maps each grad with ``transform``
    (returning None deletes it) and returned ``reported``."""
    layout, injection = case.layout, case.injection
    pre = {s.name: local_grad(layout, injection, s, rank) for s in layout.trainable}
    raw = {n: (None if g is None else transform(rank, n, g.clone())) for n, g in pre.items()}
    params = {n: torch.zeros(1) for n in params_changed}
    _, effects = rank_effects(pre, raw, FromSnapshot(pre), changed_params(params, {n: p + 1 for n, p in params.items()}),
                              bool(injection.nonfinite))
    local = effects.record(late=[], stale_truth=False, undelivered=[])
    return {"reported": reported, "error": error, "fault": fault, "seconds": 0.0, "local": local}


def judge(case, reported, transform, errors=None, post_distinct=None, faults=None, params_changed=None):
    """Build per-rank records as if a target returned ``reported`` and mapped grads with ``transform``."""
    layout, injection = case.layout, case.injection
    world = layout.mesh.world_size
    errors = errors or (None,) * world
    faults = faults or (None,) * world
    params_changed = params_changed or ((),) * world
    stats = simulated_stats(layout, injection, case.norm_type)
    truth = constructive_norm(layout, injection, case.norm_type)
    records = [rank_record(case, r, reported[r], transform, errors[r], faults[r], params_changed[r])
               for r in range(world)]
    pre_rep = true_replication(layout)
    post_rep = Replication(post_distinct) if post_distinct else pre_rep
    return evaluate(case, truth, truth, stats, pre_rep, post_rep, records), truth


def correct(case):
    truth = constructive_norm(case.layout, case.injection, 2.0)
    c = clip_coefficient(case.max_norm, truth)
    return truth, (lambda r, n, g: g * c)


def failed(result):
    return {c.name for c in result.failed}


def test_correct_records_pass_every_check():
    case = dense_case()
    truth, scale = correct(case)
    result, _ = judge(case, [truth, truth], scale)
    assert result.verdict == "PASS" and not result.failed
    assert {c.name for c in result.checks} == {"truth", "contract", "params", "created", "late", "norm", "agree",
                                               "coefficient", "replicas"}


def test_norm_check_fails_on_a_wrong_value():
    case = dense_case()
    truth, scale = correct(case)
    result, _ = judge(case, [truth * 1.3, truth * 1.3], scale)
    assert failed(result) == {"norm"}
    assert "correct fp32 implementations on these gradients reach" in result.failed[0].detail


def test_a_norm_off_by_less_than_any_miscount_is_an_arithmetic_finding():
    """A norm a thousandth off on a case whose smallest holding moves it by percents when counted twice: no count
    explains it, and the check that fails says arithmetic, with no counting signature."""
    case = dense_case()
    truth, scale = correct(case)
    result, _ = judge(case, [truth * 1.001, truth * 1.001], scale)
    assert failed(result) == {"arithmetic"}
    detail = result.failed[0].detail
    assert "outside their spread" in detail and "by less than any miscount" in detail, detail
    assert not result.signature


def test_a_non_finite_norm_of_finite_gradients_is_an_arithmetic_finding():
    case = dense_case()
    truth, scale = correct(case)
    result, _ = judge(case, [math.inf, math.inf], scale)
    assert "arithmetic" in failed(result) and "norm" not in failed(result)
    assert "non-finite norm where the true one is finite" in next(c.detail for c in result.failed
                                                                  if c.name == "arithmetic")


def test_a_passing_norm_says_where_correct_clips_land():
    case = dense_case()
    truth, scale = correct(case)
    result, _ = judge(case, [truth, truth], scale)
    norm = next(c for c in result.checks if c.name == "norm")
    assert norm.passed and "within their spread" in norm.detail and "reported 1.000000 x true" in norm.detail


def test_agree_check_fails_when_ranks_differ_by_one_ulp():
    case = dense_case()
    truth, scale = correct(case)
    result, _ = judge(case, [truth, math.nextafter(truth, math.inf)], scale)
    assert failed(result) == {"agree"}
    # the detail shows the two values with every digit, and how far apart they are
    (detail,) = [c.detail for c in result.checks if c.name == "agree"]
    assert f"0: {truth!r}, 1: {math.nextafter(truth, math.inf)!r}" in detail and "apart by 1 ulp" in detail


def test_coefficient_check_fails_without_clipping_and_on_partial_clipping():
    case = dense_case()
    truth, scale = correct(case)
    result, _ = judge(case, [truth, truth], lambda r, n, g: g)
    assert failed(result) == {"coefficient"}
    result, _ = judge(case, [truth, truth], lambda r, n, g: scale(r, n, g) if n == "a" else g)
    assert failed(result) == {"coefficient"} and "b scaled by 1" in result.failed[0].detail


def test_coefficient_check_fails_on_non_uniform_scaling():
    case = dense_case()
    truth, scale = correct(case)

    def lopsided(r, n, g):
        g = scale(r, n, g)
        g.view(-1)[0] *= 1.5
        return g

    result, _ = judge(case, [truth, truth], lopsided)
    assert failed(result) == {"coefficient"} and "non-uniformly" in result.failed[0].detail


def test_replicas_check_fails_when_a_replica_diverges():
    case = dense_case()
    truth, scale = correct(case)
    result, _ = judge(case, [truth, truth], scale, post_distinct={"dp": {"a": True, "b": False}})
    assert failed(result) == {"replicas"}


def test_raised_check_names_the_root_cause_not_the_collateral():
    case = dense_case()
    truth, scale = correct(case)
    errors = ("RuntimeError: [gloo] Connection closed by peer [127.0.0.1]", "ValueError: boom (at t.py:3)")
    result, _ = judge(case, [None, None], lambda r, n, g: g, errors=errors)
    assert failed(result) == {"raised"}
    assert result.failed[0].detail.startswith("rank 1: ValueError: boom")


def test_nonfinite_consistency():
    case = dense_case(nonfinite=[("a", 0, "nan")])
    both_nan, _ = judge(case, [math.nan, math.nan], lambda r, n, g: g * math.nan)
    assert both_nan.verdict == "PASS" and "nonfinite" in {c.name for c in both_nan.checks}
    one_rank, _ = judge(case, [math.nan, 3.0], lambda r, n, g: g)
    assert "nonfinite" in failed(one_rank) and "agree" in failed(one_rank)
    split_action, _ = judge(case, [math.nan, math.nan], lambda r, n, g: g * 0.5 if r else g)
    assert failed(split_action) == {"nonfinite"}
    all_raise, _ = judge(case, [None, None], lambda r, n, g: g, errors=("E: nonfinite", "E: nonfinite"))
    assert all_raise.verdict == "PASS"
    one_raise, _ = judge(case, [None, None], lambda r, n, g: g,
                         errors=("E: Connection closed by peer", "E: nonfinite"))
    assert {"raised", "nonfinite"} <= failed(one_raise)


def test_harness_error_when_measured_and_constructive_disagree():
    case = dense_case()
    truth, scale = correct(case)
    layout, injection = case.layout, case.injection
    stats = simulated_stats(layout, injection, 2.0)
    records = [rank_record(case, r, truth, scale) for r in range(2)]
    rep = true_replication(layout)
    result = evaluate(case, truth, truth * 1.01, stats, rep, rep, records)
    assert result.verdict == "ERROR" and "HARNESS ERROR" in result.failed[0].detail


# -- non-finite policies, faults and parameters (issue: verdicts on clips nobody here wrote) ---------------
def partial_case(nonfinite=(("a", 0, "nan"),), norm_type=2.0):
    """Parameter 'b' lives on rank 0 only, so rank 1 holds only 'a'; with 'a' absent on rank 2 of a
    3-rank mesh, rank 2 holds no gradient at all."""
    mesh = MeshSpec.of(dp=3)
    layout = Layout(mesh, (param("a", (4, 3), present_ranks={0, 1}), param("b", (3,), present_ranks={0})))
    variant = Variant("dp=3 partial", layout, Injection(seed=2, nonfinite=nonfinite), declared_from_layout(layout))
    return CaseSpec(0, "test", variant, "t", norm_type, 0.5)


@pytest.mark.parametrize("policy, transform", [
    ("skip-step zeroing", lambda r, n, g: g.zero_()),
    ("propagate NaN (torch)", lambda r, n, g: g * math.nan),
    ("leave", lambda r, n, g: g),
    ("torch after an inf norm: g * 0", lambda r, n, g: g * 0.0),
])
def test_every_legitimate_nonfinite_policy_passes_when_a_rank_holds_nothing(policy, transform):
    for kind in ("nan", "inf"):
        case = partial_case(nonfinite=(("a", 1, kind),))
        result, _ = judge(case, [math.nan if kind == "nan" else math.inf] * 3, transform)
        assert result.verdict == "PASS", (policy, kind, [(c.name, c.detail) for c in result.failed])


def test_ranks_that_hold_gradients_must_apply_the_same_policy():
    case = partial_case()
    split, _ = judge(case, [math.nan] * 3, lambda r, n, g: g.zero_() if r == 0 else g * math.nan)
    assert failed(split) == {"nonfinite"}
    assert split.failed[0].detail.endswith("per rank: 0: reported a non-finite norm and zeroed the gradients; "
                                           "1: reported a non-finite norm and multiplied the gradients by NaN; "
                                           "2: reported a non-finite norm and held no gradient"), split.failed[0].detail
    finite_on_empty, _ = judge(case, [math.nan, math.nan, 0.0], lambda r, n, g: g * math.nan)
    assert "nonfinite" in failed(finite_on_empty)


def test_a_nonfinite_detail_says_in_words_what_each_rank_did():
    """A user reads "reported a finite norm and left the gradients unchanged", never the policy names
    ("finite/leave"): every policy the effects measure has its words."""
    assert set(POLICY_WORDS) == set(POLICIES)
    finite, _ = judge(partial_case(), [1.0] * 3, lambda r, n, g: g)
    detail = next(c.detail for c in finite.failed if c.name == "nonfinite")
    assert "0: reported a finite norm and left the gradients unchanged" in detail, detail
    assert "2: reported a finite norm and held no gradient" in detail, detail
    assert "/" not in detail and not any(f"{name}" in detail.split() for name in POLICIES), detail


def test_only_a_documented_nonfinite_raise_passes_a_nonfinite_case():
    case = partial_case()
    torch_words = ("RuntimeError: The total norm of order 2.0 for gradients from `parameters` is non-finite, "
                   "so it cannot be clipped. (at clip.py:9)")
    documented, _ = judge(case, [None] * 3, lambda r, n, g: g, errors=(torch_words,) * 3)
    assert documented.verdict == "PASS"
    arbitrary, _ = judge(case, [None] * 3, lambda r, n, g: g, errors=("ValueError: broken on purpose (at inf/x.py:3)",) * 3)
    assert failed(arbitrary) == {"raised", "nonfinite"}
    partial, _ = judge(case, [None, math.nan, math.nan], lambda r, n, g: g, errors=(torch_words, None, None))
    assert "raised" in failed(partial)


@pytest.mark.parametrize("message", [
    "RuntimeError: gradient norm is not finite; skipping step",
    "FloatingPointError: NaNs/Infs detected in the gradients; refusing to clip",
    "RuntimeError: global norm is non finite",
    "ValueError: found nan in the gradients",
    "RuntimeError: Infs in the gradient norm",
])
def test_a_raise_in_other_words_for_non_finite_passes(message):
    """A documented non-finite raise in other words ('not finite', 'NaNs/Infs', 'non finite') passes."""
    documented, _ = judge(partial_case(), [None] * 3, lambda r, n, g: g, errors=(message + " (at clip.py:3)",) * 3)
    assert documented.verdict == "PASS", [(c.name, c.detail) for c in documented.failed]


def test_a_rejected_raise_says_why():
    """A raise rejected for its message says so."""
    arbitrary, _ = judge(partial_case(), [None] * 3, lambda r, n, g: g,
                         errors=("ValueError: broken on purpose (at x.py:3)",) * 3)
    detail = next(c.detail for c in arbitrary.failed if c.name == "raised")
    assert "does not say non-finite" in detail and "rank(s) [0, 1, 2]" in detail, detail


def test_a_norm_returned_as_a_float32_tensor_is_judged_at_one_float32_rounding():
    """An exact fp64 norm returned as torch.tensor(norm) (float32) passes at fp64, within one float32 rounding."""
    layout = Layout(MeshSpec.of(dp=2), (param("a", (4, 3)), param("b", (3,))))
    case = CaseSpec(0, "test", Variant("dp=2", layout, Injection(seed=2, dtype="fp64"), declared_from_layout(layout)),
                    "t", 2.0, 0.5)
    truth, scale = correct(case)
    rounded = float(torch.tensor(truth, dtype=torch.float32))
    assert abs(rounded - truth) / truth > 1e-9  # outside fp64's own tolerance
    result, _ = judge(case, [rounded, rounded], scale)
    assert failed(result) == {"arithmetic"}  # a Python float: fp64 precision, so this is wrong
    stats = simulated_stats(case.layout, case.injection, 2.0)
    rep = true_replication(case.layout)
    records = [dict(rank_record(case, r, rounded, scale), precision="fp32") for r in range(2)]
    assert evaluate(case, truth, truth, stats, rep, rep, records).verdict == "PASS"
    off = [dict(rank_record(case, r, truth * (1 + 1e-6), scale), precision="fp32") for r in range(2)]
    assert "arithmetic" in failed(evaluate(case, truth, truth, stats, rep, rep, off))  # beyond one float32 rounding


def test_a_failing_norm_or_coefficient_says_how_far_off_and_the_tolerance():
    """The details print the relative error and the tolerance: 'scaled by 0.25, expected 0.25' and
    'reported/true rank 0: 1' would hide the failing quantity (a float32 rounding at fp64)."""
    layout = Layout(MeshSpec.of(dp=2), (param("a", (4, 3)), param("b", (3,))))
    case = CaseSpec(0, "test", Variant("dp=2", layout, Injection(seed=2, dtype="fp64"), declared_from_layout(layout)),
                    "t", 2.0, 0.5)
    truth, _ = correct(case)
    c32 = float(torch.tensor(clip_coefficient(case.max_norm, truth), dtype=torch.float32))
    result, _ = judge(case, [truth * (1 + 1e-7)] * 2, lambda r, n, g: g * c32)
    details = {c.name: c.detail for c in result.failed}
    assert "relative error up to 1e-07 > tolerance 1e-09" in details["arithmetic"], details
    assert "relative error" in details["coefficient"] and "> tolerance" in details["coefficient"], details


def test_a_reported_max_norm_is_signed_as_the_norm_after_clipping():
    """Reporting min(total, max_norm) is signed as the norm after clipping, not a replica counted wrong."""
    case = dense_case()
    truth, scale = correct(case)
    assert case.max_norm < truth
    result, _ = judge(case, [case.max_norm] * 2, scale)
    assert result.signature[0] == "equals max_norm: the norm after clipping reported, not the norm before it"


def test_no_replica_factor_is_read_into_a_layout_without_replicas():
    """No 'sqrt(2): a group counted ... times' signature on a layout where nothing is replicated."""
    layout = Layout(MeshSpec.of(dp=2), (param("a", (4, 3), dp=Shard(0)), param("b", (4,), dp=Shard(0))))
    case = CaseSpec(0, "test", Variant("dp=2 sharded", layout, Injection(seed=2), declared_from_layout(layout)),
                    "t", 2.0, 100.0)
    truth = constructive_norm(layout, case.injection, 2.0)
    result, _ = judge(case, [truth * 2**0.5] * 2, lambda r, n, g: g)
    assert "norm" in failed(result) and not any("counted" in line for line in result.signature), result.signature
    replicated = dense_case()
    rtruth, scale = correct(replicated)
    doubled, _ = judge(replicated, [rtruth * 2**0.5] * 2, scale)
    assert any("counted dp_size times instead of once" in line for line in doubled.signature), doubled.signature


def test_harness_detected_faults_never_pass_even_on_a_nonfinite_case():
    case = partial_case()
    none_returned, _ = judge(case, [None] * 3, lambda r, n, g: g * math.nan,
                             faults=("the clip function returned NoneType, expected a number or a tensor",) * 3)
    assert {"contract", "nonfinite"} <= failed(none_returned)
    deleted, _ = judge(case, [math.nan] * 3, lambda r, n, g: None)
    assert {"contract", "nonfinite"} <= failed(deleted) and "lost its gradient" in deleted.checks[1].detail


def test_a_gradient_the_clip_made_non_finite_in_a_finite_case_fails_the_contract():
    """An fp16 overflow in ``g.mul_(max_norm)``, or a NaN fill, in a finite case fails the contract: the
    factor fit skips non-finite gradients and the non-finite check only runs when the truth is not finite."""
    case = dense_case()
    truth, scale = correct(case)
    overflowed, _ = judge(case, [truth, truth],
                          lambda r, n, g: scale(r, n, g) * math.inf if n == "a" else scale(r, n, g))
    assert failed(overflowed) == {"contract"}
    assert "rank 0: a became non-finite (inf/NaN) in the clip" in overflowed.failed[0].detail, overflowed.failed[0].detail
    poisoned, _ = judge(case, [truth, truth], lambda r, n, g: g.fill_(math.nan))
    assert "contract" in failed(poisoned) and "rank 0: a, b became non-finite" in poisoned.failed[0].detail
    # with a non-finite truth a NaN gradient is a policy (poison), not a contract fault
    nan_case = dense_case(nonfinite=[("a", 0, "nan")])
    poison, _ = judge(nan_case, [math.nan, math.nan], lambda r, n, g: g * math.nan)
    assert poison.verdict == "PASS", [(c.name, c.detail) for c in poison.failed]


def test_a_documented_raise_after_touching_the_gradients_fails_the_nonfinite_check():
    """Scaling (or poisoning) the gradients first and raising a documented non-finite error afterwards
    leaves the step's gradients destroyed: a raise passes only if every holder left them."""
    case = partial_case()
    words = ("RuntimeError: The total norm of order 2.0 for gradients is non-finite, so it cannot be clipped",) * 3
    left, _ = judge(case, [None] * 3, lambda r, n, g: g, errors=words)
    assert left.verdict == "PASS"
    scaled_first, _ = judge(case, [None] * 3, lambda r, n, g: g * 0.5, errors=words)
    assert failed(scaled_first) == {"nonfinite"}
    detail = scaled_first.failed[0].detail
    assert "changed their gradients before raising" in detail and "ranks [0, 1]" in detail, detail
    one_rank_touched, _ = judge(case, [None] * 3, lambda r, n, g: g * math.nan if r == 1 else g, errors=words)
    assert failed(one_rank_touched) == {"nonfinite"} and "ranks [1]" in one_rank_touched.failed[0].detail


def test_a_mangled_gradient_is_a_contract_failure_not_a_crash():
    case = dense_case()
    truth, scale = correct(case)
    result, _ = judge(case, [truth, truth], lambda r, n, g: scale(r, n, g).reshape(-1) if n == "a" else scale(r, n, g))
    assert failed(result) == {"contract"} and "shape (4, 3) -> (12,)" in result.failed[0].detail


def test_changed_parameters_fail_the_params_check():
    case = dense_case()
    truth, scale = correct(case)
    result, _ = judge(case, [truth, truth], scale, params_changed=((), ("a",)))
    assert failed(result) == {"params"} and "rank 1: a" in result.failed[0].detail


def test_gradients_scaled_up_below_the_bound_fail_the_coefficient_check():
    case = dense_case()
    truth = constructive_norm(case.layout, case.injection, 2.0)
    above = CaseSpec(0, "test", case.variant, "t", 2.0, 2 * truth)
    kept, _ = judge(above, [truth, truth], lambda r, n, g: g)
    assert kept.verdict == "PASS"
    up, _ = judge(above, [truth, truth], lambda r, n, g: g * 2.0)
    assert failed(up) == {"coefficient"}


def test_gradients_a_framework_path_did_not_deliver_make_the_case_a_harness_error():
    case = dense_case()
    truth, scale = correct(case)
    stats = simulated_stats(case.layout, case.injection, 2.0)
    rep = true_replication(case.layout)
    records = [rank_record(case, r, truth, scale) for r in range(2)]
    records[1]["local"]["undelivered"] = ["b: 3 of 3 elements differ (largest difference 0.5)"]
    result = evaluate(case, truth, truth, stats, rep, rep, records)
    assert result.verdict == "ERROR" and failed(result) == {"truth"}
    assert "ranks [1]" in result.failed[0].detail and "b: 3 of 3 elements differ" in result.failed[0].detail


# -- the registry: a positive control per check, and each check reads only what it declares ---------------
def _truth_control():
    case = dense_case()
    truth, scale = correct(case)
    stats = simulated_stats(case.layout, case.injection, 2.0)
    rep = true_replication(case.layout)
    records = [rank_record(case, r, truth, scale) for r in range(2)]
    return evaluate(case, truth, truth * 1.01, stats, rep, rep, records)


def _created_control():
    """A rank whose None gradient came back as zeros (a frozen parameter or an expert without tokens)."""
    case = partial_case(nonfinite=())
    truth, scale = correct(case)
    records = [rank_record(case, r, truth, scale) for r in range(3)]
    records[1]["local"]["created"] = ["b"]  # b lives on rank 0 only
    stats = simulated_stats(case.layout, case.injection, case.norm_type)
    rep = true_replication(case.layout)
    return evaluate(case, truth, truth, stats, rep, rep, records)


def _late_control():
    case = dense_case()
    truth, scale = correct(case)
    records = [rank_record(case, r, truth, scale) for r in range(2)]
    records[0]["local"]["late"] = ["gradient a"]
    stats = simulated_stats(case.layout, case.injection, 2.0)
    rep = true_replication(case.layout)
    return evaluate(case, truth, truth, stats, rep, rep, records)


def _with_correct(build):
    case = dense_case()
    truth, scale = correct(case)
    return build(case, truth, scale)[0]


CONTROLS = {
    "truth": _truth_control,
    "raised": lambda: _with_correct(lambda c, t, s: judge(c, [None, t], s, errors=("ValueError: boom", None))),
    "contract": lambda: _with_correct(lambda c, t, s: judge(c, [t, t], lambda r, n, g: None if n == "b" else s(r, n, g))),
    "params": lambda: _with_correct(lambda c, t, s: judge(c, [t, t], s, params_changed=(("a",), ()))),
    "created": lambda: _created_control(),
    "late": lambda: _late_control(),
    "norm": lambda: _with_correct(lambda c, t, s: judge(c, [t * 0.5, t * 0.5], s)),
    "arithmetic": lambda: _with_correct(lambda c, t, s: judge(c, [t * 1.001, t * 1.001], s)),
    "agree": lambda: _with_correct(lambda c, t, s: judge(c, [t, math.nextafter(t, 0.0)], s)),
    "coefficient": lambda: _with_correct(lambda c, t, s: judge(c, [t, t], lambda r, n, g: g)),
    "replicas": lambda: _with_correct(lambda c, t, s: judge(c, [t, t], s, post_distinct={"dp": {"a": True, "b": True}})),
    "nonfinite": lambda: judge(dense_case(nonfinite=[("a", 0, "nan")]), [math.nan, math.nan],
                               lambda r, n, g: g * 0.5 if r else g)[0],
}
"""One fabricated case per check whose records are what a clip broken in exactly that way produces."""


@pytest.mark.parametrize("name", [spec.name for spec in CHECKS])
def test_every_registered_check_has_a_positive_control_that_fails_it(name):
    result = CONTROLS[name]()
    assert name in failed(result), (name, [(c.name, c.passed, c.detail) for c in result.checks])
    assert result.verdict == ("ERROR" if name == "truth" else "FAIL")


def test_the_controls_name_only_registered_checks():
    assert set(CONTROLS) == {spec.name for spec in CHECKS}


class _Reads(dict):
    """A record's ``local`` that remembers which keys were asked for."""

    def __init__(self, data, seen):
        super().__init__(data)
        self.seen = seen

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)


def _judgements():
    """Finite and non-finite cases, correct and broken, so every branch of every check reads."""
    for case, reported, transform in [
        (dense_case(), None, None),
        (dense_case(), [1.0, 2.0], lambda r, n, g: None if n == "a" else g),
        (dense_case(nonfinite=[("a", 0, "nan")]), [math.nan, math.nan], lambda r, n, g: g * math.nan),
        (partial_case(), [math.nan] * 3, lambda r, n, g: g.zero_() if r == 0 else g),
    ]:
        truth = constructive_norm(case.layout, case.injection, case.norm_type)
        if transform is None:
            _, transform = correct(case)
            reported = [truth] * case.layout.mesh.world_size
        records = [rank_record(case, r, reported[r], transform, params_changed=("a",) if r else ())
                   for r in range(case.layout.mesh.world_size)]
        stats = simulated_stats(case.layout, case.injection, case.norm_type)
        rep = true_replication(case.layout)
        yield case, records, lambda recs: Judgement(case, truth, truth, stats, rep, rep, recs)


def test_the_keys_a_check_may_declare_are_the_rank_local_records_keys():
    import typing

    from harness.judge.records import RankLocal, RankLocalKey

    assert set(typing.get_args(RankLocalKey)) == set(RankLocal.__annotations__)


@pytest.mark.parametrize("spec", CHECKS, ids=lambda spec: spec.name)
def test_each_check_reads_only_the_rank_local_data_it_declares(spec):
    for _, records, make in _judgements():
        seen: set[str] = set()
        spec.judge(make([dict(rec, local=_Reads(rec["local"], seen)) for rec in records]))
        assert seen <= set(spec.reads), (spec.name, seen - set(spec.reads))
    produced = set().union(*(rec["local"] for _, records, _ in _judgements() for rec in records))
    assert set(spec.reads) <= produced


# -- tolerances derived from the arithmetic -------------------------------------------------------------
def test_the_uniformity_bound_grows_with_the_fit_at_fp64_and_stays_tight_elsewhere():
    from harness.judge.tolerance import UNIT_ROUNDOFF, uniformity_bound

    # a correct fp64 clip over 4096 elements: the float64 fit alone is off by a few dozen ulps
    assert uniformity_bound("fp64", 4096) > 50 * UNIT_ROUNDOFF["fp64"]
    assert uniformity_bound("fp64", 4096) < 1e-11  # a 1.5x slip of one element is still far outside
    for dtype in ("fp32", "bf16", "fp16"):
        assert uniformity_bound(dtype, 4096) <= 17 * UNIT_ROUNDOFF[dtype]


@pytest.mark.parametrize("dtype", ["fp64", "fp32", "fp16", "bf16"])
def test_a_correctly_clipped_large_gradient_passes_at_every_dtype_and_a_slipped_one_fails(dtype):
    from harness.cases.injection import DTYPES

    layout = Layout(MeshSpec.of(dp=2), (param("a", (64, 64), dp=Shard(0)), param("b", (4096,))))
    case = CaseSpec(0, "test", Variant("dp=2", layout, Injection(seed=5, dtype=dtype),
                                       declared_from_layout(layout)), "t", 2.0, 0.5)
    truth = constructive_norm(layout, case.injection, 2.0)
    c = clip_coefficient(case.max_norm, truth)
    torch_dtype = DTYPES[dtype]
    coef = torch.tensor(c, dtype=torch.float32 if dtype in ("fp16", "bf16") else torch_dtype)
    scaled = lambda r, n, g: (g.to(coef.dtype) * coef).to(torch_dtype)  # noqa: E731 - torch's way
    result, _ = judge(case, [truth, truth], scaled)
    assert result.verdict == "PASS", [(x.name, x.detail) for x in result.failed]

    def slipped(r, n, g):
        g = scaled(r, n, g)
        g.view(-1)[7] *= 1.25  # a slip well outside even bf16's rounding
        return g

    result, _ = judge(case, [truth, truth], slipped)
    assert "coefficient" in failed(result) and "non-uniformly" in result.failed[0].detail


def test_a_results_file_record_with_null_checks_is_counted_not_a_crash():
    """Records are read back from files users keep: an ERROR record whose ``checks`` is null or missing
    counts as a harness error (never judged as unjudged by a check it does not have), and the page and
    the summary built from it do not raise."""
    from harness.judge.verdicts import count, is_unjudged
    from harness.report.html import render_html
    from harness.report.summary import compact_summary

    records = [{"type": "case", "verdict": "ERROR", "checks": None, "scenario": "s", "target": "t"},
               {"type": "case", "verdict": "ERROR", "scenario": "s", "target": "t"},
               {"type": "case", "verdict": "ERROR", "checks": {"crash": {"passed": False, "detail": "x"}}}]
    assert [is_unjudged(r) for r in records] == [False, False, True]
    assert count(records).unjudged == 1
    render_html(records)
    compact_summary(records)


def test_a_wrong_norm_nothing_explains_says_so_rather_than_nothing():
    """A norm 14% low with no signature and no blame (a bf16 running sum that stalls reads like that): its
    reading says no single known mistake gives it, so it is not taken for a count the judge failed to name."""
    from harness.report.record_fields import UNEXPLAINED, readings

    wrong = {"checks": {"norm": {"passed": False, "detail": "reported/true rank 0: 0.86"}}, "signature": []}
    assert readings(wrong) == [UNEXPLAINED]
    assert readings(dict(wrong, signature=["each rank reports its rank-local norm"])) == [
        "each rank reports its rank-local norm"]
    assert readings(dict(wrong, blame=[{"line": "a: counted 2 times"}])) == []
    arithmetic = {"checks": {"arithmetic": {"passed": False, "detail": "..."}}, "signature": []}
    assert readings(arithmetic) == []
