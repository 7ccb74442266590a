"""The per-case checks, judged on rank 0 from every rank's record.

Each check answers one question a user would ask of a clip function:

* ``truth``        harness self-check: measured (MAX-MIN) truth == constructive (float64) truth.
* ``raised``       did the function finish on every rank?
* ``norm``         is the reported norm the true global norm (tolerance by dtype)?
* ``agree``        does every rank report the same norm?
* ``coefficient``  was every gradient scaled by min(1, max_norm / (true + eps)), uniformly?
* ``replicas``     are true replicas still bit-identical after clipping?
* ``contract``     no harness-detected fault: the return value is a number or a tensor, the default
                   process group survived, no gradient was deleted or replaced by another shape/dtype.
* ``params``       are the parameters themselves untouched (values, ``requires_grad``)?
* ``created``      did no gradient appear where there was none (frozen, or no tokens)?
* ``late``         does nothing change after the clip returned (threads it left behind)?
* ``nonfinite``    with a non-finite gradient, did every rank take the same deliberate action?

Each check is a ``CheckSpec`` in ``CHECKS``: its name, a small function of a ``Judgement`` (the case
and every rank's record) and the rank-local measurements it reads, which ``harness.run.case.effects``
produces; ``evaluate`` runs them in order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence, cast

from harness.cases.variant import CaseSpec
from harness.clipmath import clip_coefficient
from harness.cases.layout import MeshSpec, Replicate, Shard
from harness.judge.truth import (CROSS_CHECK_RTOL, Copies, declared_norm, first_holdings, measured_copies,
                                norms_agree, replicas_counted_on, unreduced_over)
from harness.judge.records import (CaseResult, Check, Evidence, RankLocalKey, RankRecord, Replication, StatsTable,
                                   Verdict)
from harness.judge.signatures import explain, holds_on
from harness.judge.band import Band, case_band
from harness.judge.establishment import counting_reach
from harness.judge.tolerance import UNIT_ROUNDOFF, coefficient_rtol, uniformity_bound


_COLLATERAL = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "timed out")


# -- on rank 0 -----------------------------------------------------------------------------------------
def placement_mismatches(
    declared: Mapping[str, Mapping[str, object]],
    replication: Replication,
    stats: StatsTable,
    mesh: MeshSpec,
) -> dict[str, list[str]]:
    """Per parameter, each mesh axis where its declared placement contradicts the measured one
    ("declared Replicate on ep, measured distinct"); parameters without a contradiction are left out."""
    found: dict[str, list[str]] = {}
    for j, name in enumerate(stats.names):
        all_zero = all(stats.pow_sum[r][j] == 0 for r in range(stats.world_size) if stats.present(r, j))
        for axis in mesh.names:
            if mesh.size(axis) == 1:
                continue
            placement = declared.get(name, {}).get(axis, Replicate())
            distinct = replication.distinct[axis][name]
            if isinstance(placement, Replicate) and distinct:
                key = f"declared Replicate on {axis}, measured distinct"
            elif isinstance(placement, Shard) and not distinct and not all_zero:
                key = f"declared {placement} on {axis}, measured replicated"
            else:
                continue
            found.setdefault(name, []).append(key)
    return found


def declared_mismatches(per_param: Mapping[str, Sequence[str]]) -> list[str]:
    """``placement_mismatches`` grouped for reading: one line per contradiction, naming its parameters."""
    groups: dict[str, list[str]] = {}
    for name, keys in per_param.items():
        for key in keys:
            groups.setdefault(key, []).append(name)
    return [f"{key}: {_names(names)}" for key, names in groups.items()]


def _names(names: Sequence[str], limit: int = 6) -> str:
    short = [n.rsplit(".", 2)[-1] if n.count(".") else n for n in names]
    text = ", ".join(short[:limit])
    if len(short) > limit:
        text += f", ... ({len(short)} params)"
    elif len(short) > 1:
        text += f" ({len(short)} params)"
    return text


def _full_names(names: Sequence[str], limit: int = 3) -> str:
    """Parameter names in full (``layers.0.weight``), the first ``limit`` of them and how many in all."""
    text = ", ".join(names[:limit])
    return text + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _collateral(error: str) -> bool:
    return any(marker in error for marker in _COLLATERAL)


def is_collateral(error: str) -> bool:
    """The error is a consequence of another rank's failure (a connection closed under it, a timeout)."""
    return _collateral(error)


