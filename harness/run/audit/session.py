"""``harness.audit`` on one rank of the user's own job: measure, call the clip once, judge like a case.

Every rank of the job runs this in lockstep, inside the user's process group and launcher
(``user_world``: the store the job rendezvoused through is the control plane; the job's groups are
never touched). The exchanges, in order (rank 0 gathers, decides, and says what it decided):

1. one pass over this rank's gradients where they lie (``gradient_pass``: sums, row norms, sampled
   bits), its parameters and, where the parameters are DTensors or a mesh is given, their mesh and
   declared placements: gathered on rank 0 (``audit-measure``);
2. rank 0 finds which gradients may be copies of another holding and tells each rank which to hash
   (``audit-plan``); those digests are gathered (``audit-digests``, only when there are any);
   rank 0 builds the measured case: classes of copies, the truth (each class once), the measured
   layout and its declared plan (``harness.cases.measured``);
3. the clip, called once, guarded as the harness guards a target (``guard.guarded``: exceptions
   caught, a hang noticed by the watchdog and posted through the store; ``guard.agree``);
4. what the clip did to this rank (``local``: the record every check reads), measured by the path a
   case's effects take (``effects.rank_effects``) with the audit's reading of the values
   (``reading.AuditReading``: a second pass, the same sums and samples, the copies' digests again; the
   coefficients exact from the copy ``restore`` keeps, ``with_copy``, in float64 blocks on the
   gradients' device, or from both passes' statistics), gathered on rank 0 (``audit-record``), which
   judges with ``harness.judge.checks.evaluate``: the same checks, signatures and tolerances as a case;
5. with ``restore``, when the norm is wrong, the one-group runs of the
   blame (``audit-blame-*``), the gradients put back between runs and at the end;
6. rank 0's verdict to every rank (``audit-verdict``).

Without ``restore`` nothing is copied: the coefficient comes from the row norms and samples of both
passes (``without_copy.cheap_scale``), the parameters' check from their storage, version counters and
sampled elements (``without_copy.ParamMarks``), and the gradients stay as the clip left them (the audit's
call is the step's).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from harness.cases.layout import Placement
from harness.cases.measured import (SCENARIO, Holding, candidates, class_tokens, holdings, measured_variant, mesh_from,
                                    not_as_dtensors, parameter_names, placement_from, spans_from)
from harness.cases.variant import CaseSpec
from harness.clipmath import EPS, local_tensor
from harness.judge.blame import blame_reason, group_only, group_tables, parameter_groups
from harness.judge.establishment import counting_line, establish, to_run_alone
from harness.judge.checks import evaluate, unjudged_result
from harness.judge.one_group import one_group_signature
from harness.judge.records import CaseResult, RankRecord, Replication, StatsTable
from harness.judge.tolerance import UNIT_ROUNDOFF
from harness.judge.truth import measured_norm
from harness.run.audit.without_copy import ParamMarks, cheap_scale
from harness.run.audit.job_mesh import job_mesh
from harness.run.case.model_state import ModelState, fingerprint, settled_changes, threads_started
from harness.run.case.blame_reruns import weigh_groups
from harness.run.audit.reading import AuditReading, digestible
from harness.run.case.effects import CallEffects, mangled_reason, rank_effects
from harness.run.audit.gradient_pass import GradientPass, dtype_label
from harness.run.audit.audit_report import AuditReport
from harness.run.case.measure import from_digests, linear_digest
from harness.run.case.guard import agree, describe_exception, guarded
from harness.run.audit.user_world import UserWorld, user_world
from harness.run.world.dist_world import DeadRankError, WorldBroken
from harness.targets.target import reported_value

Grads = Mapping[str, "torch.Tensor | None"]

@dataclass
class _Case:
    """Rank 0's measured case: everything the judge needs besides the records of the call."""

    case: CaseSpec
    names: list[str]
    stats: StatsTable
    pre: Replication
    truth: float
    held: list[Holding]
    tokens: dict[tuple[int, str], str]
    notes: list[str]
    """What rank 0 adds to the audit's notes about the measured case."""


