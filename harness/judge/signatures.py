"""Explain a wrong norm by the mistake that produces it.

A bare ratio says little; "0.500000 = 1/sqrt(4): a group counted once instead of ep_size times" says
where to look. Each explanation is a *hypothesis computed from the case's own measured statistics*
(the per-rank local norms, the declared plan), never a table of expected numbers: a hypothesis is
reported only when its value matches what the target reported, within the dtype's tolerance.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence, cast

from harness.clipmath import is_inf_norm
from harness.cases.layout import MeshSpec
from harness.judge.records import Evidence
from harness.judge.truth import norms_agree


def _power_phrase(k: int, norm_type: float, inverse: bool) -> str:
    if norm_type == 2:
        body = f"sqrt({k})"
    elif norm_type == 1:
        body = f"{k}"
    else:
        return f"{k}^({'-' if inverse else ''}1/{norm_type:g})"
    return f"1/{body}" if inverse else body


def _group_name(k: int, mesh: MeshSpec) -> str:
    axes = [f"{d}_size" for d in mesh.names if mesh.size(d) == k]
    if axes:
        return " or ".join(axes)
    if k == mesh.world_size:
        return "world_size"
    return f"{k}"


def replica_factor(ratio: float, evidence: Evidence, rtol: float) -> str | None:
    """ratio == k^(-1/p): a group counted once instead of k times; k^(1/p): k times instead of once."""
    if is_inf_norm(evidence.norm_type) or not math.isfinite(ratio) or ratio <= 0:
        return None
    sizes = range(2, max(evidence.mesh.world_size, 2) + 1) if evidence.replica_counts is None \
        else sorted(evidence.replica_counts)  # a layout without replicas: no group can be miscounted
    for k in sizes:
        under = k ** (-1.0 / evidence.norm_type)
        if norms_agree(ratio, under, rtol):
            phrase = _power_phrase(k, evidence.norm_type, inverse=True)
            return f"{ratio:.6f} = {phrase}: a group counted once instead of {_group_name(k, evidence.mesh)} times"
        if norms_agree(ratio, 1.0 / under, rtol):
            phrase = _power_phrase(k, evidence.norm_type, inverse=False)
            return f"{ratio:.6f} = {phrase}: a group counted {_group_name(k, evidence.mesh)} times instead of once"
    return None


def _mismatch(reported: Sequence[float], candidate: Sequence[float]) -> float:
    """Largest relative distance between what each rank reported and a hypothesis's value."""
    worst = 0.0
    for r, c in zip(reported, candidate):
        if not (math.isfinite(r) and math.isfinite(c)):
            return math.inf
        worst = max(worst, abs(r - c) / max(abs(c), 1e-300))
    return worst


def candidates(evidence: Evidence, n: int) -> list[tuple[str, list[float]]]:
    """Every mechanism the evidence can price, with what each of ``n`` ranks would report under it."""
    local = list(evidence.local_norms)
    p = evidence.norm_type
    out: list[tuple[str, list[float]]] = []
    if evidence.declared_mismatches:
        mismatch = "; ".join(evidence.declared_mismatches[:3])
        more = len(evidence.declared_mismatches) - 3
        tail = f" (+{more} more)" if more > 0 else ""
        out.append((f"equals the norm implied by the declared placements, which are wrong: {mismatch}{tail}",
                    [evidence.declared_norm] * n))
    if len(local) == n and n > 1:
        out.append(("each rank reports its rank-local norm: no cross-rank reduction", local))
        out.append(("equals the mean of the rank-local norms: a root taken before the cross-rank average",
                    [sum(local) / n] * n))
        out.append(("equals the largest rank-local norm: partial norms merged with MAX", [max(local)] * n))
        if not is_inf_norm(p):
            every = sum(x**p for x in local) ** (1.0 / p)
            out.append(("equals the norm with every replica counted: no de-duplication of replicas", [every] * n))
    for axis, values in evidence.unreduced.items():
        if len(values) == n:
            out.append((f"each {axis} coordinate reports its own norm: no reduction over {axis}", list(values)))
            out.append((f"equals the largest norm of one {axis} coordinate: norms merged with MAX over {axis}",
                        [max(values)] * n))
    for axis, value in evidence.replicas_counted.items():
        out.append((f"equals the norm with copies along {axis} counted as distinct: {axis} replicas summed",
                    [value] * n))
    return out


CLIPPED_NORM = "equals max_norm: the norm after clipping reported, not the norm before it"