def describe_errors(errors: Sequence[str | None]) -> str:
    """The root causes first (ranks with the same message together), then who failed in consequence
    (a peer's connection closing under it, or a timeout waiting for one)."""
    raised = [r for r, e in enumerate(errors) if e is not None]
    primary = [r for r in raised if not _collateral(cast(str, errors[r]))] or raised
    by_message: dict[str, list[int]] = {}
    for r in primary:
        by_message.setdefault(cast(str, errors[r]), []).append(r)
    shown = list(by_message.items())[:2]
    text = "; ".join(f"rank {ranks[0]}: {msg}" if len(ranks) == 1 else f"ranks {ranks}: {msg}" for msg, ranks in shown)
    others = sorted(set(raised) - {r for _, ranks in shown for r in ranks})
    if others:
        text += f" (ranks {others} failed in consequence)"
    return text



NONFINITE_ERROR = re.compile(r"non[- ]?finite|not finite|\bnans?\b|\binf(s|inite|inity)?\b|overflow", re.IGNORECASE)
"""What makes an exception a *deliberate* answer to a non-finite gradient: its message says so, as
torch's ``clip_grad_norm_(error_if_nonfinite=True)`` ("... is non-finite, so it cannot be clipped")
and DeepSpeed's overflow checks do ("not finite", "NaNs/Infs detected", "non finite" too). Raising
on every rank with such a message passes a non-finite case; any other exception, or a
harness-detected fault, never does."""


def _message(error: str) -> str:
    """The exception's own text, without the ``(at file:line)`` suffix (paths may say 'inf')."""
    return error.rsplit(" (at ", 1)[0]


def _fmt(x: float | None) -> str:
    return "none" if x is None else f"{x:.6g}"


def _fmt_rel(x: float) -> str:
    """A relative error, readable at any size (6e-08 as well as 0.3)."""
    return f"{x:.2g}"


@dataclass
class Judgement:
    """Everything rank 0 knows about one case once every rank has reported: the inputs of each check."""

    case: CaseSpec
    truth: float
    measured: float
    stats: StatsTable
    pre: Replication
    post: Replication
    records: Sequence[RankRecord]

    @functools.cached_property
    def band(self) -> Band:
        """The case's band (``harness.judge.band``): how far correct clips land on its gradients, replayed from
        what torch's own kernels were measured to do on them; its ``rtol`` is the norm's tolerance."""
        return case_band(self.stats, self.copies, self.case.norm_type, self.dtype)

    @functools.cached_property
    def copies(self) -> Copies:
        """The copies the raw bits showed (``truth.measured_copies``), found once for the band and the
        smallest miscount."""
        return measured_copies(self.stats, self.pre, self.mesh)

    @functools.cached_property
    def norm_reading(self) -> tuple[NormKind, str] | None:
        """Where the reported norms fall against the band (``read_norm``), read once for both norm checks."""
        return read_norm(self)

    @property
    def mesh(self) -> MeshSpec:
        """The mesh the case ran on: the replication checks walk its axes."""
        return self.case.layout.mesh

    @property
    def dtype(self) -> str:
        return self.case.injection.dtype

    @property
    def finite_truth(self) -> bool:
        return math.isfinite(self.truth)

    @property
    def reported(self) -> list[float | None]:
        return [r["reported"] for r in self.records]

    @property
    def errors(self) -> list[str | None]:
        return [r["error"] for r in self.records]

    @property
    def raised(self) -> list[int]:
        return [r for r, e in enumerate(self.errors) if e is not None]

    @property
    def collateral(self) -> set[int]:
        return {r for r in self.raised if _collateral(cast(str, self.errors[r]))}

    def documented_nonfinite_raise(self) -> bool:
        """Every rank raised, each with a message that names the non-finite gradient."""
        return self.undocumented_because() is None

    def undocumented_because(self) -> str | None:
        """Why the raises are not a documented answer to a non-finite gradient, or None when they are."""
        if self.finite_truth:
            return "the true norm is finite: there was nothing to refuse"
        if len(self.raised) != len(self.records):
            return f"only ranks {self.raised} raised: a documented raise comes from every rank"
        if self.collateral:
            return f"ranks {sorted(self.collateral)} failed in consequence of another rank's error"
        silent = [r for r, e in enumerate(self.errors) if not NONFINITE_ERROR.search(_message(e or ""))]
        if silent:
            return (f"the message of rank(s) {silent} does not say non-finite (nan, inf, not finite, overflow), so "
                    "the raise reads as a crash, not a deliberate refusal")
        return None


