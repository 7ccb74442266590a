"""Run a case, and when its norm is wrong, the one-group sub-cases that say which parameters to blame.

Every rank runs the same sub-cases in lockstep (they are collectives of the target's), so the
decision is rank 0's verdict, shared through the store. The weights and the words are
``harness.judge.blame``'s; a sub-case that hangs or kills a rank breaks the world as the case itself
would, and is reported the same way.
"""

from __future__ import annotations

from harness.judge.blame import (additivity_note, blame_key, blame_reason, blamed_rank, group_only, parameter_groups,
                                 reuse_blame, weigh)
from harness.judge.checks import CaseResult, surviving_signature
from harness.run.runner import run_case
from harness.run.world import DistWorld
from harness.spec.case import CaseSpec
from harness.spec.scenario import Scenario
from harness.targets.target import Target


def run_case_with_blame(world: DistWorld, case: CaseSpec, scenario: Scenario, target: Target,
                        blame: str | bool = "auto") -> CaseResult | None:
    """``run_case``; when its norm is wrong, the result carries the weight of each parameter group
    (``blame``: ``harness.judge.blame.BLAME_MODES``; True is ``all``, False ``off``)."""
    mode = {True: "all", False: "off"}.get(blame, blame) if isinstance(blame, bool) else blame
    result = run_case(world, case, scenario, target)
    if mode == "off" or case.skip is not None:
        return result
    decision = None
    if world.rank == 0 and result is not None and blame_reason(result) is None:
        decision = "reuse" if mode == "auto" and reuse_blame(world.blamed, result) else "run"
    if not world.allgather_json("blame", decision == "run", world.timeout_s)[0]:
        return result
    groups = parameter_groups([s.name for s in case.layout.trainable],
                              {s.name: s.present_ranks for s in case.layout.trainable})
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
    result.signature = surviving_signature(result, judged)  # each one-group run tests the signature's mechanisms
    world.blamed[blame_key(result.case)] = result
    return result
