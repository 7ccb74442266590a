"""Counting established per group: which parameter groups a case's own norm shows miscounted, and the verdict
of the runs in which each of the others holds the whole norm.

A miscount moves the norm by a factor that grows with the miscounted group's share of it: a small group counted
twice hides inside any dtype's band. So each group of a case (``blame.counting_groups``: the blame's groups, tied copies together)
is established either by the case itself, where the weakest miscount of it moves the norm past ``MARGIN``
bands, or by its own run (``blame.group_only``: every other gradient zero, present), where it dominates and any
miscount moves the norm by its full factor. These are the pure parts; ``harness.run.case.blame_reruns`` runs
the groups' cases, and ``soundness.md`` (the design notes) says why dominance.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

from harness.cases.variant import CaseSpec
from harness.judge.blame import NO_GRADIENT, blame_tolerance, counting_groups, weigh, weight_line
from harness.judge.records import CaseResult, Check, GroupWeight, Replication, StatsTable
from harness.judge.truth import Copies, first_holdings

MARGIN = 2.0
"""How many bands the weakest miscount of a group must move the norm for the case itself to establish the
group: the arithmetic of a correct clip may take back up to one band in the other direction."""

BY_THE_CASE = "by the case"
NOT_ESTABLISHED = "not established"
IN_ITS_OWN_RUN = "in its own run"


def weakest_miscounts(stats: StatsTable, copies: Copies, norm_type: float, truth: float,
                      groups: Mapping[str, Sequence[str]]) -> dict[str, float]:
    """Per group, how far (relative) the weakest miscount of the whole group moves the case's norm. For a
    p-norm the smaller of: the group counted twice, and counted half (once instead of k = 2 times: on one
    rank of two, or divided by two; left out and 1/k for larger k move it further). For the inf norm only
    leaving it out can move a max: by how far the max falls without it (0 where the group does not hold the
    max). A group with no gradient is left out: nothing to count."""
    if not truth > 0 or not math.isfinite(truth):
        return {}
    group_of = {name: group for group, names in groups.items() for name in names}
    held: dict[str, list[float]] = {group: [] for group in groups}
    for r, row in enumerate(first_holdings(copies)):
        for k in row:
            group = group_of.get(stats.names[k])
            if group is not None and stats.pow_sum[r][k] > 0:
                held[group].append(stats.pow_sum[r][k])
    if math.isinf(norm_type):
        return {group: _max_moved(values, held, group, truth) for group, values in held.items() if values}
    total = truth ** norm_type
    out = {}
    for group, values in held.items():
        if values:
            share = min(1.0, sum(values) / total)
            out[group] = min((1 + share) ** (1 / norm_type) - 1, 1 - (1 - share / 2) ** (1 / norm_type))
    return out


def counting_reach(case: CaseSpec, stats: StatsTable, pre: Replication, copies: Copies,
                   truth: float) -> tuple[dict[str, list[str]], dict[str, float]]:
    """A judged case's groups (``blame.counting_groups``) and how far each one's weakest miscount moves its norm
    (``weakest_miscounts``; none where the truth is not finite): what ``checks.evaluate`` keeps on the result."""
    groups = counting_groups(case, pre)
    return groups, weakest_miscounts(stats, copies, case.norm_type, truth, groups)


def _max_moved(values: Sequence[float], held: Mapping[str, Sequence[float]], group: str, truth: float) -> float:
    """How far the inf norm falls when ``group`` is left out (0 when it does not hold the max)."""
    if max(values) < truth:
        return 0.0
    elsewhere = max((v for other, vs in held.items() if other != group for v in vs), default=0.0)
    return 1 - min(elsewhere, truth) / truth


def establishable(result: CaseResult) -> bool:
    """Whether counting is established on this case: its norm within the band (a wrong norm is the blame's, every
    group weighed; one whose arithmetic is off is already an ``arithmetic`` FAIL, and its groups' own runs would
    mix that arithmetic into their counts), of finite, non-zero gradients."""
    case = result.case
    within = any(c.name == "norm" and c.passed for c in result.checks)
    return (result.verdict in ("PASS", "FAIL") and within and not case.injection.nonfinite
            and math.isfinite(result.truth) and result.truth > 0)


def hidden(move: float, rtol: float) -> bool:
    """Whether a band of ``rtol`` can hide a miscount that moves the norm by ``move`` (``MARGIN`` bands)."""
    return move <= MARGIN * rtol


def unseen(moved: Mapping[str, float], rtol: float) -> list[str]:
    """The groups whose weakest miscount the case's band can hide (``hidden``): those to run alone."""
    return [group for group, move in moved.items() if hidden(move, rtol)]