Outcome = tuple[bool, str] | None
"""What a check's function returns: (passed, detail), or None when it does not apply to the case."""


@dataclass(frozen=True)
class CheckSpec:
    """One check: its name in reports, the function of the case that judges it, and the rank-local
    measurements it reads (keys of ``RankLocal``, each record's ``local``, built by
    ``harness.run.case.effects.CallEffects.record``). ``tests/test_judging.py`` holds a positive control per name and verifies ``reads``."""

    name: str
    judge: Callable[[Judgement], Outcome]
    reads: tuple[RankLocalKey, ...] = ()

    def __call__(self, j: Judgement) -> Check | None:
        outcome = self.judge(j)
        return None if outcome is None else Check(self.name, *outcome)


def judge_truth(j: Judgement) -> Outcome:
    """Harness self-check: the measured (MAX-MIN) truth equals the constructive one, the gradients
    injected for this case are the ones measured for its variant, and a framework's own gradient path
    delivered exactly the layout's gradients."""
    undelivered = [(r, rec["local"]["undelivered"]) for r, rec in enumerate(j.records)
                   if rec["local"].get("undelivered")]
    if undelivered:
        r, lines = undelivered[0]
        ranks = [q for q, _ in undelivered]
        return False, (f"HARNESS ERROR: ranks {ranks}: the framework's own gradient path did not deliver this "
                       f"layout's gradients (rank {r}: {'; '.join(lines)}); no user of the framework reaches this "
                       "layout that way: mark it synthetic, or deliver it differently")
    stale = [r for r, rec in enumerate(j.records) if rec["local"].get("stale_truth")]
    if stale:
        return False, (f"HARNESS ERROR: ranks {stale}: the injected gradients differ from the ones "
                       "measured for this layout variant (the injection is not deterministic)")
    ok = norms_agree(j.measured, j.truth, CROSS_CHECK_RTOL)
    return ok, "" if ok else (f"HARNESS ERROR: measured truth {j.measured!r} != constructive truth {j.truth!r}; "
                              "the injected gradients do not have the replication structure the layout describes")


def judge_raised(j: Judgement) -> Outcome:
    """Did the function finish on every rank? (Raising everywhere is a legitimate, documented answer
    to a non-finite gradient, nothing else.)"""
    if not j.raised:
        return None
    why = j.undocumented_because()
    shown = why is not None and not j.finite_truth  # in a finite case a raise is simply a raise
    return why is None, describe_errors(j.errors) + (f" (not accepted as a non-finite refusal: {why})" if shown else "")


def judge_contract(j: Judgement) -> Outcome:
    """Faults the harness detects on a rank that did not raise: a return value of the wrong type, a
    destroyed default process group, gradients deleted or replaced by tensors of another shape/dtype
    or wrapper (plain <-> DTensor), or replaced at all rather than scaled in place, and, when the true
    norm is finite, gradients the clip itself made non-finite (an overflow in the gradient dtype, a NaN
    fill: every one of them was finite before the call)."""
    problems = []
    for r, rec in enumerate(j.records):
        if rec["error"] is not None:
            continue
        if rec.get("fault"):
            problems.append(f"rank {r}: {rec['fault']}")
        local = rec["local"]
        for name, why in local["mangled"].items():
            problems.append(f"rank {r}: {name} gradient replaced by another tensor ({why})")
        for name in local["vanished"]:
            problems.append(f"rank {r}: {name} lost its gradient (set to None)")
        if local["replaced"]:
            problems.append(f"rank {r}: gradient of {_full_names(local['replaced'])} replaced, not scaled in place "
                            "(a new tensor: whatever aliased the old one keeps the unscaled values)")
        if j.finite_truth and local["became_nonfinite"]:
            names = local["became_nonfinite"]
            problems.append(f"rank {r}: {_full_names(names)} became non-finite (inf/NaN) in the clip, though every "
                            "gradient was finite before it and the true norm is finite")
    more = f" (+{len(problems) - 4} more)" if len(problems) > 4 else ""
    return not problems, "; ".join(problems[:4]) + more


