"""The per-case checks, judged on rank 0 from every rank's record.

Each check answers one question a user would ask of a clip function:

* ``truth``        harness self-check: measured (MAX-MIN) truth == constructive (float64) truth.
* ``raised``       did the function finish on every rank?
* ``norm``         is the reported norm the true global norm (tolerance by dtype)?
* ``agree``        does every rank report the same norm?
* ``coefficient``  was every gradient scaled by min(1, max_norm / (true + eps)), uniformly?
* ``replicas``     are true replicas still bit-identical after clipping?
* ``nonfinite``    with a non-finite gradient, did every rank take the same action?
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from .case import CaseSpec
from .clipmath import clip_coefficient
from .layout import MeshSpec, Replicate, Shard
from .oracle import Replication, StatsTable, bit_words, declared_norm, norms_agree
from .signatures import Evidence, explain

NORM_RTOL = {"fp64": 1e-9, "fp32": 1e-5, "fp16": 2e-3, "bf16": 1e-2}
"""Relative tolerance on a reported norm: what a correct implementation computing in that dtype
can be off by (bf16/fp16 targets often accumulate per-tensor norms in the low-precision type)."""

UNIT_ROUNDOFF = {"fp64": 2.0**-53, "fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}

_COLLATERAL = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "timed out")


def tolerance(dtype: str) -> float:
    return NORM_RTOL[dtype]


def coefficient_tolerance(dtype: str) -> float:
    return NORM_RTOL[dtype] + 8 * UNIT_ROUNDOFF[dtype]


# -- local, on every rank -----------------------------------------------------------------------------
def applied_coefficients(
    pre: Mapping[str, torch.Tensor | None], post: Mapping[str, torch.Tensor | None]
) -> dict[str, Any]:
    """Per parameter: the factor the gradient was scaled by (least squares) and how far from uniform.

    Returns ``{"scale": {name: [c, residual]}, "vanished": [...], "unchanged": bool}``; ``residual``
    is max |post - c*pre| relative to max |c*pre|, so a non-uniform scaling shows up even when the
    average factor looks right.
    """
    scale: dict[str, list[float]] = {}
    vanished: list[str] = []
    unchanged = True
    for name, before in pre.items():
        if before is None:
            continue
        after = post.get(name)
        if after is None:
            vanished.append(name)
            unchanged = False
            continue
        a = before.detach().to(torch.float64).reshape(-1).cpu()
        b = after.detach().to(torch.float64).reshape(-1).cpu()
        if unchanged and not torch.equal(bit_words(before).cpu(), bit_words(after).cpu()):
            unchanged = False
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            continue
        denom = float((a * a).sum())
        if denom == 0.0:
            continue
        c = float((a * b).sum()) / denom
        top = float(a.abs().max()) * max(abs(c), 1e-300)
        residual = float((b - c * a).abs().max()) / top
        scale[name] = [c, residual]
    return {"scale": scale, "vanished": vanished, "unchanged": unchanged}


# -- on rank 0 -----------------------------------------------------------------------------------------
@dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""


@dataclass
class CaseResult:
    case: CaseSpec
    verdict: str  # PASS | FAIL | ERROR (harness error) | SKIP (a framework it needs is missing)
    truth: float
    measured_truth: float
    reported: list[float | None]
    checks: list[Check]
    signature: list[str]
    placements: dict[str, str]
    mismatches: list[str]
    coefficient: float | None
    seconds: float
    errors: list[str | None] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        r = self.reported[0] if self.reported else None
        if r is None or not math.isfinite(self.truth) or self.truth == 0:
            return None
        return r / self.truth

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]


def declared_mismatches(
    declared: Mapping[str, Mapping[str, object]],
    replication: Replication,
    stats: StatsTable,
    mesh: MeshSpec,
) -> list[str]:
    """Parameters whose declared placement contradicts the measured one, grouped for reading."""
    groups: dict[str, list[str]] = {}
    for j, name in enumerate(stats.names):
        all_zero = all(stats.pow_sum[r][j] == 0 for r in range(stats.world_size) if stats.present(r, j))
        for dim in mesh.names:
            if mesh.size(dim) == 1:
                continue
            placement = declared.get(name, {}).get(dim, Replicate())
            distinct = replication.distinct[dim][name]
            if isinstance(placement, Replicate) and distinct:
                key = f"declared Replicate on {dim}, measured distinct"
            elif isinstance(placement, Shard) and not distinct and not all_zero:
                key = f"declared {placement} on {dim}, measured replicated"
            else:
                continue
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


def _collateral(error: str) -> bool:
    return any(marker in error for marker in _COLLATERAL)


def describe_errors(errors: Sequence[str | None]) -> str:
    """The root causes first (ranks with the same message together), then who failed in consequence
    (a peer's connection closing under it, or a timeout waiting for one)."""
    raised = [r for r, e in enumerate(errors) if e is not None]
    primary = [r for r in raised if not _collateral(errors[r])] or raised
    by_message: dict[str, list[int]] = {}
    for r in primary:
        by_message.setdefault(errors[r], []).append(r)
    shown = list(by_message.items())[:2]
    text = "; ".join(f"rank {ranks[0]}: {msg}" if len(ranks) == 1 else f"ranks {ranks}: {msg}" for msg, ranks in shown)
    others = sorted(set(raised) - {r for _, ranks in shown for r in ranks})
    if others:
        text += f" (ranks {others} failed in consequence)"
    return text


def _fmt(x: float | None) -> str:
    return "none" if x is None else f"{x:.6g}"


def evaluate(
    case: CaseSpec,
    truth: float,
    measured: float,
    stats: StatsTable,
    pre: Replication,
    post: Replication,
    records: Sequence[Mapping[str, Any]],
) -> CaseResult:
    mesh = case.layout.mesh
    dtype = case.injection.dtype
    rtol = tolerance(dtype)
    reported: list[float | None] = [r["reported"] for r in records]
    errors: list[str | None] = [r["error"] for r in records]
    checks: list[Check] = []
    signature: list[str] = []
    mismatches = declared_mismatches(case.variant.declared, pre, stats, mesh)

    truth_ok = norms_agree(measured, truth, 1e-9)
    checks.append(
        Check("truth", truth_ok, "" if truth_ok else
              f"HARNESS ERROR: measured truth {measured!r} != constructive truth {truth!r}; the injected "
              "gradients do not have the replication structure the layout describes")
    )

    finite_truth = math.isfinite(truth)
    raised = [r for r, e in enumerate(errors) if e is not None]
    collateral = {r for r in raised if _collateral(errors[r])}
    if raised:
        text = describe_errors(errors)
        # raising on every rank, by itself, is a legitimate answer to a non-finite gradient
        consistent_nonfinite_raise = not finite_truth and len(raised) == len(records) and not collateral
        checks.append(Check("raised", consistent_nonfinite_raise, text))

    if finite_truth and not raised:
        bad = [r for r, v in enumerate(reported) if v is None or not norms_agree(v, truth, rtol)]
        detail = ""
        if bad:
            ratios = {r: (reported[r] / truth if reported[r] is not None and truth else None) for r in bad}
            detail = "reported/true " + ", ".join(f"rank {r}: {_fmt(x)}" for r, x in list(ratios.items())[:4])
            evidence = Evidence(
                truth=truth,
                norm_type=case.norm_type,
                mesh=mesh,
                local_norms=stats.local_norms(case.norm_type),
                declared_norm=declared_norm(stats, mesh, case.variant.declared, case.norm_type),
                declared_mismatches=mismatches,
            )
            signature = explain([v for v in reported if v is not None], evidence, rtol)
        checks.append(Check("norm", not bad, detail))

    if not raised:
        values = {repr(v) for v in reported}
        checks.append(Check("agree", len(values) == 1,
                            "" if len(values) == 1 else "ranks report " + ", ".join(
                                f"{r}: {_fmt(v)}" for r, v in enumerate(reported))))

    coefficient = None
    if finite_truth and not raised:
        expected = clip_coefficient(case.max_norm, truth)
        ctol = coefficient_tolerance(dtype)
        worst: tuple[float, str] | None = None
        all_c: list[float] = []
        for r, rec in enumerate(records):
            for name in rec["local"]["vanished"]:
                worst = (math.inf, f"rank {r}: {name} lost its gradient")
            for name, (c, residual) in rec["local"]["scale"].items():
                all_c.append(c)
                off = abs(c - expected) / expected
                uniform = residual <= 8 * UNIT_ROUNDOFF[dtype]
                if (off > ctol or not uniform) and (worst is None or off > worst[0]):
                    how = (f"scaled by {c:.6g}" if uniform
                           else f"scaled non-uniformly (~{c:.6g}, residual {residual:.2g})")
                    worst = (off, f"rank {r}: {name} {how}, expected {expected:.6g}")
        if all_c:
            all_c.sort()
            coefficient = all_c[len(all_c) // 2]
        checks.append(Check("coefficient", worst is None, "" if worst is None else worst[1]))

    diverged = [
        f"{name} on {dim}"
        for dim in mesh.names
        if mesh.size(dim) > 1
        for name in stats.names
        if not pre.distinct[dim][name] and post.distinct[dim][name]
    ]
    checks.append(Check("replicas", not diverged,
                        "" if not diverged else "replicas diverged after clipping: " + ", ".join(diverged[:4])))

    if not finite_truth:
        outcome = [
            ("collateral" if r in collateral else "raised") if e is not None
            else ("nonfinite" if v is not None and not math.isfinite(v) else "finite")
            for r, (e, v) in enumerate(zip(errors, reported))
        ]
        actions = ["unchanged" if rec["local"]["unchanged"] else "changed" for rec in records]
        ok = len(set(outcome)) == 1 and outcome[0] in ("raised", "nonfinite") and len(set(actions)) == 1
        detail = "" if ok else "per rank: " + ", ".join(
            f"{r}: {o}/{a}" for r, (o, a) in enumerate(zip(outcome, actions)))
        checks.append(Check("nonfinite", ok, detail))

    if not truth_ok:
        verdict = "ERROR"
    elif all(c.passed for c in checks):
        verdict = "PASS"
    else:
        verdict = "FAIL"
    return CaseResult(
        case=case,
        verdict=verdict,
        truth=truth,
        measured_truth=measured,
        reported=reported,
        checks=checks,
        signature=signature,
        placements={name: pre.describe(name, mesh) for name in stats.names},
        mismatches=mismatches,
        coefficient=coefficient,
        seconds=max(float(r["seconds"]) for r in records),
        errors=errors,
    )


def skipped_result(case: CaseSpec) -> CaseResult:
    """A case that cannot run here: reported with its reason, counted neither as pass nor as fail."""
    return CaseResult(case=case, verdict="SKIP", truth=math.nan, measured_truth=math.nan, reported=[],
                      checks=[Check("skip", True, case.skip or "")], signature=[], placements={}, mismatches=[],
                      coefficient=None, seconds=0.0)


def setup_failed_result(case: CaseSpec, truth: float, errors: Sequence[str | None], seconds: float) -> CaseResult:
    """The framework's own setup (its dress step) raised: the clip was never reached."""
    detail = describe_errors(errors)
    return CaseResult(case=case, verdict="FAIL", truth=truth, measured_truth=math.nan, reported=[None] * len(errors),
                      checks=[Check("setup", False, f"the framework setup raised: {detail}")], signature=[],
                      placements={}, mismatches=[], coefficient=None, seconds=seconds, errors=list(errors))
