"""What the function under test did on this rank: to its gradients, to its parameters, to the
process groups it was given. Rank-local, no communication; rank 0 judges the results (``checks``).

Measured from snapshots taken just before the call, so the judge never trusts the target's account:

* the factor each gradient was scaled by (least squares) and how far from uniform;
* gradients the target deleted (``p.grad = None``) or replaced by a tensor of another shape, dtype or
  device ("mangled": the harness measures the rest of the case without them instead of crashing);
* parameters whose values changed (a clip function must only touch gradients);
* with a non-finite gradient in the case: which *non-finite policies* the rank's gradients are
  consistent with. A clip may legitimately leave the gradients (``leave``), zero them (``zero``: a
  skip step, or torch's ``g * 0`` after an inf norm, where ``inf * 0`` is NaN) or multiply them by a
  NaN coefficient (``poison``: torch's default); every rank holding gradients must do the same one.
  A rank that holds no gradient is consistent with every policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import torch

from harness.clipmath import smallest_normal
from harness.run.case.factor_fit import FitSums, best_fit, normal_elements, relative_residual
from harness.judge.records import Coefficients, RankLocal
from harness.run.case.model_state import ModelState
from harness.run.case.measure import bit_words

Grads = Mapping[str, "torch.Tensor | None"]

POLICIES = ("leave", "zero", "poison")


def mangled_reason(before: torch.Tensor, after: torch.Tensor) -> str | None:
    """Why ``after`` cannot be the same gradient as ``before`` (layout, shape, dtype, device), or None."""
    if after.layout != before.layout:  # a sparse gradient: the harness's own reads would crash on it
        return f"layout {str(before.layout).replace('torch.', '')} -> {str(after.layout).replace('torch.', '')}"
    if tuple(after.shape) != tuple(before.shape):
        return f"shape {tuple(before.shape)} -> {tuple(after.shape)}"
    if after.dtype != before.dtype:
        return f"dtype {before.dtype} -> {after.dtype}"
    if after.device != before.device:
        return f"device {before.device} -> {after.device}"
    return None


def sanitize(pre: Grads, post: Grads) -> tuple[dict[str, torch.Tensor | None], dict[str, str]]:
    """``post`` with every mangled gradient replaced by None, and why each was dropped; the harness's
    own measurements after the call then run on well-formed tensors of the shapes measured before
    the call, on every rank (a gradient that appeared where there was none is left out too)."""
    clean: dict[str, torch.Tensor | None] = {}
    mangled: dict[str, str] = {}
    for name, after in post.items():
        before = pre.get(name)
        if before is None:  # a gradient the target created has nothing to be compared with
            clean[name] = None
            continue
        reason = None if after is None else mangled_reason(before, after)
        if reason is not None:
            mangled[name] = reason
            after = None
        clean[name] = after
    return clean, mangled


def canonical_nans(grads: Grads) -> dict[str, torch.Tensor | None]:
    """Every NaN replaced by the dtype's canonical NaN: NaN payloads and signs carry no meaning (0/0
    and ``x * nan`` give different bits on x86), so replicas must not be told apart by them."""
    out: dict[str, torch.Tensor | None] = {}
    for name, g in grads.items():
        if g is not None and g.is_floating_point():
            g = torch.where(torch.isnan(g), torch.full((), float("nan"), dtype=g.dtype, device=g.device), g)
        out[name] = g
    return out


def snapshot_params(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in named.items()}


def changed_params(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]) -> list[str]:
    """Parameters whose rank-local values, shape or dtype differ from the snapshot, or that vanished."""
    changed = []
    for name, old in before.items():
        new = after.get(name)
        if new is None or mangled_reason(old, new) is not None:
            changed.append(name)
        elif not torch.equal(bit_words(old), bit_words(new.detach())):
            changed.append(name)
    return changed


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def consistent_policies(pre: Grads, post: Grads) -> list[str] | None:
    """The non-finite policies this rank's gradients are consistent with; None when it holds none."""
    held = [(n, g) for n, g in pre.items() if g is not None]
    if not held:
        return None
    ok = dict.fromkeys(POLICIES, True)
    for name, before in held:
        after = post.get(name)
        if after is None:
            return []
        a = before.detach().to(torch.float64).cpu()
        b = after.detach().to(torch.float64).cpu()
        ok["leave"] = ok["leave"] and _same(a, b)
        finite = torch.isfinite(a)
        zeroed = torch.where(finite, b == 0, (b == 0) | torch.isnan(b))
        ok["zero"] = ok["zero"] and bool(zeroed.all())
        ok["poison"] = ok["poison"] and bool(torch.isnan(b).all())
    return [p for p in POLICIES if ok[p]]