def judge_created(j: Judgement) -> Outcome:
    """No gradient appears where there was none: a frozen parameter, or an expert that got no tokens,
    keeps ``None`` (a zero gradient there changes what the optimizer does: weight decay, moments)."""
    created = [f"rank {r}: {', '.join(rec['local']['created'][:3])}"
               for r, rec in enumerate(j.records) if rec["error"] is None and rec["local"]["created"]]
    return not created, "" if not created else (
        "gradients appeared where there were none (frozen or without a gradient before the call): "
        + "; ".join(created[:4]))


def judge_late(j: Judgement) -> Outcome:
    """Nothing changes after the clip has returned (a thread it started restoring the gradients, say):
    the model as measured right after the call is the model once the threads it started have
    finished, and again before the next case."""
    late = [f"rank {r}: {', '.join(rec['local']['late'])}" for r, rec in enumerate(j.records) if rec["local"]["late"]]
    return not late, "" if not late else "changed after the clip returned: " + "; ".join(late[:4])


def amend_late(result: CaseResult, changes: Sequence[Sequence[str]]) -> CaseResult:
    """``result`` with what each rank saw change once more, before the next case (``changes`` by
    rank): a late change fails the ``late`` check, and a passing case with it."""
    late = [f"rank {r}: {', '.join(c)}" for r, c in enumerate(changes) if c]
    if not late or result.verdict == "SKIP" or any(c.name == "late" and not c.passed for c in result.checks):
        return result  # nothing new, or the case's own check already named it
    detail = "changed after the clip returned (seen before the next case): " + "; ".join(late[:4])
    result.checks = [c for c in result.checks if c.name != "late"] + [Check("late", False, detail)]
    if result.verdict == "PASS":
        result.verdict = "FAIL"
    return result


def judge_params(j: Judgement) -> Outcome:
    """A clip function must leave the parameters themselves untouched: values and ``requires_grad``."""
    changed = [f"rank {r}: {', '.join(rec['local']['params_changed'][:3])}"
               for r, rec in enumerate(j.records) if rec["local"]["params_changed"]]
    return not changed, "" if not changed else "parameters changed: " + "; ".join(changed[:4])


def judge_norm(j: Judgement) -> Outcome:
    """The reported norm is the true global norm, within the case's band (``harness.judge.band``); a norm
    outside it that no miscount explains is the ``arithmetic`` check's (``read_norm``)."""
    reading = j.norm_reading
    return None if reading is None or reading[0] == "arithmetic" else (reading[0] == "within", reading[1])


def judge_arithmetic(j: Judgement) -> Outcome:
    """A reported norm outside the spread of correct clips on the case's gradients by less than any miscount
    would move it (or not finite where the truth is): the clip's arithmetic, worded as such and never
    blamed on a group (``read_norm``)."""
    reading = j.norm_reading
    return (False, reading[1]) if reading is not None and reading[0] == "arithmetic" else None


NormKind = Literal["within", "arithmetic", "counting"]


def read_norm(j: Judgement) -> tuple[NormKind, str] | None:
    """Where the reported norms fall: within the band; outside it and arithmetic (a report that is not
    finite where the truth is, or off by less than half of what the smallest miscount moves it:
    ``smallest_miscount``, so no count of any holding explains it); or outside it and possibly a miscount
    (the norm check, its signature and blame). None where no norm is judged (a non-finite truth, a raise)."""
    if not j.finite_truth or j.raised:
        return None
    reported, truth, band = j.reported, j.truth, j.band
    rtols = [rank_rtol(band.rtol, rec.get("precision")) for rec in j.records]
    bad = [r for r, v in enumerate(reported) if v is None or not norms_agree(v, truth, rtols[r])]
    if not bad:
        return "within", band.describe(cast(float, reported[0]) / truth) if truth else ""
    ratios = {r: (cast(float, reported[r]) / truth if reported[r] is not None and truth else None) for r in bad}
    errors = [abs(x - 1.0) for x in ratios.values() if x is not None]
    off = f" (relative error up to {_fmt_rel(max(errors))} > tolerance {rtols[bad[0]]:.2g})" if errors else ""
    detail = "reported/true " + ", ".join(f"rank {r}: {_fmt(x)}" for r, x in list(ratios.items())[:4]) + off
    spread = band.reach()
    values = [reported[r] for r in bad]
    if any(v is None for v in values) or not errors:
        return "counting", detail
    if not all(math.isfinite(cast(float, v)) for v in values):
        return "arithmetic", (f"{detail}: a non-finite norm where the true one is finite ({truth:.6g}), what "
                              f"arithmetic past the range of its type gives (squares or the total in {j.dtype}, or "
                              f"narrower?)")
    smallest = smallest_miscount(j)
    if smallest is not None and max(errors) < smallest[1] / 2:
        return "arithmetic", (f"{detail}; {spread}: outside their spread, and by less than any miscount (the "
                              f"smallest, {smallest[0]} {_miscounted(j.case.norm_type)}, moves it by "
                              f"{_fmt_rel(smallest[1])}): the "
                              f"arithmetic (squares summed in {_narrower(j.dtype)}? the norm rounded to a narrower "
                              f"type?)")
    return "counting", f"{detail}; {spread}"