def clip_label(clip: Callable[..., Any]) -> str:
    """How the report names the clip: its qualified name, a lambda by where it is written."""
    inner = inspect.unwrap(clip.func if isinstance(clip, functools.partial) else clip)
    name = getattr(inner, "__qualname__", None) or type(inner).__name__
    if "<lambda>" in name:
        try:
            file, line = inspect.getsourcefile(inner) or "?", inspect.getsourcelines(inner)[1]
            return f"<lambda> {os.path.basename(file)}:{line}"
        except (TypeError, OSError):
            return "<lambda>"
    return name


# -- one rank's audit ------------------------------------------------------------------------------------
def run_audit(model: nn.Module, clip: Callable[[], Any], *, max_norm: float, norm_type: float,
              mesh: DeviceMesh | None, restore: bool, blame: bool, timeout_s: float, label: str) -> AuditReport:
    params = list(model.named_parameters())
    grads: dict[str, torch.Tensor | None] = {n: None if p.grad is None else local_tensor(p.grad) for n, p in params}
    device = next((g.device for g in grads.values() if g is not None),
                  next((local_tensor(p).device for _, p in params), torch.device("cpu")))
    world = user_world(timeout_s, device)
    clock = _Clock()

    # 1. the first pass, gathered on rank 0
    first = GradientPass(norm_type, band=True)
    before = {n: first.add(g) for n, g in grads.items() if g is not None}
    first.finish()
    axes, declared, spans, notes = job_mesh(params, mesh, world.world_size)
    record = {"params": [[n, dtype_label(local_tensor(p).dtype), bool(p.requires_grad), list(local_tensor(p).shape)]
                         for n, p in params],
              "grads": {n: s.record() for n, s in before.items()}, "flat": first.flat_error, "mesh": axes,
              "declared": declared, "spans": spans, "notes": notes, "blame": bool(blame and restore)}
    records = world.gather_json("audit-measure", record, world.exchange_deadline_s)
    clock.lap("measure")

    # 2. the candidates' digests, the measured case
    plan: dict[str, Any] | None = None
    held: list[Holding] = []
    if records is not None:
        held = holdings(records)
        plan = {"digest": candidates(held, world.world_size),
                "nonfinite": any(not (math.isfinite(h.pow) and math.isfinite(h.sq)) for h in held),
                "blame": all(rec["blame"] for rec in records)}  # every rank keeps a copy: the blame may run
    plan = world.allgather_json("audit-plan", plan, world.exchange_deadline_s)[0]
    assert plan is not None
    nonfinite = bool(plan["nonfinite"])
    copied = set(plan["digest"][world.rank])  # may be copies of another holding: hashed before and after
    hashed = {n for n, g in grads.items() if g is not None} if nonfinite else copied  # non-finite: was each left?
    digests_before = {n: linear_digest(digestible(grads[n], nonfinite)) for n in sorted(hashed)}
    gathered = world.gather_json("audit-digests", {n: d for n, d in digests_before.items() if n in copied},
                                 world.exchange_deadline_s) if any(plan["digest"]) else [{}] * world.world_size
    measured = _measured_case(records, held, gathered, norm_type, max_norm, label) if records is not None else None
    clock.lap("classes")

    # 3. the call, guarded
    copies = {n: g.detach().clone() for n, g in grads.items() if g is not None} if restore else None
    originals = {n: p.grad for n, p in params} if restore else None
    standins = {n: None if g is None else _standin(g) for n, g in grads.items()}
    marks = ParamMarks.of(params)
    state_before, threads_before = ModelState.of(model), set(threading.enumerate())
    default_group = dist.group.WORLD if dist.is_initialized() else None
    if world.rank == 0:
        world.hang_handler = functools.partial(_rank0_hung, world, measured)
    else:
        world.hang_handler = functools.partial(_peer_hung, world)
    clock.lap("snapshot")
    value, error, seconds = guarded(world, "audit-call", lambda: _materialized(clip()))
    if error is not None:
        world.post_error(error)
    reported, fault, broken = None, None, False
    if error is None and value is not None:
        try:
            reported = reported_value(value)
        except TypeError as exc:
            fault = f"{exc} (returned by {label})"
    if dist.is_initialized() and dist.group.WORLD is not default_group:
        fault, broken = "the clip function destroyed or replaced the default process group", True
    try:
        agree(world, "audit-status", {"error": error, "fault": fault, "broken": broken})
    except (WorldBroken, DeadRankError) as exc:
        return _ended(world, measured, "hang" if isinstance(exc, WorldBroken) else "crash",
                      exc.detail if isinstance(exc, WorldBroken) else str(exc))
    clock.lap("call")

    # 4. what the clip did, measured as a case's effects are (``effects.rank_effects``), gathered and judged
    named = dict(model.named_parameters())
    after = {n: None if (p := named.get(n)) is None or p.grad is None else local_tensor(p.grad) for n in grads}
    reading = AuditReading(norm_type, before, copied, nonfinite, copies, digests_before)
    _, effects = rank_effects(standins, after, reading, marks.changed(ParamMarks.of(list(model.named_parameters()))),
                              nonfinite, state_before, ModelState.of(model), in_place=False)
    # not ``replaced``: a framework may write new gradient tensors (Target.in_place; docs/audit.md)
    after_stats = reading.after
    implied = None
    if reported is None and error is None and fault is None:
        reported = _implied_norm(effects.coefficients["scale"], max_norm, notes)
        implied = reported is not None
    local = effects.record(late=_late(model, threads_before, [n for n, _ in params]), stale_truth=False,
                           undelivered=[], implied=implied)
    post_tokens = {n: (None if n not in after_stats else after_stats[n].digest if n in copied else "kept")
                   for n in grads}
    clip_record: RankRecord = {"reported": reported, "error": error, "fault": fault, "seconds": seconds,
                               "local": local, "post": post_tokens}
    clip_records = world.gather_json("audit-record", clip_record, world.exchange_deadline_s)
    clock.lap("effects")
    result = None
    if measured is not None and clip_records is not None:
        result = _judge(measured, clip_records)

    # 5. the blame's one-group runs (the gradients put back between them), or, where the norm is right, those of
    # the groups whose miscount its band can hide (counting established per group), then the verdict
    groups: dict[str, list[str]] | None = None
    establishing = False
    if plan["blame"]:  # an exchange only where the blame may run (restore and blame on every rank)
        if result is not None and measured is not None:
            groups, establishing = _to_run(result, measured)
        groups, establishing = world.allgather_json("audit-blame", [groups, establishing],
                                                    world.exchange_deadline_s)[0]
    if groups and copies is not None and originals is not None:
        try:
            subs = [_one_group(world, model, clip, set(names), originals, copies, measured, max_norm, g)
                    for g, names in enumerate(groups.values())]
        except (WorldBroken, DeadRankError) as exc:
            return _ended(world, measured, "hang" if isinstance(exc, WorldBroken) else "crash",
                          exc.detail if isinstance(exc, WorldBroken) else str(exc))
        if result is not None and measured is not None and establishing:
            establish(result, dict(zip(groups, subs)))
        elif result is not None:
            weigh_groups(result, groups, [s for s in subs if s is not None])
        clock.lap("blame")
    if originals is not None and copies is not None:
        _put_back(model, originals, copies)
    verdict = None
    if world.rank == 0:
        unseen_lines = _unseen_said(result) if result is not None and not groups else []
        verdict = {"verdict": result.verdict if result is not None else "ERROR", "text": _text(result, world),
                   "hint": _blame_hint(result), "unseen": unseen_lines}
    shared = world.allgather_json("audit-verdict", verdict, world.exchange_deadline_s)[0]
    world.hang_handler = world.default_hang_handler
    all_notes = sorted({n for rec in records or [] for n in rec["notes"]}) + notes + \
        (measured.notes if measured is not None else []) + ([shared["hint"]] if shared["hint"] else []) + \
        shared["unseen"]
    return AuditReport(rank=world.rank, world_size=world.world_size, backend=world.backend,
                       verdict=shared["verdict"], text=shared["text"], result=result, notes=all_notes,
                       seconds=clock.seconds)