def applied_coefficients(pre: Grads, post: Grads) -> Coefficients:
    """Per parameter: the factor the gradient was scaled by (least squares) and how far from uniform.

    Returns ``{"scale": {name: [c, residual, elements(, slack)]}, "vanished": [...], "became_nonfinite": [...]}``
    (``slack``: where no element is a normal number before and after the call, how far the fitted factor may
    be off through subnormal roundings alone, relative: ``factor_fit``, the fit every reading shares);
    ``residual`` is max |post - c*pre| relative to max |c*pre|, so a non-uniform scaling shows up even
    when the average factor looks right (less one subnormal spacing of the gradient's dtype: a subnormal
    element's rounding is absolute, ``clipmath.subnormal_spacing``). ``post`` must already be sanitized
    (same shapes as ``pre``). Parameters with a non-finite value before or after, or an all-zero gradient,
    get no factor; those finite before the call and non-finite after it are named in ``became_nonfinite``
    (the clip itself overflowed or poisoned them: wrong whenever the true norm is finite, ``checks.judge_contract``).

    Why one flat vector: the two sums every factor needs run over all parameters at once, segment
    by segment (per-parameter ops on small gradients cost more in dispatch than in arithmetic); a
    segment's NaN stays inside its own sums, and finite sums prove finite values, so only the
    residual's max, and the finiteness of a parameter whose sums are not finite, are per parameter.
    """
    vanished = [n for n, before in pre.items() if before is not None and post.get(n) is None]
    names = [n for n, before in pre.items() if before is not None and post.get(n) is not None]
    if not names:
        return {"scale": {}, "vanished": vanished, "became_nonfinite": []}
    pre_dtypes = {n: _dtype(pre[n]) for n in names}
    flat_pre = [_flat64(pre[n]) for n in names]
    flat_post = [_flat64(post[n]) for n in names]
    lengths = [t.numel() for t in flat_pre]
    a, b = torch.cat(flat_pre), torch.cat(flat_post)

    def total(values: torch.Tensor) -> list[float]:
        return torch.segment_reduce(values, "sum", lengths=torch.tensor(lengths), unsafe=True).tolist()

    denoms, dots, abs_sums = total(a * a), total(a * b), total(a.abs())
    # the elements that are normal numbers before and after, for gradients whose fit on all of them has a slack
    # (``factor_fit``): summed for all at once, which costs less than finding those gradients first
    smallest = torch.repeat_interleave(torch.tensor([smallest_normal(pre_dtypes[n]) for n in names],
                                                    dtype=torch.float64), torch.tensor(lengths))
    a_n = torch.where(normal_elements(a, b, smallest), a, 0.0)
    normal_denoms, normal_dots, normal_abs = total(a_n * a_n), total(a_n * b), total(a_n.abs())
    scale: dict[str, list[float]] = {}
    became_nonfinite: list[str] = []
    for i, (name, a_j, b_j) in enumerate(zip(names, flat_pre, flat_post)):
        # a non-finite value in a makes sum a*a non-finite, one in b makes sum a*b non-finite (0 * inf
        # is NaN); finite sums prove finite values, and only non-finite sums (rare) are checked one by one
        if not (math.isfinite(denoms[i]) and math.isfinite(dots[i])):
            finite_before = bool(torch.isfinite(a_j).all())
            if not (finite_before and bool(torch.isfinite(b_j).all())):
                if finite_before:
                    became_nonfinite.append(name)
                continue
        dtype = pre_dtypes[name]
        factor = best_fit(FitSums(denoms[i], dots[i], a_j.numel(), abs_sums[i]),
                          FitSums(normal_denoms[i], normal_dots[i], a_j.numel(), normal_abs[i]), dtype)
        if factor is None:
            continue
        top = float(a_j.abs().max()) * max(abs(factor.c), 1e-300)
        worst = float((b_j - factor.c * a_j).abs().max())
        scale[name] = factor.entry(relative_residual(worst, top, dtype), a_j.numel())
    return {"scale": scale, "vanished": vanished, "became_nonfinite": became_nonfinite}


def _dtype(t: torch.Tensor | None) -> torch.dtype:
    assert t is not None  # the callers pass only present gradients
    return t.dtype