def _miscounted(norm_type: float) -> str:
    return "left out" if math.isinf(norm_type) else "counted twice"


def _narrower(dtype: str) -> str:
    return "bf16 or fp16" if dtype in ("fp32", "fp64") else dtype


def smallest_miscount(j: Judgement) -> tuple[str, float] | None:
    """The logical gradient whose miscount moves the norm least, and by how much (relative). For a p-norm,
    counting it twice (``(1 + t / T^p)^(1/p) - 1``, t its p-th power sum, T the truth; omitting it moves the
    norm further). For the inf norm, only omitting the gradients that hold the maximum moves it, down to the
    next largest (``1 - m2 / m1``). None where nothing is held or no miscount moves it."""
    p = j.case.norm_type
    if not j.truth:
        return None
    counted = [(f"{j.stats.names[k]} (rank {r})", j.stats.pow_sum[r][k])
               for r, row in enumerate(first_holdings(j.copies)) for k in row if j.stats.pow_sum[r][k] > 0]
    if math.isinf(p):
        below = [(name, value) for name, value in counted if value < j.truth]
        top = [name for name, value in counted if value >= j.truth]
        return None if not top else (top[0], 1 - max((v for _, v in below), default=0.0) / j.truth)
    total = j.truth ** p
    moved = [(name, (1 + value / total) ** (1 / p) - 1) for name, value in counted]
    return min(moved, key=lambda m: m[1], default=None)


def rank_rtol(rtol: float, precision: str | None) -> float:
    """The norm tolerance for a value returned in ``precision`` (``targets.target.reported_precision``):
    a norm computed right and returned in a narrower type than the case's (a float32 tensor of an fp64
    norm, torch.tensor(total) with the default dtype) is one rounding of that type further away; what
    the clip did with it is the coefficient check's to judge."""
    return rtol + (UNIT_ROUNDOFF[precision] if precision in UNIT_ROUNDOFF else 0.0)


def judge_agree(j: Judgement) -> Outcome:
    """Every rank reports the same norm, to the bit (a rank that disagrees clips differently)."""
    if j.raised:
        return None
    values = {repr(v) for v in j.reported}
    return len(values) == 1, "" if len(values) == 1 else disagreement(j.reported)


def disagreement(reported: Sequence[float | None]) -> str:
    """Each rank's norm with every digit (``repr``: the shortest string that round-trips), and how
    far apart the finite ones are in units in the last place, so a disagreement in the 17th digit
    reads as one and not as equal numbers printed twice."""
    shown = ", ".join(f"{r}: {v!r}" for r, v in enumerate(reported))
    finite = [v for v in reported if v is not None and math.isfinite(v)]
    if len(finite) < 2 or min(finite) == max(finite):
        return f"ranks report {shown}"
    lo, hi = min(finite), max(finite)
    apart = round((hi - lo) / math.ulp(max(abs(lo), abs(hi))))
    if apart <= 1 << 20:
        return f"ranks report {shown} (apart by {apart} ulp of float64)"
    return f"ranks report {shown} (relative spread {(hi - lo) / max(abs(lo), abs(hi)):.3g})"


def expected_coefficient(j: Judgement) -> float:
    return clip_coefficient(j.case.max_norm, j.truth)


