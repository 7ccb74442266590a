"""``applied_coefficients``: the factor each gradient was scaled by, measured over all parameters at
once. The cases a per-parameter loop would have handled one by one, each checked on its own."""

from __future__ import annotations

import math

import torch

from harness.run.case.effects import applied_coefficients


def grads(**named: list[float] | None) -> dict[str, torch.Tensor | None]:
    return {n: None if v is None else torch.tensor(v, dtype=torch.float32) for n, v in named.items()}


def test_each_parameter_gets_its_own_factor_and_a_uniform_one_has_no_residual():
    pre = grads(a=[1.0, -2.0, 3.0], b=[0.5], c=[4.0, 4.0])
    post = {"a": pre["a"] * 0.25, "b": pre["b"] * -3.0, "c": pre["c"]}  # type: ignore[operator]
    scale = applied_coefficients(pre, post)["scale"]
    assert set(scale) == {"a", "b", "c"}
    for name, factor, elements in (("a", 0.25, 3), ("b", -3.0, 1), ("c", 1.0, 2)):
        c, residual, n = scale[name]
        assert math.isclose(c, factor, rel_tol=1e-12) and residual < 1e-12 and n == elements, (name, scale[name])


def test_a_non_uniform_scaling_shows_in_the_residual_of_that_parameter_only():
    pre = grads(a=[1.0, 1.0, 1.0, 1.0], b=[2.0, 3.0])
    post = grads(a=[0.5, 0.5, 0.5, 2.0], b=[1.0, 1.5])
    scale = applied_coefficients(pre, post)["scale"]
    assert scale["a"][1] > 0.5 and scale["b"][1] < 1e-12, scale


def test_non_finite_values_zero_and_empty_gradients_get_no_factor_and_do_not_spoil_the_others():
    inf, nan = float("inf"), float("nan")
    pre = grads(inf_before=[inf, 1.0], nan_after=[1.0, 2.0], inf_over_zero=[0.0, 1.0], zero=[0.0, 0.0],
                empty=[], fine=[2.0, -1.0])
    post = grads(inf_before=[inf, 0.5], nan_after=[0.5, nan], inf_over_zero=[inf, 0.5], zero=[0.0, 0.0],
                 empty=[], fine=[1.0, -0.5])
    scale = applied_coefficients(pre, post)["scale"]
    assert set(scale) == {"fine"} and math.isclose(scale["fine"][0], 0.5), scale


def test_a_deleted_gradient_is_vanished_and_an_absent_one_is_ignored():
    pre = grads(kept=[1.0], deleted=[2.0], absent=None)
    post = grads(kept=[1.0], deleted=None, absent=[3.0])
    out = applied_coefficients(pre, post)
    assert out["vanished"] == ["deleted"] and set(out["scale"]) == {"kept"}
    assert applied_coefficients(grads(x=[1.0]), grads(x=None)) == {"scale": {}, "vanished": ["x"],
                                                                    "became_nonfinite": []}


def test_a_gradient_finite_before_and_non_finite_after_is_named_and_one_non_finite_before_is_not():
    inf, nan = float("inf"), float("nan")
    pre = grads(overflowed=[60000.0, 1.0], poisoned=[0.0, 0.0], was_nan=[nan, 1.0], fine=[2.0, -1.0])
    post = grads(overflowed=[inf, 0.5], poisoned=[nan, nan], was_nan=[nan, nan], fine=[1.0, -0.5])
    out = applied_coefficients(pre, post)
    assert out["became_nonfinite"] == ["overflowed", "poisoned"] and set(out["scale"]) == {"fine"}, out


def test_a_gradient_replaced_by_a_new_tensor_is_told_from_one_scaled_in_place():
    import torch.nn as nn

    from harness.run.case.model_state import ModelState

    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = ModelState.of(model)
    first, second = list(model.parameters())[:2]
    first.grad.mul_(0.5)  # in place
    second.grad = second.grad * 0.5  # a new tensor with the same values
    after = ModelState.of(model)
    assert before.replaced(after) == ["0.bias"] and before.wrapper_changes(after) == {}


def test_a_sparse_gradient_is_mangled_and_a_huge_int_return_is_a_type_fault():
    import pytest

    from harness.run.case.effects import mangled_reason
    from harness.targets.target import reported_value

    dense = torch.ones(2, 3)
    assert mangled_reason(dense, dense.to_sparse()) == "layout strided -> sparse_coo"
    assert mangled_reason(dense, dense * 2) is None
    with pytest.raises(TypeError, match="too large for a float"):
        reported_value(10**400)


