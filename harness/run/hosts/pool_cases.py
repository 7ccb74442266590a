"""Cases on a warm world (``RankPool``) instead of a torchrun job: for the fuzzer, replays, the
``check`` API and benchmarks, where a launch per case would cost seconds."""

from __future__ import annotations

from harness.cases.variant import CaseSpec
from harness.judge.records import CaseResult
from harness.judge.checks import unjudged_result
from harness.run.hosts.pool import RankPool, RankResult, current_launch, current_world
from harness.targets.registry import registered_targets
from harness.run.case.blame_reruns import run_case_with_blame
from harness.cases.scenario import Scenario
from harness.targets.target import resolve_target


def run_case_task(case: CaseSpec, scenario: Scenario, blame: bool | str = False) -> CaseResult | None:
    """Runs on every rank of the pool; rank 0 returns the judged result."""
    target = resolve_target(case.target, registered_targets([scenario]))
    launch = current_launch()
    try:
        return run_case_with_blame(current_world(), launch, case, scenario, target, blame)
    finally:  # nothing checks a pool case's model again: let it (and the groups it holds) go
        launch.late_watch = None


def forget_blame() -> None:
    """Runs on every rank of the pool: a new plan starts, so no weighing of an earlier one is reused
    (a warm world outlives plans, and the same target name may now be another function)."""
    current_launch().forget_plan()


def _last_line(result: RankResult) -> str:
    lines = (result.error or "").strip().splitlines()
    return lines[-1] if lines else result.status


def run_case_on_pool(pool: RankPool, case: CaseSpec, scenario: Scenario, blame: bool | str = False) -> CaseResult:
    """The judged case; a case the pool could not judge (a rank hung, died, or the harness itself
    raised on a rank) is an ERROR result naming the ranks and why (the pool restarts itself)."""
    results = pool.run(run_case_task, case, scenario, blame)
    bad = [r for r in results if not r.ok]
    if not bad:
        value = results[0].value
        assert isinstance(value, CaseResult)
        return value
    hung = [r for r in bad if r.status == "hung" or "WorldBroken" in (r.error or "")]
    check = "hang" if hung else "crash"
    primary = [r for r in bad if r.status in ("hung", "died")] or bad
    # the others too (a rank that raised is often what left the hung one waiting), in one line each
    detail = "; ".join([*(f"rank {r.rank} {r.status}: {(r.error or '').strip()}" if r.status == "hung"
                          else f"rank {r.rank} {r.status}: {_last_line(r)}" for r in primary),
                        *(f"rank {r.rank} {r.status}: {_last_line(r)}" for r in bad
                          if r not in primary and r.status != "collateral")])
    return unjudged_result(case, check, detail, pool.world_size)