def judge_coefficient(j: Judgement) -> Outcome:
    """Every gradient scaled by min(1, max_norm / (true + eps)), uniformly."""
    if not j.finite_truth or j.raised:
        return None
    expected = expected_coefficient(j)
    worst: tuple[float, str, bool] | None = None
    for r, rec in enumerate(j.records):
        for name, entry in rec["local"]["scale"].items():
            c, residual, elements = entry[:3]
            off = abs(c - expected) / expected
            # a gradient of subnormal numbers only: the fit is good to its roundings' absolute size (the slack)
            ctol = coefficient_rtol(j.dtype, int(elements), j.band.rtol) + (entry[3] if len(entry) > 3 else 0.0)
            uniform = residual <= uniformity_bound(j.dtype, int(elements))
            if (off > ctol or not uniform) and (worst is None or off > worst[0]):
                how = f"scaled by {c:.6g}" if uniform else f"scaled non-uniformly (~{c:.6g}, residual {residual:.2g})"
                why = (f"relative error {_fmt_rel(off)} > tolerance {ctol:.2g}" if off > ctol else
                       f"residual {residual:.2g} > bound {uniformity_bound(j.dtype, int(elements)):.2g}")
                worst = (off, f"rank {r}: {name} {how}, expected {expected:.6g} ({why})", uniform)
    if worst is None:
        return True, ""
    reading = j.norm_reading
    if worst[2] and reading is not None and reading[0] == "within":
        return False, (f"{worst[1]}; the norm it reported is within the band: the coefficient's own arithmetic "
                       f"(computed or held in a narrower type than {j.dtype}?)")
    return False, worst[1]


def judge_replicas(j: Judgement) -> Outcome:
    """True replicas (measured before the call) are still bit-identical after it: along each mesh axis,
    or, where the measurement has classes of bits (a measured layout), within every class."""
    if j.pre.classes is not None and j.post.classes is not None:
        return _classes_kept(j.pre.classes, j.post.classes)
    diverged = [
        f"{name} on {axis}"
        for axis in j.mesh.names
        if j.mesh.size(axis) > 1
        for name in j.stats.names
        if not j.pre.distinct[axis][name] and j.post.distinct[axis][name]
    ]
    return not diverged, "" if not diverged else "replicas diverged after clipping: " + ", ".join(diverged[:4])


def _classes_kept(pre: Mapping[str, Sequence[str | None]], post: Mapping[str, Sequence[str | None]]) -> Outcome:
    """Every class of copies before the call holds one class of bits after it (a holding that lost its
    gradient is the contract check's)."""
    after: dict[str, set[str]] = {}
    where: dict[str, list[str]] = {}
    for name, keys in pre.items():
        for r, key in enumerate(keys):
            now = post.get(name, [None] * len(keys))[r]
            if key is not None and now is not None:
                after.setdefault(key, set()).add(now)
                where.setdefault(key, []).append(f"{name} on rank {r}")
    diverged = [" = ".join(where[key][:3]) + (" ..." if len(where[key]) > 3 else "")
                for key, seen in after.items() if len(seen) > 1]
    return not diverged, "" if not diverged else "copies diverged after clipping: " + "; ".join(diverged[:4])


def _outcome(j: Judgement, r: int) -> str:
    rec = j.records[r]
    if rec["error"] is not None:
        if r in j.collateral:
            return "collateral"
        return "raised-nonfinite" if NONFINITE_ERROR.search(_message(rec["error"])) else "raised"
    if rec.get("fault"):
        return "fault"
    v = rec["reported"]
    return "nonfinite" if v is not None and not math.isfinite(v) else "finite"


OUTCOME_WORDS = {
    "finite": "reported a finite norm",
    "nonfinite": "reported a non-finite norm",
    "raised-nonfinite": "raised a non-finite error",
    "raised": "raised an error that does not say non-finite",
    "collateral": "failed in consequence of another rank's error",
    "fault": "broke the contract (see the contract check)",
}
"""What a rank's call came to (``_outcome``), as the ``nonfinite`` check's detail says it."""

POLICY_WORDS = {
    "leave": "left the gradients unchanged",
    "zero": "zeroed the gradients",
    "poison": "multiplied the gradients by NaN",
}
"""What a rank's clip did to its gradients, by the policy name its record holds (``local["policies"]``,
measured by ``harness.run.case.effects``): a detail says the words, never the bare names."""