def explain(reported: Sequence[float], evidence: Evidence, rtol: float) -> list[str]:
    """The replica-factor reading of the ratio, plus the hypotheses that best match the reports.

    Several hypotheses can fall inside the tolerance by coincidence (the mean of nearly equal local
    norms is close to their root-mean-square), so only the closest ones are kept: those within 10x
    of the best match's distance. Two mechanisms can also give the very same number on one case (a
    clip that drops every later pipeline stage reports the largest stage norm whenever stage 0 is
    the largest): ``holds_on`` tries a hypothesis on other cases of the same layout (the blame's
    one-group runs) and the blame keeps only those that explain every one.
    """
    truth = evidence.truth
    if not reported or not math.isfinite(truth) or truth == 0:
        return []
    found: list[str] = []
    clipped = evidence.max_norm is not None and evidence.max_norm < truth
    if clipped and _mismatch(reported, [cast(float, evidence.max_norm)] * len(reported)) <= rtol:
        # the bound is the harness's own choice (x0.5 of the truth), so a report equal to it may be the norm
        # after clipping; it may as well be a replica miscount that happens to give 0.5 (1/sqrt(4)): both
        # readings are shown, and the same case under the other bound (x2) tells them apart
        found.append(CLIPPED_NORM)
    factor = replica_factor(reported[0] / truth, evidence, rtol)
    if factor:
        found.append(factor)
    n = len(reported)
    scored = [
        (_mismatch(reported, values), text)
        for text, values in candidates(evidence, n)
        if _mismatch([truth] * n, values) > rtol  # a hypothesis that equals the truth explains nothing
    ]
    scored = [(err, text) for err, text in scored if err <= rtol]
    if scored:
        best = min(err for err, _ in scored)
        found.extend(text for err, text in sorted(scored) if err <= max(10 * best, 1e-12))
    return found


ONE_GROUP = "every other group counted once"
"""The rest of a one-group reading (``one_group_readings``): what it assumes of the other groups."""


def group_candidates(evidence: Evidence, n: int) -> list[tuple[str, list[float]]]:
    """What one group's gradients (``evidence`` built from them alone) would give each of ``n`` ranks
    under each mistake: the mechanisms of ``candidates``, and its copies miscounted (once instead of k
    times, k times instead of once, k a replica count of the layout, as ``replica_factor`` reads the whole)."""
    out = candidates(evidence, n)
    if is_inf_norm(evidence.norm_type):
        return out
    sizes = range(2, max(evidence.mesh.world_size, 2) + 1) if evidence.replica_counts is None \
        else sorted(evidence.replica_counts)
    for k in sizes:
        under = k ** (-1.0 / evidence.norm_type)
        name = _group_name(k, evidence.mesh)
        out.append((f"counted once instead of {name} times", [evidence.truth * under] * n))
        out.append((f"counted {name} times instead of once", [evidence.truth / under] * n))
    return out


def one_group_readings(reported: Sequence[float], truth: float, groups: Mapping[str, Evidence],
                       rtol: float) -> list[str]:
    """A wrong norm read as one group's mistake, every other group counted once: the group's part of the
    p-th power sum replaced by what a mistake gives it (``group_candidates``), the rest kept. For what no
    mechanism of the whole case prices (a tie counted on both stages, one group's reduction skipped):
    these are priced from the measured statistics alone, as ``explain``'s are, without calling the clip
    again (the blame's one-group runs do that, and weigh each group). ``groups``: each group's evidence,
    the groups holding whole classes of copies (``blame.tied_groups``), so that their truths add up to
    ``truth``. Kept as ``explain`` keeps its lines: within the tolerance, and the closest ones only."""
    if not reported or not truth > 0 or not math.isfinite(truth):
        return []
    n = len(reported)
    scored: list[tuple[float, str]] = []
    for group, evidence in groups.items():
        p = evidence.norm_type
        if is_inf_norm(p) or not evidence.truth > 0 or not math.isfinite(evidence.truth):
            continue
        rest = max(truth ** p - evidence.truth ** p, 0.0)
        for text, values in group_candidates(evidence, n):
            if _mismatch([evidence.truth] * n, values) <= rtol:
                continue  # the group counted right under it: it explains nothing
            predicted = [(rest + v ** p) ** (1.0 / p) if math.isfinite(v) else v for v in values]
            error = _mismatch(reported, predicted)
            if error <= rtol < _mismatch([truth] * n, predicted):
                scored.append((error, f"{group}: {text}; {ONE_GROUP}"))
    if not scored:
        return []
    best = min(err for err, _ in scored)
    return [text for err, text in sorted(scored) if err <= max(10 * best, 1e-12)]


def holds_on(text: str, reported: Sequence[float], evidence: Evidence, rtol: float) -> bool:
    """Whether the mechanism ``text`` names (a line of ``explain``) also prices ``reported`` on another
    case of the same layout (a one-group run): the value it predicts there is what was reported, or,
    where the clip was right there, the truth. A reading of the ratio (``replica_factor``), which no
    other case needs to share, always holds; a case without a finite non-zero truth tests nothing."""
    if not math.isfinite(evidence.truth) or evidence.truth == 0 or not reported:
        return True
    predicted = next((values for name, values in candidates(evidence, len(reported)) if name == text), None)
    return predicted is None or _mismatch(reported, predicted) <= rtol  # nothing to test it with: no evidence against


def lying_plan_line(lies: Mapping[str, Sequence[str]], limit: int = 4) -> str:
    """The signature of a failure that only a lying declaration causes: the clip, run again on the
    same gradients with the honest plan, passed. ``lies``: per parameter, the axes it is declared
    wrong on."""
    by_axis: dict[str, list[str]] = {}
    for name, axes in lies.items():
        for axis in axes:
            by_axis.setdefault(axis, []).append(name.rsplit(".", 1)[-1])
    wrong = "; ".join(f"on {axis}: {', '.join(names[:limit])}" + (f" (+{len(names) - limit} more)" if len(names) > limit
                                                                   else "")
                      for axis, names in by_axis.items())
    return f"lying plan: exact on the honest plan (the same case passes with the true placements declared): " \
           f"fix the plan, not the clip ({wrong})"
