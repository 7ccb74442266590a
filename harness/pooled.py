"""Cases on a warm world (``RankPool``) instead of a torchrun job: for the fuzzer, replays and
benchmarks, where a launch per case would cost seconds."""

from __future__ import annotations

from .case import CaseSpec
from .checks import CaseResult
from .pool import RankPool, current_world
from .registry import registered_targets
from .runner import run_case
from .scenario import Scenario
from .targets import resolve_target


class PoolRunError(RuntimeError):
    """A rank failed inside the harness itself (it hung, died, or lost its peers)."""


def run_case_task(case: CaseSpec, scenario: Scenario) -> CaseResult | None:
    """Runs on every rank of the pool; rank 0 returns the judged result."""
    target = resolve_target(case.target, registered_targets([scenario]))
    return run_case(current_world(), case, scenario, target)


def run_case_on_pool(pool: RankPool, case: CaseSpec, scenario: Scenario) -> CaseResult:
    results = pool.run(run_case_task, case, scenario)
    bad = [r for r in results if not r.ok]
    if bad:
        raise PoolRunError("; ".join(f"rank {r.rank} {r.status}: {(r.error or '').splitlines()[-1:]}" for r in bad))
    value = results[0].value
    assert isinstance(value, CaseResult)
    return value
