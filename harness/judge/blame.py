"""Per-parameter blame: the weight a clip function gives each parameter group.

A correct p-norm counts every logical gradient element once: ``norm^p = sum over groups of
true_g^p``. Re-running the target with gradients in one group only (every other gradient zero,
present, not None) isolates that group: ``weight_g = (reported_g / true_g)^p`` is the multiplicity
the target assigns it (1 once, 1/4 when it is counted on one EP rank of four, 2 when a tied copy is
counted twice). These are the pure parts: grouping, the one-group case, the weights and the words.
``harness.run.case.blame_reruns`` runs the sub-cases.

What it cannot attribute, and says so: an inf norm (a max, not a sum over groups), a case with
non-finite gradients, a group whose run raised or reported nothing, and a clip that is not linear in
the groups' p-th powers (the weights then do not add up to the full case: a note says by how much).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Collection, Mapping, Sequence

from harness.judge.records import CaseResult, GroupWeight, Replication, StatsTable
from harness.cases.variant import CaseSpec, bound_label



BlameKey = tuple[str, str, str, str, str, float, str]

NO_GRADIENT = "no gradient on this layout"

BLAME_MODES = ("auto", "all", "off")
"""When to weigh the groups of a case whose norm is wrong: ``auto`` once per (scenario, layout, target,
norm, dtype) in a launch, reused for the same failing norm under another bound; ``all`` every failing
case afresh; ``off`` never, and no group of a right norm is run alone either (counting established per
group: ``harness.judge.establishment``; those its band cannot see are recorded as not established)."""

ADDITIVE_RTOL = 1e-3
"""How far the full case's reported norm^p may be from the sum of the groups' before the clip is
called non-linear in them (well above the fp32/bf16 rounding of a norm^p, well below a counting bug)."""


def weight_line(group: GroupWeight, tolerance: float) -> str:
    """One group's weight in words: ``layers.*.lora_A: counted 1/4 of its true weight (...)``."""
    what = group.note if group.weight is None else describe_weight(group.weight, tolerance)
    extra = f" ({group.note})" if group.weight is not None and group.note else ""
    return f"{group.group}: {what}{extra}"


def group_name(param: str) -> str:
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", param)