def did_to_gradients(policies: Sequence[str] | None) -> str:
    """What a rank did to its gradients, in words: each policy its gradients fit (some fit two: a rank
    whose every gradient was NaN already looks left alone and multiplied by NaN), none, or no gradient."""
    if policies is None:
        return "held no gradient"
    if not policies:
        return "changed the gradients otherwise (not left unchanged, zeroed nor multiplied by NaN)"
    return " or ".join(POLICY_WORDS.get(p, p) for p in policies)


def judge_nonfinite(j: Judgement) -> Outcome:
    """With a non-finite gradient every rank must take the same deliberate action: report a
    non-finite norm and apply one policy (leave / zero / poison the gradients) on every rank holding
    gradients, or raise a documented non-finite error on every rank, before touching any gradient
    (``leave`` on every holder: a clip that scales, then raises, has already changed the step)."""
    if j.finite_truth:
        return None
    outcomes = [_outcome(j, r) for r in range(len(j.records))]
    policies = [rec["local"].get("policies") for rec in j.records]
    holders = [set(p) for p in policies if p is not None]
    shared = set.intersection(*holders) if holders else {"any"}
    if all(o == "raised-nonfinite" for o in outcomes) and not j.collateral:
        # a raise is the answer only if it came before any scaling: every holder left its gradients as they were
        touched = [r for r, p in enumerate(policies) if p is not None and "leave" not in p]
        if not touched:
            return True, ""
        return False, (f"every rank raised a non-finite error, but ranks {touched} changed their gradients before "
                       "raising (a raise must leave them untouched); per rank: " + "; ".join(
                           f"{r}: {did_to_gradients(p)}" for r, p in enumerate(policies)))
    ok = all(o == "nonfinite" for o in outcomes) and bool(shared)
    detail = "" if ok else (
        "expected one non-finite norm or raise on every rank, the gradients treated alike; per rank: "
        + "; ".join(f"{r}: {OUTCOME_WORDS[o]} and {did_to_gradients(p)}"
                    for r, (o, p) in enumerate(zip(outcomes, policies))))
    return ok, detail


CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec("truth", judge_truth, reads=("stale_truth", "undelivered")),
    CheckSpec("raised", judge_raised),
    CheckSpec("contract", judge_contract, reads=("mangled", "vanished", "became_nonfinite", "replaced")),
    CheckSpec("params", judge_params, reads=("params_changed",)),
    CheckSpec("created", judge_created, reads=("created",)),
    CheckSpec("late", judge_late, reads=("late",)),
    CheckSpec("norm", judge_norm),
    CheckSpec("arithmetic", judge_arithmetic),
    CheckSpec("agree", judge_agree),
    CheckSpec("coefficient", judge_coefficient, reads=("scale",)),
    CheckSpec("replicas", judge_replicas),
    CheckSpec("nonfinite", judge_nonfinite, reads=("policies",)),
)
"""Every check, in report order. ``evaluate`` runs them all; the first (``truth``) is the harness's
own: when it fails the case is a harness ERROR, not a FAIL of the function under test."""


def _evidence(j: Judgement, mismatches: list[str], norm: Check | None) -> Evidence | None:
    """The norms other mistakes would have produced, for every judged case with a finite truth (a
    passing case's evidence tests the hypotheses of a failing one: ``signatures.holds_on``)."""
    if norm is None:
        return None
    return evidence_of(j.case, j.truth, j.stats, j.pre, mismatches)


def evidence_of(case: CaseSpec, truth: float, stats: StatsTable, pre: Replication,
                mismatches: Sequence[str]) -> Evidence:
    """The evidence of ``case`` from its statistics (the whole case's, or one group's: ``judge.one_group``)."""
    mesh = case.layout.mesh
    axes = [axis for axis in mesh.names if mesh.size(axis) > 1]
    if len(axes) < 2:  # one axis spans the world: its hypotheses are the rank-local ones below
        axes = []
    return Evidence(
        truth=truth,
        norm_type=case.norm_type,
        mesh=mesh,
        local_norms=stats.local_norms(case.norm_type),
        declared_norm=declared_norm(stats, mesh, case.variant.declared, case.norm_type),
        declared_mismatches=list(mismatches),
        unreduced={axis: unreduced_over(stats, pre, mesh, axis, case.norm_type) for axis in axes},
        replicas_counted={axis: replicas_counted_on(stats, pre, mesh, axis, case.norm_type) for axis in axes},
        max_norm=case.max_norm,
        replica_counts=case.layout.replica_counts,
    )