def to_run_alone(result: CaseResult) -> dict[str, list[str]] | None:
    """The groups of a case to run alone (``unseen``), with their parameters; None where counting is not
    established on the case (``establishable``)."""
    if not establishable(result):
        return None
    return {group: result.groups[group] for group in unseen(result.moved, result.tolerance)}


def establish(result: CaseResult, runs: Mapping[str, CaseResult | None], where: str = "") -> CaseResult:
    """``result`` with ``counting`` (how each of its groups was established, or why not) and, when a group's own
    run shows it miscounted, a failing check ``counting`` in the blame's words for that group. ``runs``: the
    groups run alone (their results, None where the run gave none; empty where none was run); ``where``: on
    which earlier case they ran, when reused. A case on which counting is not established (``establishable``)
    is returned as it is."""
    if not establishable(result):
        return result
    moved = result.moved
    counting: dict[str, str] = {}
    wrong: list[GroupWeight] = []
    for group, params in result.groups.items():
        if group in runs:
            sub = runs[group]
            outcome = _own_run(group, params, sub, result)
            if isinstance(outcome, GroupWeight):
                wrong.append(outcome)
                counting[group] = f"miscounted {IN_ITS_OWN_RUN}{where}"
            else:
                counting[group] = outcome + where
        elif group in moved and not hidden(moved[group], result.tolerance):
            counting[group] = f"{BY_THE_CASE} (its weakest miscount moves the norm {moved[group]:.2g})"
        elif group in moved:
            counting[group] = (f"{NOT_ESTABLISHED}: its weakest miscount moves the norm {moved[group]:.2g}, inside the "
                               f"band, and it was not run alone")
    result.counting = counting
    if wrong:
        tolerance = blame_tolerance(result.tolerance)
        one = len(wrong) == 1
        result.checks.append(Check(
            "counting", False,
            f"in {'its' if one else 'their'} own run{'' if one else 's'}{where}, where {'it holds' if one else 'each holds'}"
            f" the whole norm: {'; '.join(weight_line(g, tolerance) for g in wrong)} (in this case "
            f"{'its' if one else 'their'} miscount hides inside the band)"))
        if result.verdict == "PASS":
            result.verdict = "FAIL"
    return result


def _own_run(group: str, params: Sequence[str], sub: CaseResult | None, result: CaseResult) -> GroupWeight | str:
    """The group's own run read: its weight when the run's norm is wrong (a miscount), else how it stands."""
    if sub is None or sub.verdict == "ERROR":
        return f"{NOT_ESTABLISHED}: its own run was not judged"
    norm = next((c for c in sub.checks if c.name == "norm"), None)
    if norm is None and any(c.name == "arithmetic" for c in sub.checks):
        return IN_ITS_OWN_RUN  # off by less than any miscount of it: counted right, its arithmetic the case's
    if norm is None:
        return f"{NOT_ESTABLISHED}: its own run gave no norm ({', '.join(c.name for c in sub.failed) or 'no report'})"
    if norm.passed:
        return IN_ITS_OWN_RUN
    if math.isinf(result.case.norm_type):  # a max has no weight: how far its max fell (or rose) says it
        reported = sub.reported[0] if sub.reported else None
        ratio = "no norm" if reported is None or not sub.truth else f"{reported / sub.truth:.6g} x its max"
        return GroupWeight(group, len(params), None, f"reported {ratio}")
    weight = weigh(group, params, sub, result.case.norm_type, result.param_mismatches, 0)
    if weight.note == NO_GRADIENT:
        return "no gradient"
    return weight


def counting_line(countings: Iterable[Mapping[str, str]]) -> str | None:
    """One line for a run: ``counting established per group: `` and its ``counting_summary``."""
    summary = counting_summary(countings)
    return None if summary is None else f"counting established per group: {summary}"


def counting_summary(countings: Iterable[Mapping[str, str]]) -> str | None:
    """How many groups the cases established each way, and those not established (None when no case
    established any: all unjudged, or of non-finite gradients)."""
    by_case = own = 0
    missed: list[str] = []
    not_done: list[str] = []
    for counting in countings:
        for group, how in counting.items():
            by_case += how.startswith(BY_THE_CASE)
            own += how.startswith(IN_ITS_OWN_RUN)
            (missed if how.startswith("miscounted") else not_done if how.startswith(NOT_ESTABLISHED) else []).append(group)
    if not (by_case or own or missed or not_done):
        return None
    parts = [f"{by_case} group(s) by their case", f"{own} in their own runs"]
    if missed:
        parts.append(f"miscounted {len(missed)} ({', '.join(sorted(set(missed))[:3])})")
    if not_done:
        parts.append(f"not established {len(not_done)} ({', '.join(sorted(set(not_done))[:3])})")
    return ", ".join(parts)


__all__ = ["MARGIN", "weakest_miscounts", "counting_reach", "establishable", "unseen", "to_run_alone", "establish", "counting_line",
           "counting_summary"]