def parameter_groups(names: Sequence[str],
                     present: Mapping[str, frozenset[int] | None] | None = None) -> dict[str, list[str]]:
    """Parameters grouped by name with their indices as ``*``, in first-seen order; with ``present``
    (each parameter's ranks, None for all), parameters held by different ranks stay apart, so that a
    pipeline stage a clip drops is one group of its own (``layers.* (ranks 2, 3)``)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        ranks = (present or {}).get(name)
        where = "" if ranks is None else f" (ranks {', '.join(map(str, sorted(ranks)))})"
        groups.setdefault(group_name(name) + where, []).append(name)
    return groups


def case_groups(case: CaseSpec) -> dict[str, list[str]]:
    """The groups of a case's trainable parameters (``parameter_groups``, by the ranks that hold them): what
    the blame weighs."""
    trainable = case.layout.trainable
    return parameter_groups([s.name for s in trainable], {s.name: s.present_ranks for s in trainable})


def counting_groups(case: CaseSpec, pre: Replication) -> dict[str, list[str]]:
    """The groups counting is established for (``harness.judge.establishment``): the case's, merged where one
    class of bits is held under two names (``tied_groups``), so that no group is ever run without its copies:
    a tied pair with one half zeroed is a state no trainer reaches, where a clip that counts one copy is right."""
    return tied_groups(case_groups(case), pre.classes or {})


def tied_groups(groups: Mapping[str, Sequence[str]],
               classes: Mapping[str, Sequence[str | None]]) -> dict[str, list[str]]:
    """``groups`` merged wherever one class of bits (``Replication.classes``) has holdings in two of them (a
    weight tied between the first and the last pipeline stage: ``embed (ranks 0) + head (ranks 3)``), so that
    each class lies in one group and the groups' true p-th powers add up to the case's."""
    owner: dict[str, str] = {}  # class key -> the group that holds it first
    merged: dict[str, str] = {group: group for group in groups}

    def find(group: str) -> str:
        while merged[group] != group:
            group = merged[group]
        return group

    for group, params in groups.items():
        for name in params:
            for key in classes.get(name, ()):
                if key is None:
                    continue
                first = owner.setdefault(key, group)
                a, b = find(first), find(group)
                if a != b:
                    merged[b] = a
    out: dict[str, list[str]] = {}
    names: dict[str, list[str]] = {}
    for group, params in groups.items():
        root = find(group)
        out.setdefault(root, []).extend(params)
        names.setdefault(root, []).append(group)
    return {" + ".join(names[root]): params for root, params in out.items()}


def group_tables(stats: StatsTable, pre: Replication, group: Collection[str]) -> tuple[StatsTable, Replication]:
    """The statistics and classes of the case with only ``group``'s gradients (every other one zero): a
    class's holdings outside the group become keys of their own, so the group's truth counts each class
    it holds once (a copy tied under a name outside the group was zero)."""
    classes = pre.classes or {}
    sub_stats = StatsTable(stats.names, stats.numel, stats.itemsize,
                           [[v if n in group else 0.0 for n, v in zip(stats.names, row)] for row in stats.pow_sum],
                           kernel_error=None if stats.kernel_error is None else
                           [[e if n in group else 0.0 for n, e in zip(stats.names, row)] for row in stats.kernel_error],
                           flat_error=stats.flat_error)  # the whole rank's buffer: at least as long as the group's
    sub_pre = Replication(pre.distinct, {n: [k if n in group or k is None else f"zeroed|{r}|{n}"
                                             for r, k in enumerate(keys)] for n, keys in classes.items()})
    return sub_stats, sub_pre


def group_only(case: CaseSpec, params: Sequence[str]) -> CaseSpec:
    """``case`` with every trainable gradient outside ``params`` zero (present, so no code path that
    skips a missing gradient is taken that the full case did not take)."""
    injection = case.injection
    others = {s.name for s in case.layout.trainable} - set(params)
    sub_injection = dataclasses.replace(injection, zero=injection.zero | others)
    return dataclasses.replace(case, variant=dataclasses.replace(case.variant, injection=sub_injection))


def blame_reason(result: CaseResult) -> str | None:
    """Why ``result`` is not blamed (None: blame it). Only a wrong norm of a finite p-norm is."""
    case = result.case
    if result.verdict != "FAIL" or not any(c.name == "norm" for c in result.failed):
        return "the norm is right"
    if not math.isfinite(case.norm_type):
        return "an inf norm is a max, not a sum over groups"
    if case.injection.nonfinite or not math.isfinite(result.truth) or result.truth == 0:
        return "non-finite or zero gradients"
    return None


def blamed_rank(result: CaseResult) -> int:
    """The rank whose report is farthest from the true norm (ranks may disagree: a missing reduction
    is wrong differently on each); its reports are the ones weighed. Rank 0 on a tie."""
    def distance(value: float | None) -> float:
        if value is None or not math.isfinite(value):
            return -1.0
        return math.inf if value <= 0 else abs(math.log(value / result.truth))
    return max(range(len(result.reported)), key=lambda r: (distance(result.reported[r]), -r), default=0)


def weigh(group: str, params: Sequence[str], sub: CaseResult, norm_type: float,
          mismatches: Mapping[str, Sequence[str]], rank: int = 0) -> GroupWeight:
    """The weight of one group from its one-group run ``sub``, as ``rank`` reports it."""
    reported = sub.reported[rank] if len(sub.reported) > rank else None
    contradiction = "; ".join(dict.fromkeys(k for p in params for k in mismatches.get(p, ())))
    if sub.truth == 0:
        return GroupWeight(group, len(params), None, NO_GRADIENT)
    if reported is None or not math.isfinite(reported):
        failed = ", ".join(c.name for c in sub.failed) or "no report"
        return GroupWeight(group, len(params), None, f"not attributable: its run gave no finite norm ({failed})")
    return GroupWeight(group, len(params), (reported / sub.truth) ** norm_type, contradiction)


def additivity_note(full: CaseResult, subs: Sequence[CaseResult], rank: int = 0) -> str | None:
    """A note when the groups' norm^p (as ``rank`` reports them) do not add up to the full case's:
    the clip is not linear in them, so each weight holds for its group alone."""
    p = full.case.norm_type
    reported = full.reported[rank] if len(full.reported) > rank else None
    parts = [x for s in subs if len(s.reported) > rank and (x := s.reported[rank]) is not None]
    if reported is None or len(parts) != len(subs) or not all(map(math.isfinite, [reported, *parts])):
        return None
    total = sum(x ** p for x in parts)
    whole = reported ** p
    if abs(total - whole) <= ADDITIVE_RTOL * max(whole, total):
        return None
    return (f"not additive over the groups (sum of the groups' norm^p {total:.6g} vs the full case's {whole:.6g}):"
            " the clip is not linear in them, each weight holds for its group alone")


def blame_key(case: CaseSpec) -> BlameKey:
    """What a weighing holds for: the same layout (drawn layouts may share a label: the layout and the
    injection themselves are compared), target, norm type and dtype, under any bound."""
    variant = case.variant
    return (case.scenario, variant.label, repr(variant.layout), repr(variant.injection), case.target, case.norm_type,
            case.injection.dtype)


def reuse_blame(blamed: Mapping[BlameKey, CaseResult], result: CaseResult) -> bool:
    """Give ``result`` the weighing of an earlier case of this launch with the same ``blame_key``, when
    the target reported exactly the same norms there (bit for bit: the clip's norm did not depend on
    the bound, so neither do its groups' norms), saying which case it was weighed on; True when it
    did. Bounds a launch's blame cost to one weighing per layout, target, norm and dtype."""
    earlier = blamed.get(blame_key(result.case))
    if earlier is None or [repr(v) for v in earlier.reported] != [repr(v) for v in result.reported]:
        return False
    result.blame, result.blame_rank = list(earlier.blame), earlier.blame_rank
    weighed = f"weighed on case {earlier.case.index} (bound {bound_label(earlier.case.clip_ratio, earlier.case.max_norm)}), " \
              "which reported the same norms"
    result.blame_note = f"{earlier.blame_note}; {weighed}" if earlier.blame_note else weighed
    result.signature = [line for line in result.signature if line in earlier.signature]
    return True


def blame_tolerance(norm_tolerance: float) -> float:
    """How close a weight must be to 1 (or 1/k, k) to be read as exact, given the case's norm
    tolerance: a norm^2 carries twice the norm's relative error, and the group's true norm its own."""
    return 4 * norm_tolerance


def blame_summary(result: CaseResult) -> str | None:
    """The blame in one line, as the table prints it under every case whose norm is wrong: the
    groups not counted once (the first two), how many were, and whether the weights add up."""
    if not result.blame:
        return None
    tolerance = blame_tolerance(result.tolerance)
    held = [g for g in result.blame if g.note != NO_GRADIENT]
    off = sorted((g for g in held if g.weight is None or abs(g.weight - 1) > tolerance),
                 key=lambda g: g.weight is None)  # the weighed ones first: they say what is wrong
    parts = [weight_line(g, tolerance) for g in off[:2]]
    if len(off) > 2:
        parts.append(f"+{len(off) - 2} more groups off")
    once = len(held) - len(off)
    if once:
        parts.append(f"{once} other group{'s' if once > 1 else ''} counted once")
    if result.blame_note.startswith("not additive"):
        parts.append("not additive over the groups (each weight holds for its group alone)")
    if result.blame_rank:
        parts.append(f"as rank {result.blame_rank} reports it")
    return "; ".join(parts)


def blame_lines(result: CaseResult) -> list[str]:
    """What the table, JUnit and fuzz print for a blamed case: one line per group, then the note."""
    if not result.blame:
        return []
    tolerance = blame_tolerance(result.tolerance)
    whose = [f"weights as rank {result.blame_rank} reports them (the rank farthest from the true norm)"] \
        if result.blame_rank else []
    return whose + [weight_line(g, tolerance) for g in result.blame] + ([result.blame_note] if result.blame_note else [])


def describe_weight(weight: float, tolerance: float) -> str:
    """'counted once', 'counted 1/4 of its true weight', 'counted 2 times', 'counted 0.37x ...'."""
    if weight == 0:
        return "not counted at all"
    if abs(weight - 1) <= tolerance:
        return "counted once (its true weight)"
    k = round(1 / weight) if weight < 1 else round(weight)
    exact = k >= 2 and abs((1 / weight if weight < 1 else weight) - k) <= tolerance * k
    if weight < 1:
        return f"counted 1/{k} of its true weight" if exact else f"counted {weight:.4g} of its true weight"
    return f"counted {k} times" if exact else f"counted {weight:.4g}x its true weight"