class _Clock:
    def __init__(self) -> None:
        self._now = time.perf_counter
        self._last = self._now()
        self.seconds: dict[str, float] = {}

    def lap(self, what: str) -> None:
        now = self._now()
        self.seconds[what] = self.seconds.get(what, 0.0) + now - self._last
        self._last = now


def _implied_norm(scale: Mapping[str, Sequence[float]], max_norm: float, notes: list[str]) -> float | None:
    """The norm a clip that returned nothing must have used, from the coefficient it applied on this
    rank (torch's ``max_norm / (norm + eps)``): known only where it clipped (a coefficient below 1)."""
    coefficients = sorted(entry[0] for entry in scale.values())
    if not coefficients:
        return None
    c = coefficients[len(coefficients) // 2]
    if not (0 < c < 1):
        notes.append("the clip returned no norm and did not clip (coefficient 1): its norm is unknown; audit "
                     "with a max_norm below the norm to read it from the coefficient")
        return None
    notes.append("the clip returned no norm: each rank's reported norm is the one its coefficient implies, "
                 "max_norm / coefficient - 1e-6")
    return max_norm / c - EPS


def _standin(grad: torch.Tensor) -> torch.Tensor:
    """A tensor of the gradient's shape, dtype and device holding one element: what ``sanitize`` needs
    to tell a replaced gradient, without a copy."""
    return torch.empty((), dtype=grad.dtype, device=grad.device).expand(grad.shape)


def _materialized(value: Any) -> Any:
    """A DTensor norm made whole inside the guard (a collective every rank makes)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def _late(model: nn.Module, threads_before: set[threading.Thread], names: list[str]) -> list[str]:
    """What changed after the clip returned, once the threads it started have finished (none started:
    nothing to wait for, and no fingerprint taken)."""
    if not threads_started(threads_before):
        return []
    with torch.no_grad():
        baseline = fingerprint(model, names)
        late, _ = settled_changes(threads_before, model, names, baseline)
    return late


def _measured_case(records: Sequence[Mapping[str, Any]], held: list[Holding],
                   gathered: Sequence[Mapping[str, str] | None] | None, norm_type: float, max_norm: float,
                   label: str) -> _Case:
    """Rank 0: the classes of copies, the measured layout and truth, as a case."""
    world = len(records)
    digests: list[Mapping[str, str]] = [d or {} for d in (gathered or [{}] * world)]
    tokens = class_tokens(held, digests)
    names = parameter_names(records)
    meshes = {repr(rec["mesh"]) for rec in records}
    mesh = mesh_from(records[0]["mesh"] if len(meshes) == 1 else None, world)
    declared: dict[str, dict[str, Placement]] = {}
    if len(meshes) == 1 and records[0]["mesh"]:
        for rec in records:
            for name, placed in rec["declared"].items():
                declared.setdefault(name, {axis: placement_from(p) for axis, p in placed.items()})
    per_rank = [{n: tokens.get((r, n)) for n in names} for r in range(world)]
    pre = from_digests(names, per_rank, mesh, classes=True)
    spans = spans_from(records) if declared else {}
    variant = measured_variant(records, tokens, mesh, declared, pre.distinct, spans)
    plain = not_as_dtensors(variant.layout, declared, spans) if declared else None
    notes = [f"report.save: its replay builds every parameter as a plain tensor (torch-dtensor cannot run on it): "
             f"{plain}"] if plain else []
    by = {(h.rank, h.name): h for h in held}
    stats = StatsTable(
        names=names,
        numel=[[by[(r, n)].numel if (r, n) in by else -1 for n in names] for r in range(world)],
        itemsize=[[by[(r, n)].itemsize if (r, n) in by else 0 for n in names] for r in range(world)],
        pow_sum=[[by[(r, n)].pow if (r, n) in by else 0.0 for n in names] for r in range(world)],
        kernel_error=[[by[(r, n)].kernel_error if (r, n) in by else 0.0 for n in names] for r in range(world)],
        flat_error=[float(rec.get("flat", 0.0)) for rec in records],
    )
    truth = measured_norm(stats, pre, mesh, norm_type)
    case = CaseSpec(0, SCENARIO, variant, label, norm_type, max_norm)
    return _Case(case, names, stats, pre, truth, held, tokens, notes)


UNBLAMED = ("restore=True names the groups to blame (with blame on): the audit then keeps a copy of the gradients and "
            "calls the clip once more per parameter group, the others zero")
"""The line of a wrong norm whose groups were not weighed (``restore=False``, or ``blame=False``)."""


def _to_run(result: CaseResult, measured: _Case) -> tuple[dict[str, list[str]] | None, bool]:
    """Rank 0: the groups to run alone, and whether to establish their counting (the norm is right) rather
    than weigh them (it is wrong: every group)."""
    if blame_reason(result) is None:
        present = {n: frozenset(r for r in range(len(result.reported)) if measured.stats.present(r, j))
                   for j, n in enumerate(measured.names)}
        return parameter_groups(measured.names, present), False
    alone = to_run_alone(result)
    return alone, alone is not None


def _unseen_said(result: CaseResult) -> list[str]:
    """Rank 0, where no group was run alone: the groups the case itself establishes recorded, and the note on
    those it cannot."""
    establish(result, {})
    return unseen_note(result)


def unseen_note(result: CaseResult) -> list[str]:
    """Without a copy (``restore=False``, or blame off): the groups whose miscount this audit's band can hide,
    said, and how to establish them."""
    hidden = list(to_run_alone(result) or ())
    if not hidden:
        return []
    shown = ", ".join(hidden[:4]) + (f" and {len(hidden) - 4} more" if len(hidden) > 4 else "")
    return [f"counting not established for {len(hidden)} of {len(result.moved)} parameter groups ({shown}): each holds "
            f"too little of the norm for its band ({result.tolerance:.2g}) to show a miscount of it; restore=True "
            f"(with blame on) calls the clip once more for each, every other gradient zero"]


def _blame_hint(result: CaseResult | None) -> str | None:
    """``UNBLAMED`` where the norm is wrong, attributable, and no group was weighed."""
    return UNBLAMED if result is not None and not result.blame and blame_reason(result) is None else None


def _judge(measured: _Case, records: Sequence[RankRecord]) -> CaseResult:
    """Rank 0: the case judged from every rank's record of the call."""
    names = measured.names
    post = [{n: (measured.pre.classes or {}).get(n, [None] * len(records))[r] if token == "kept" else token
             for n, token in rec["post"].items()} for r, rec in enumerate(records)]
    post_rep = from_digests(names, [{n: p.get(n) for n in names} for p in post], measured.case.layout.mesh,
                            classes=True)
    judged = [rec.copy() for rec in records]
    for rec in judged:
        rec.pop("post", None)
    _agreed_implied(judged, measured.case.variant.injection.dtype)
    result = evaluate(measured.case, measured.truth, measured.truth, measured.stats, measured.pre, post_rep, judged)
    result.signature = one_group_signature(result, measured.stats, measured.pre)
    return result


def _agreed_implied(records: list[RankRecord], dtype: str) -> None:
    """A clip that returned no norm: each rank's norm is read back from the coefficient it applied, an
    estimate good to the rounding of the gradients' dtype. Where every rank's estimate is within that
    of the others, the ranks applied one coefficient: they all get rank 0's (the agree check would
    otherwise fail on the estimates' last digits); farther apart, they are left to disagree."""
    implied = [r for rec in records if rec["local"].get("implied") and (r := rec["reported"]) is not None]
    if len(implied) != len(records) or not implied:
        return
    lo, hi = min(implied), max(implied)
    if hi - lo <= 64 * UNIT_ROUNDOFF.get(dtype, 2.0**-24) * max(abs(lo), abs(hi)):
        for rec in records:
            rec["reported"] = implied[0]


def _one_group(world: UserWorld, model: nn.Module, clip: Callable[[], Any], group: set[str],
               originals: Mapping[str, torch.Tensor | None], copies: Grads, measured: _Case | None, max_norm: float,
               index: int) -> CaseResult | None:
    """One run of the blame: every gradient outside ``group`` zero (present), the group's as before the
    call; the clip called guarded; rank 0 judges the run's norm against the group's own truth."""
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, original in originals.items():
            if original is None or name not in named:
                continue
            target = local_tensor(original)
            copy = copies.get(name)
            if name in group and copy is not None:
                target.copy_(copy)
            else:
                target.zero_()
            named[name].grad = original
    value, error, seconds = guarded(world, f"audit-blame-{index}", lambda: _materialized(clip()))
    reported = None
    if error is None and value is not None:
        try:
            reported = reported_value(value)
        except TypeError:
            reported = None
    implied = error is None and value is None
    if implied:  # a clip that returns nothing: its norm from the coefficient it applied to the group
        reported = _group_implied_norm(model, group, copies, max_norm)
    agree(world, f"audit-blame-{index}", {"error": error, "fault": None, "broken": False})
    # a one-group run is judged on its norm only: none of the call's other effects is measured again
    local = CallEffects.unmeasured().record(late=[], stale_truth=False, undelivered=[],
                                            implied=implied and reported is not None)
    record: RankRecord = {"reported": reported, "error": error, "fault": None, "seconds": seconds, "local": local}
    records = world.gather_json(f"audit-blame-record-{index}", record, world.exchange_deadline_s)
    if records is None or measured is None:
        return None
    return _group_result(measured, group, records)


def _group_implied_norm(model: nn.Module, group: set[str], copies: Grads, max_norm: float) -> float | None:
    """The norm a clip that returned nothing used in a one-group run, from the factor it applied to the
    group's gradients on this rank (None where it did not clip, or the rank holds none of them)."""
    before = after = 0.0
    for name, p in model.named_parameters():
        copy = copies.get(name)
        if name in group and copy is not None and p.grad is not None:
            before += float(copy.double().pow(2).sum())
            after += float(local_tensor(p.grad).double().pow(2).sum())
    if not (before > 0 and math.isfinite(before) and math.isfinite(after)):
        return None
    c = math.sqrt(after / before)
    return max_norm / c - EPS if 0 < c < 1 else None


def _group_result(measured: _Case, group: set[str], records: Sequence[RankRecord]) -> CaseResult:
    """A one-group run judged as its own case: the truth of the group's gradients (each class it holds
    once: a copy tied under a name outside the group was zero in this run)."""
    sub_stats, sub_pre = group_tables(measured.stats, measured.pre, group)
    truth = measured_norm(sub_stats, sub_pre, measured.case.layout.mesh, measured.case.norm_type)
    case = group_only(measured.case, sorted(group))
    judged = [rec.copy() for rec in records]
    _agreed_implied(judged, measured.case.variant.injection.dtype)
    return evaluate(case, truth, truth, sub_stats, sub_pre, sub_pre, judged)


def _put_back(model: nn.Module, originals: Mapping[str, torch.Tensor | None], copies: Grads) -> None:
    """The gradients as they were before the audit (``restore``): the same tensors, the saved values."""
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, original in originals.items():
            p = named.get(name)
            if p is None:
                continue
            copy = copies.get(name)
            if original is not None and copy is not None:
                local_tensor(original).copy_(copy)
            p.grad = original


def _text(result: CaseResult | None, world: UserWorld) -> str:
    """The case as ``clipcheck run`` prints it (header, its line, failed checks, signature, blame)."""
    import io

    from harness.report.reporter import Reporter

    if result is None:
        return "clipcheck audit: nothing was judged"
    out = io.StringIO()
    reporter = Reporter(out, None, world.world_size, world.backend, verbose=False)
    reporter.header(1, [])
    reporter.case(result)
    counting = counting_line([result.counting])
    return out.getvalue().rstrip("\n") + (f"\n{counting}" if counting else "")


def _ended(world: UserWorld, measured: _Case | None, check: str, detail: str) -> AuditReport:
    """A rank hung or died in the clip: rank 0 reports the case as unjudged, with what every rank posted
    (the exception its stuck peers wait for; where each hung rank is stuck), and tells the stuck ranks the
    run is over (they then leave with status 3, as in the harness's own cases)."""
    errors = _posts_of_peers(world) if check == "hang" else world.posted_errors()
    if errors:
        said = [f"rank {r} {e}" if e.startswith("hung in ") else f"rank {r} raised {e}"
                for r, e in sorted(errors.items())]
        detail = "; ".join(said) + f"; then {detail}"
    result = unjudged_result(measured.case, check, detail, world.world_size) if measured is not None else None
    text = _text(result, world) if result is not None else f"clipcheck audit: {check}: {detail}"
    if world.rank == 0:
        print(text, file=sys.stderr, flush=True)
        world.signal_ended()
    world.hang_handler = world.default_hang_handler
    return AuditReport(rank=world.rank, world_size=world.world_size, backend=world.backend, verdict="ERROR",
                       text=text, result=result, broken=True)


PEER_POST_WAIT_S = 5.0
"""How long a hung rank 0 waits for its peers' posts (their watchdogs fire at about the same time)."""


def _posts_of_peers(world: UserWorld) -> dict[int, str]:
    """What the other ranks posted in this audit, waiting up to ``PEER_POST_WAIT_S`` for every one."""
    deadline = time.monotonic() + PEER_POST_WAIT_S
    errors = world.posted_errors()
    while len(errors) < world.world_size - 1 and time.monotonic() < deadline:
        time.sleep(0.1)
        errors = world.posted_errors()
    return errors


def _innermost(message: str) -> str:
    """Where a hung rank's stack ends (its last frame and line of code), from the watchdog's message."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    frames = [i for i, line in enumerate(lines) if line.startswith("File ")]
    if not frames:
        return message.splitlines()[0] if message else "?"
    i = frames[-1]
    code = f" ({lines[i + 1]})" if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
    return lines[i] + code


def _peer_hung(world: UserWorld, message: str) -> None:
    """A rank other than 0 stuck in the clip: says where (``UserWorld.post_error``, read by rank 0's report),
    then waits for the end of the run as the harness's hung ranks do."""
    try:
        world.side_store.set(f"audit{world.audits}/error/{world.rank}", f"hung in {_innermost(message)}")
    except Exception:  # noqa: BLE001 - best effort: rank 0 reports the hang either way
        pass
    world.default_hang_handler(message)


def _rank0_hung(world: UserWorld, measured: _Case | None, message: str) -> None:
    """Rank 0's own watchdog: its main thread is stuck in the clip, so this thread reports the case (rank 0
    stuck where ``message`` says, and what its peers posted), ends the run for every rank and leaves
    (status 3)."""
    _ended(world, measured, "hang", f"rank 0 hung in {_innermost(message)}")
    os._exit(3)


def describe_error(exc: BaseException) -> str:
    return describe_exception(exc)


__all__ = ["AuditReport", "run_audit", "clip_label", "job_mesh", "cheap_scale", "mangled_reason"]
