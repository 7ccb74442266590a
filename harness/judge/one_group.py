"""A wrong norm read as one parameter group's mistake, from the measured statistics alone.

The signatures of ``checks.evaluate`` price mistakes of the whole case (no cross-rank reduction, every
replica counted, a reduction skipped over one mesh axis). A real job's clip is more often wrong on one
group only (a tie counted on both pipeline stages, the experts' reduction skipped over ``ep``), and then
none of them matches. The blame finds the group by calling the clip again per group, which needs a copy
of the gradients (``harness.audit(restore=True)``); this reading needs none: each group's evidence is
built from its own statistics, and ``signatures.one_group_readings`` keeps a reading only where it prices
every rank's report within the tolerance. Used by ``harness.audit`` (``run/audit/session``), whose classes
of copies say which groups hold one logical gradient.
"""

from __future__ import annotations

from harness.judge.blame import blame_reason, group_tables, parameter_groups, tied_groups
from harness.judge.checks import declared_mismatches, evidence_of
from harness.judge.records import CaseResult, Evidence, Replication, StatsTable
from harness.judge.signatures import one_group_readings
from harness.judge.truth import measured_norm


def one_group_signature(result: CaseResult, stats: StatsTable, pre: Replication) -> list[str]:
    """``result``'s signature; where it has none although its norm is wrong and attributable
    (``blame.blame_reason``), the readings of one group's mistake. ``pre`` must carry the classes of
    copies (a measured case's): the groups are merged along them, so that each holds whole classes and
    their truths add up to the case's (``blame.tied_groups``)."""
    if result.signature or blame_reason(result) is not None or pre.classes is None:
        return list(result.signature)
    case = result.case
    present = {n: frozenset(r for r in range(stats.world_size) if stats.present(r, j))
               for j, n in enumerate(stats.names)}
    evidence: dict[str, Evidence] = {}
    for group, params in tied_groups(parameter_groups(stats.names, present), pre.classes).items():
        sub_stats, sub_pre = group_tables(stats, pre, set(params))
        truth = measured_norm(sub_stats, sub_pre, case.layout.mesh, case.norm_type)
        mismatches = declared_mismatches({n: result.param_mismatches[n] for n in params if n in result.param_mismatches})
        evidence[group] = evidence_of(case, truth, sub_stats, sub_pre, mismatches)
    return one_group_readings([v for v in result.reported if v is not None], result.truth, evidence, result.tolerance)