def signature_of(result: CaseResult) -> list[str]:
    """The mechanisms that explain ``result``'s wrong norm (``signatures.explain``)."""
    norm = next((c for c in result.checks if c.name == "norm"), None)
    if result.evidence is None or norm is None or norm.passed:
        return []
    return explain([v for v in result.reported if v is not None], result.evidence, result.tolerance)


def surviving_signature(result: CaseResult, others: Sequence[CaseResult]) -> list[str]:
    """``result``'s signature lines that also explain each of ``others`` (the one-group runs of its
    blame): a mechanism that names the right number on one case by coincidence rarely does on all."""
    kept = []
    for line in result.signature:
        if all(o.evidence is None or holds_on(line, [v for v in o.reported if v is not None], o.evidence, o.tolerance)
               for o in others):
            kept.append(line)
    return kept


def _median_coefficient(records: Sequence[RankRecord]) -> float | None:
    values = sorted(entry[0] for rec in records for entry in rec["local"]["scale"].values())
    return values[len(values) // 2] if values else None


def evaluate(
    case: CaseSpec,
    truth: float,
    measured: float,
    stats: StatsTable,
    pre: Replication,
    post: Replication,
    records: Sequence[RankRecord],
) -> CaseResult:
    """Judge one case from every rank's record: run every check, explain a wrong norm."""
    j = Judgement(case, truth, measured, stats, pre, post, records)
    checks = [c for c in (spec(j) for spec in CHECKS) if c is not None]
    per_param = placement_mismatches(case.variant.declared, pre, stats, case.layout.mesh)
    mismatches = declared_mismatches(per_param)
    norm = next((c for c in checks if c.name == "norm"), None)
    truth_ok = checks[0].passed  # CHECKS[0] is the harness's self-check and always applies
    verdict: Verdict = "ERROR" if not truth_ok else "PASS" if all(c.passed for c in checks) else "FAIL"
    coefficient = _median_coefficient(records) if j.finite_truth and not j.raised else None
    result = CaseResult(
        case=case,
        verdict=verdict,
        truth=truth,
        measured_truth=measured,
        reported=j.reported,
        checks=checks,
        signature=[],
        placements={name: pre.describe(name, case.layout.mesh) for name in stats.names},
        mismatches=mismatches,
        param_mismatches=per_param,
        coefficient=coefficient,
        seconds=max(float(r["seconds"]) for r in records),
        errors=j.errors,
        tolerance=j.band.rtol,
        evidence=_evidence(j, mismatches, norm),
    )
    result.groups, result.moved = counting_reach(case, stats, pre, j.copies, truth)
    result.signature = signature_of(result)
    return result


def skipped_result(case: CaseSpec) -> CaseResult:
    """A case that cannot run here: reported with its reason, counted neither as pass nor as fail."""
    return CaseResult(case=case, verdict="SKIP", truth=math.nan, measured_truth=math.nan, reported=[],
                      checks=[Check("skip", True, case.skip or "")], signature=[], placements={}, mismatches=[],
                      coefficient=None, seconds=0.0)


def unjudged_result(case: CaseSpec, check: str, detail: str, world_size: int, seconds: float = 0.0) -> CaseResult:
    """A case that was not judged (a rank hung or died, the run was stopped): an ERROR, never a pass.
    ``check`` names what happened: ``hang``, ``crash`` or ``not_run``."""
    return CaseResult(case=case, verdict="ERROR", truth=math.nan, measured_truth=math.nan,
                      reported=[None] * world_size, checks=[Check(check, False, detail)], signature=[],
                      placements={}, mismatches=[], coefficient=None, seconds=seconds)


SETUP_STEPS = {"dress": "setup", "backward": "gradient path (its backward and hooks)"}


def setup_failed_result(case: CaseSpec, errors: Sequence[str | None], seconds: float,
                        step: str = "dress") -> CaseResult:
    """The framework's own setup (its dress step) or gradient path (its backward) raised: the clip was
    never reached, so nothing about it was judged. A SKIP with the error as the reason (a framework
    that cannot be set up here says nothing about its clip), never a FAIL of the clip."""
    reason = f"the framework's {SETUP_STEPS[step]} raised, its clip was not reached: {describe_errors(errors)}"
    result = skipped_result(dataclasses.replace(case, skip=reason))
    result.errors, result.seconds = list(errors), seconds
    return result
