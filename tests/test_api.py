"""``harness.check``: the built-in scenarios against a clip from Python, on warm worlds."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
import typing

import pytest

import harness
from harness.errors import ClipcheckInputError
from harness.judge.verdicts import EXIT_BROKEN
from harness.reference import clip_grad_norm as reference
from harness.run.hosts.pool import PoolBroken, RankPool
from harness_runs import ROOT

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
    """The package's exports are lazy; none may be shadowed by a submodule of the same name (``harness.fuzz``
    is the function though harness/fuzz.py was imported first)."""
    import harness.cases.context  # noqa: F401
    import harness.fuzz  # noqa: F401
    import harness.run.case.runner  # noqa: F401

    for name in harness.__all__:
        value = getattr(harness, name)
        assert not isinstance(value, type(harness)), f"harness.{name} is a module"
    from harness import fuzz

    assert inspect.isfunction(fuzz) and fuzz is harness.fuzz is sys.modules["harness.fuzz"].fuzz


@pytest.mark.parametrize("first", ["harness", "harness.fuzz"])
def test_the_root_error_the_pool_and_fuzz_are_exported_without_importing_torch(first):
    """``from harness import ClipcheckError, RankPool, fuzz``, whichever of ``harness`` and its ``fuzz``
    module is imported first (a fresh interpreter each); ``import harness`` alone imports no torch."""
    code = (f"import sys, inspect, {first}; torch = 'torch' in sys.modules; "
            "from harness import ClipcheckError, FuzzReport, RankPool, fuzz; import harness.fuzz; "
            "from harness.errors import ClipcheckError as Root; from harness.fuzz import fuzz as function; "
            "from harness.run.hosts.pool import RankPool as Pool; "
            "print(torch, inspect.isfunction(fuzz) and fuzz is function and harness.fuzz is function, "
            "ClipcheckError is Root and RankPool is Pool and FuzzReport.__name__ == 'FuzzReport')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert proc.stdout.split() == [str(first == "harness.fuzz"), "True", "True"], proc.stdout + proc.stderr


def test_the_pool_s_and_the_world_s_errors_are_under_the_root_and_an_interruption_is_not_an_error():
    """One root, as hypothesis has one: ``except ClipcheckError`` catches a pool that did not start and a
    world a hung or dead rank broke (still RuntimeErrors, as they were); the launcher's ``Interrupted`` is
    control flow, outside it, and no ``except Exception`` on its way can swallow it."""
    from harness.commands.launcher import Interrupted
    from harness.run.hosts.pool import PoolBroken
    from harness.run.world.dist_world import DeadRankError, WorldBroken

    for error in (PoolBroken, WorldBroken, DeadRankError):
        assert issubclass(error, harness.ClipcheckError) and issubclass(error, RuntimeError), error
    assert issubclass(Interrupted, BaseException) and not issubclass(Interrupted, Exception)
    assert not issubclass(Interrupted, harness.ClipcheckError)


def test_the_three_reports_read_alike():
    """``CheckReport``, ``AuditReport`` and ``FuzzReport``: ``passed``, ``describe() -> str`` and their records."""
    for report in (harness.CheckReport, harness.AuditReport, harness.FuzzReport):
        assert isinstance(report.passed, property), report
        assert typing.get_type_hints(report.describe)["return"] is str, report
    assert "records" in {f.name for f in dataclasses.fields(harness.CheckReport)}
    assert callable(harness.AuditReport.record) and callable(harness.FuzzReport.record)


class _PoolThatDoesNotStart(RankPool):
    """A warm world whose ranks never join: ``run`` raises as ``RankPool.start`` does then (after
    ``answers`` calls that do run)."""

    def __init__(self, answers: int) -> None:
        super().__init__(2)
        self.answers = answers

    def run(self, fn, *args, **kwargs):
        if self.answers <= 0:
            raise PoolBroken("a world of 2 ranks did not start: rank 1: died")
        self.answers -= 1
        return []


@pytest.mark.parametrize("answers", [0, 1], ids=["at-once", "after-forget-blame"])
def test_a_world_that_does_not_start_is_reported_not_raised(answers):
    """``PoolBroken`` reaching ``check`` once crashed it with a bare RuntimeError (every record lost): the
    world's cases not run are ERROR records, ``not_run``, and the status is 3, as ``clipcheck run``'s."""
    report = harness.check(reference, scenarios=["dense_dp"], worlds=[2], dtypes=["fp32"], norm_types=[2],
                           clip_ratios=[0.5, 2.0], variant="replicated", pools={2: _PoolThatDoesNotStart(answers)})
    assert report.status == EXIT_BROKEN and not report.passed
    assert len(report.cases) == 2 and all(c["verdict"] == "ERROR" and "not_run" in c["checks"] for c in report.cases)
    assert "did not start: rank 1: died" in report.describe()
