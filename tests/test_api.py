"""``harness.check``: the built-in scenarios against a clip from Python, on warm worlds."""

from __future__ import annotations

import pytest

import harness
from harness.errors import ClipcheckInputError
from harness.reference import clip_grad_norm as reference

pytestmark = pytest.mark.distributed


def test_check_passes_the_reference_and_describes_what_the_cli_prints():
    report = harness.check(reference, scenarios=["dense_dp"], worlds=[1, 2], dtypes=["fp32"])
    assert report.passed, report.describe()
    assert {c["world_size"] for c in report.cases} == {1, 2}
    assert len([r for r in report.records if r.get("type") == "summary"]) == 2
    text = report.describe()
    assert "clipcheck: " in text and "cases on 2 rank(s)" in text and "=> PASS" in text
    assert report.metamorphic and all(g["passed"] for g in report.metamorphic)


def test_check_fails_a_mutant_with_its_signature():
    report = harness.check("mutant-local-root-mean", scenarios=["dense_dp"], worlds=[2], dtypes=["fp32"],
                           norm_types=[2], clip_ratios=[0.5])
    assert not report.passed and report.status == 1
    assert any("mean of the rank-local norms" in s for c in report.failures for s in c["signature"])


def test_check_reuses_a_warm_world(rank_pool):
    pool = rank_pool(2)
    report = harness.check("tests/correct_targets.py:foreach_kernels", scenarios=["deepspeed_autoep"],
                           worlds=[2], dtypes=["bf16"], pools={2: pool})
    assert report.passed, report.describe()


@pytest.mark.parametrize("target, selection, message", [
    (lambda model, **kw: 0.0, {}, "module-level function"),
    ("nope", {}, "unknown target 'nope'"),
    ("reference", {"worlds": ["2"]}, "worlds: expected an integer"),
    ("reference", {"scenarios": ["no_such"]}, "unknown scenario 'no_such'"),
    ("reference", {"clip_ratios": [-1]}, "clip_ratios"),
])
def test_bad_input_raises_one_clear_error_before_any_rank_starts(target, selection, message):
    with pytest.raises(ClipcheckInputError, match=message):
        harness.check(target, **selection)


def test_public_names_resolve_after_the_internals_are_imported():
    """The package's exports are lazy; none may be shadowed by a submodule of the same name."""
    import harness.cases.context  # noqa: F401
    import harness.run.case.runner  # noqa: F401

    for name in harness.__all__:
        value = getattr(harness, name)
        assert not isinstance(value, type(harness)), f"harness.{name} is a module"