def _flat64(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None  # the callers pass only present gradients
    return t.detach().to(torch.float64).reshape(-1).cpu()


class ReadsTheCall(Protocol):
    """How a rank reads what the call did to its gradients' values, from what it kept of them before the
    call: a copy of each (``FromSnapshot``: the runner's small cases; ``harness.audit`` with
    ``restore=True``), or statistics alone (``harness.audit`` without a copy). Everything else about the
    call is measured alike for all of them (``rank_effects``)."""

    def coefficients(self, post: Grads) -> Coefficients:
        """The factor each gradient was scaled by and how uniformly (``applied_coefficients``'s numbers),
        from the sanitized post-call gradients."""
        ...

    def policies(self, post: Grads) -> list[str] | None:
        """The non-finite policies this rank's gradients are consistent with (``consistent_policies``)."""
        ...


@dataclass(frozen=True)
class FromSnapshot:
    """The reading from a copy of every gradient taken before the call."""

    pre: Grads

    def coefficients(self, post: Grads) -> Coefficients:
        return applied_coefficients(self.pre, post)

    def policies(self, post: Grads) -> list[str] | None:
        return consistent_policies(self.pre, post)


@dataclass
class CallEffects:
    """What this rank measured of the call right after it returned (``rank_effects``, for the runner and
    ``harness.audit`` alike); the rank's ``local`` record once the measurements that come later are added
    (``record``)."""

    coefficients: Coefficients
    mangled: dict[str, str]
    replaced: list[str]
    created: list[str]
    changed: list[str]
    """Parameters whose rank-local values changed."""
    flags: Mapping[str, str] = field(default_factory=dict)
    """Parameters whose ``requires_grad`` flag changed, with how."""
    policies: list[str] | None = None
    nonfinite: bool = False
    """The case has a non-finite gradient: the record says which policies the rank is consistent with."""

    @classmethod
    def unmeasured(cls) -> "CallEffects":
        """A call none of whose effects is measured (the audit's one-group runs are judged on their norm)."""
        return cls({"scale": {}, "vanished": [], "became_nonfinite": []}, {}, [], [], [])

    def record(self, *, late: list[str], stale_truth: bool, undelivered: list[str], post_replicas: Any = None,
               implied: bool | None = None) -> RankLocal:
        """The rank's ``local`` record (``RankLocal``), the one place it is built: a gradient that was
        mangled is reported as such, not also as vanished; a parameter is reported once, for its values
        or else for its flag. ``post_replicas``: the runner's part of the replication round after the
        call; ``implied``: the audit's norm was read from the coefficient (the clip returned none)."""
        local: RankLocal = {
            "scale": self.coefficients["scale"],
            "vanished": [n for n in self.coefficients["vanished"] if n not in self.mangled],
            "became_nonfinite": self.coefficients["became_nonfinite"],
            "mangled": self.mangled, "replaced": self.replaced, "created": self.created,
            "params_changed": self.changed + [f"{n} ({why})" for n, why in self.flags.items() if n not in self.changed],
            "late": late, "stale_truth": stale_truth, "undelivered": undelivered,
        }
        if self.nonfinite:
            local["policies"] = self.policies
        if post_replicas is not None:
            local["post_replicas"] = post_replicas
        if implied is not None:
            local["implied"] = implied
        return local


def rank_effects(
    held: Grads,
    after: Grads,
    reading: ReadsTheCall,
    changed: list[str],
    nonfinite: bool,
    state_before: ModelState | None = None,
    state_after: ModelState | None = None,
    in_place: bool = True,
) -> tuple[dict[str, torch.Tensor | None], CallEffects]:
    """Everything this rank measures about the call at once, as the judge's checks read it (their ``reads``):
    the one path of the runner, ``harness.audit`` and the judge's unit tests.

    ``held``: the gradients before the call, or stand-ins of their shape, dtype and device (what
    ``sanitize`` compares with); ``reading``: how their values before the call are known (a copy, or
    statistics); ``changed``: the parameters whose values changed, as the caller measured them (from a
    snapshot, or from marks without one).

    Returns the sanitized post-call gradients and the ``CallEffects``: applied coefficients, ``mangled``
    (with gradients whose wrapper changed: plain <-> DTensor, or the DTensor's metadata), ``replaced``
    (gradients now in other storage, not scaled in place; left empty for a target whose framework
    legitimately writes new gradient tensors: ``Target.in_place``, and by the audit), ``created``
    (gradients where there were none: a frozen parameter, an expert that got no tokens), changed
    parameters (values, and ``requires_grad`` flags) and, in a case with a non-finite gradient, the
    policies.
    """
    post, mangled = sanitize(held, after)
    if state_before is not None and state_after is not None:
        for name, why in state_before.wrapper_changes(state_after).items():
            mangled.setdefault(name, why)
            post[name] = None
    created = [n for n, before in held.items() if before is None and after.get(n) is not None]
    replaced: list[str] = []
    flags: dict[str, str] = {}
    if state_before is not None and state_after is not None:  # frozen parameters too: not in ``held``
        created += [n for n in state_before.created(state_after) if n not in created]
        flags = state_before.flag_changes(state_after)
        if in_place:
            replaced = [n for n in state_before.replaced(state_after) if n not in mangled and post.get(n) is not None]
    effects = CallEffects(reading.coefficients(post), mangled, replaced, created, changed, flags,
                          reading.policies(post) if nonfinite else None, nonfinite)
    return post, effects
