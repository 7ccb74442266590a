"""Run a case, and when its norm is wrong, the one-group sub-cases that say which parameters to blame.

Every rank runs the same sub-cases in lockstep (they are collectives of the target's), so the
decision is rank 0's verdict, shared through the store. The weights and the words are
``harness.judge.blame``'s; a sub-case that hangs or kills a rank breaks the world as the case itself
would, and is reported the same way.
"""

from __future__ import annotations

from harness.judge.blame import additivity_note, blame_reason, blamed_rank, group_only, parameter_groups, weigh
from harness.judge.checks import CaseResult
from harness.run.runner import run_case
from harness.run.world import DistWorld
from harness.spec.case import CaseSpec
from harness.spec.scenario import Scenario
from harness.targets.target import Target


def run_case_with_blame(world: DistWorld, case: CaseSpec, scenario: Scenario, target: Target,
                        blame: bool) -> CaseResult | None:
    """``run_case``; with ``blame``, a failing norm's result carries the weight of each parameter group."""
    result = run_case(world, case, scenario, target)
    if not blame or case.skip is not None:
        return result
    wanted = world.allgather_json("blame", world.rank == 0 and result is not None and blame_reason(result) is None,
                                  world.timeout_s)[0]
    if not wanted:
        return result
    groups = parameter_groups([s.name for s in case.layout.trainable])
    subs = [run_case(world, group_only(case, params), scenario, target) for params in groups.values()]
    if result is None:
        return None
    judged = [s for s in subs if s is not None]
    rank = blamed_rank(result)
    result.blame = [weigh(group, params, sub, case.norm_type, result.param_mismatches, rank)
                    for (group, params), sub in zip(groups.items(), judged)]
    result.blame_rank = rank
    note = additivity_note(result, judged, rank)
    if note is not None:
        result.blame_note = note
    return result
