"""Run a case, and diagnose a failure: when its norm is wrong, the one-group sub-cases that say which
parameters to blame; when its layout's declared plan lies, the same case on the honest plan.

Every rank runs the same sub-cases in lockstep (they are collectives of the target's), so the
decision is rank 0's verdict, shared through the store. The weights and the words are
``harness.judge.blame``'s; a sub-case that hangs or kills a rank breaks the world as the case itself
would, and is reported the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from harness.judge.blame import (additivity_note, blame_key, blame_reason, blamed_rank, case_groups, group_only,
                                 reuse_blame, weigh)
from harness.judge.establishment import establish, to_run_alone
from harness.judge.signatures import lying_plan_line
from harness.judge.records import CaseResult
from harness.judge.checks import surviving_signature
from harness.run.case.launch_state import LaunchState
from harness.run.case.runner import run_case
from harness.run.world.dist_world import DistWorld
from harness.cases.variant import CaseSpec, plan_lies, with_honest_plan
from harness.cases.scenario import Scenario
from harness.cases.target import Target


def run_case_with_blame(world: DistWorld, launch: LaunchState, case: CaseSpec, scenario: Scenario, target: Target,
                        blame: str | bool = "auto") -> CaseResult | None:
    """``run_case``, then its re-runs (unless ``blame`` is off): when its norm is wrong, the weight of each
    parameter group (``blame``: ``harness.judge.blame.BLAME_MODES``; True is ``all``, False ``off``); when it
    is right, the groups its band cannot see, each alone (``establishment``); when its layout's declared plan
    lies, whether the clip is exact on the honest plan. Rank 0 decides from the case's result, and one store
    round tells every rank."""
    mode = ("all" if blame else "off") if isinstance(blame, bool) else blame
    result = run_case(world, launch, case, scenario, target)
    if case.skip is not None:
        return result
    if mode == "off":  # no re-run at all: the groups the case cannot see are recorded as not established
        return establish(result, {}) if result is not None else result
    decided = None
    if world.rank == 0:
        decided = {"blame": _blame_wanted(launch, mode, result), "honest": _honest_wanted(launch, case, result),
                   "establish": _to_establish(launch, result)}
    decisions = world.allgather_json("diagnose", decided, world.timeout_s)[0]
    if decisions["blame"]:
        result = _weighed(world, launch, case, scenario, target, result)
    result = _established(world, launch, case, scenario, target, result, decisions["establish"])
    return _tried_on_the_honest_plan(world, launch, case, scenario, target, result, decisions["honest"])


def _blame_wanted(launch: LaunchState, mode: str, result: CaseResult | None) -> bool:
    """Rank 0: whether the groups of this case are to be weighed (a wrong norm, not weighed on an earlier
    case of its layout in ``auto``)."""
    if result is None or blame_reason(result) is not None:
        return False
    return not (mode == "auto" and reuse_blame(launch.blamed, result))


def _weighed(world: DistWorld, launch: LaunchState, case: CaseSpec, scenario: Scenario, target: Target,
             result: CaseResult | None) -> CaseResult | None:
    groups = case_groups(case)
    subs = [run_case(world, launch, group_only(case, params), scenario, target, effects_measured=False)
            for params in groups.values()]
    if result is None:
        return None
    weigh_groups(result, groups, [s for s in subs if s is not None])
    launch.blamed[blame_key(result.case)] = result
    return result


def weigh_groups(result: CaseResult, groups: Mapping[str, Sequence[str]], subs: Sequence[CaseResult]) -> CaseResult:
    """Rank 0: ``result`` with the weight of each group from its one-group run (``subs``, in the order of
    ``groups``), the note when they do not add up, and the signature lines every run supports. Shared by
    the harness's cases and ``harness.audit`` (which runs the groups in the user's own job)."""
    rank = blamed_rank(result)
    result.blame = [weigh(group, params, sub, result.case.norm_type, result.param_mismatches, rank)
                    for (group, params), sub in zip(groups.items(), subs)]
    result.blame_rank = rank
    note = additivity_note(result, subs, rank)
    if note is not None:
        result.blame_note = note
    result.signature = surviving_signature(result, subs)  # each one-group run tests the signature's mechanisms
    return result


def _to_establish(launch: LaunchState, result: CaseResult | None) -> dict[str, list[str]] | None:
    """Rank 0: the groups of this case to run alone, with their parameters (``establishment.to_run_alone``), {} where
    the case itself establishes every one, None where counting is not established here: the norm is wrong
    (the blame weighs every group), not judged, or of non-finite or zero gradients."""
    if result is None:
        return None
    alone = to_run_alone(result)
    if alone is not None and blame_key(result.case) in launch.established:
        return {}  # run alone on an earlier case of the same layout, target, norm and dtype: reused
    return alone


def _established(world: DistWorld, launch: LaunchState, case: CaseSpec, scenario: Scenario, target: Target,
                 result: CaseResult | None, to_run: dict[str, list[str]] | None) -> CaseResult | None:
    """Every rank runs the groups rank 0 named alone, in lockstep; rank 0 reads them into ``result``
    (``establishment.establish``), or reuses the runs of an earlier case of the same key."""
    if to_run is None:
        return result
    runs = {group: run_case(world, launch, group_only(case, params), scenario, target, effects_measured=False)
            for group, params in to_run.items()}
    if result is None:
        return None
    key = blame_key(case)
    where = ""
    if key in launch.established:
        index, runs = launch.established[key]
        where = f" on case {index}"
    else:
        launch.established[key] = (case.index, runs)
    return establish(result, runs, where)


def _honest_wanted(launch: LaunchState, case: CaseSpec, result: CaseResult | None) -> bool:
    """Rank 0: whether this failing case's lying plan is to be tried once more on the honest plan (once per
    layout, target, norm and dtype: ``launch.honest``)."""
    return (result is not None and result.verdict == "FAIL" and bool(plan_lies(case.variant))
            and blame_key(case) not in launch.honest)


def _tried_on_the_honest_plan(world: DistWorld, launch: LaunchState, case: CaseSpec, scenario: Scenario, target: Target,
                              result: CaseResult | None, wanted: bool) -> CaseResult | None:
    """A failing case whose declared plan lies, run once more with the honest plan (``wanted``: rank 0's
    decision, on every rank): when it then passes, the failure comes from the declaration alone, and the
    result says so (fix the plan, not the clip)."""
    key = blame_key(case)
    if wanted:
        honest_case = dataclasses.replace(case, variant=with_honest_plan(case.variant))
        honest = run_case(world, launch, honest_case, scenario, target)
        if honest is not None:
            launch.honest[key] = honest.verdict == "PASS"
    if result is not None and launch.honest.get(key):
        result.signature = result.signature + [lying_plan_line(plan_lies(case.variant))]
    return result