def test_a_changed_global_torch_setting_is_named_and_restored():
    from harness.run.case.model_state import GlobalState, global_state_fault

    before = GlobalState.of()
    try:
        torch.set_grad_enabled(False)
        torch.set_default_dtype(torch.float64)
        fault = global_state_fault(before)
        assert fault is not None and "grad mode True -> False" in fault and "default dtype float32 -> float64" in fault
        assert GlobalState.of() == before and global_state_fault(before) is None
    finally:
        before.restore()


def test_a_gradient_of_subnormal_numbers_is_judged_to_what_its_roundings_allow():
    """fp16 gradients below fp16's smallest normal number, scaled correctly by 0.3: every rounding is an
    absolute amount, a sizeable fraction of each element, so the fitted factor carries a slack of its own
    and the residual allows one subnormal spacing; a relative bound alone called the reference clip wrong."""
    from harness.judge.tolerance import coefficient_rtol, norm_rtol, uniformity_bound

    torch.manual_seed(0)
    pre = (torch.randn(24) * 2**-16).half()
    post = (pre.float() * 0.3).half()
    c, residual, elements, slack = applied_coefficients({"g": pre}, {"g": post})["scale"]["g"]
    assert abs(c - 0.3) / 0.3 <= slack + coefficient_rtol("fp16", 24, norm_rtol("fp16", 24))
    assert residual <= uniformity_bound("fp16", 24)
    assert 0 < slack < 0.05
    wrong = (pre.float() * 0.25).half()  # a factor off by far more than the slack still shows
    assert abs(applied_coefficients({"g": pre}, {"g": wrong})["scale"]["g"][0] - 0.3) / 0.3 > 0.1
    normal = torch.randn(24).half()  # normal numbers: no slack
    assert len(applied_coefficients({"g": normal}, {"g": (normal.float() * 0.3).half()})["scale"]["g"]) == 3


def _every_reading(pre: torch.Tensor, post: torch.Tensor) -> dict[str, list[float]]:
    """One gradient's ``[c, residual, elements(, slack)]`` as each reading of a call measures it: the runner's
    float64 copies, the audit's blocks of a copy, the audit's two passes without one."""
    from harness.run.audit import with_copy
    from harness.run.audit.gradient_pass import GradientPass
    from harness.run.audit.without_copy import cheap_scale

    passes = []
    for grad in (pre, post):
        one = GradientPass(2.0)
        stats = one.add(grad)
        one.finish()
        passes.append(stats)
    cheap = cheap_scale(*passes)
    assert cheap is not None
    return {"runner": applied_coefficients({"g": pre}, {"g": post})["scale"]["g"],
            "audit, with a copy": with_copy.blocked_coefficients({"g": pre}, {"g": post})[0]["g"],
            "audit, without a copy": cheap}


def test_every_reading_fits_a_gradient_near_its_smallest_normal_number_alike():
    """All subnormal after the clip, half of them, or none: each of the three readings (``factor_fit``, shared)
    finds the factor within the coefficient check's tolerance plus its own slack and the scaling uniform, a slack
    only where no element it fits on is a normal number, and a factor off by a sixth is off in every reading."""
    from harness.judge.tolerance import coefficient_rtol, norm_rtol, uniformity_bound

    torch.manual_seed(1)
    n = 4096
    ctol = coefficient_rtol("fp16", n, norm_rtol("fp16", n))
    for scale in (2.0**-16, 2.0**-13, 1.0):
        pre = (torch.randn(n) * scale).half()
        for name, (c, residual, elements, *slack) in _every_reading(pre, (pre.float() * 0.3).half()).items():
            assert abs(c - 0.3) / 0.3 <= ctol + sum(slack), (scale, name, c, slack)
            assert residual <= uniformity_bound("fp16", n), (scale, name, residual)
            assert elements == n
            if scale != 2.0**-13 or name != "audit, without a copy":  # its few samples may all be subnormal there
                assert bool(slack) == (scale == 2.0**-16), (scale, name, slack)  # no normal element: a slack
        for name, (c, residual, _, *slack) in _every_reading(pre, (pre.float() * 0.25).half()).items():
            assert abs(c - 0.3) / 0.3 > ctol + sum(slack), (scale, name, c, slack)
