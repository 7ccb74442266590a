"""What ``harness.audit`` measures of a clip's effects without a copy of the gradients (``restore=False``):
the parameters' check from their storage, version counters and sampled bits (``ParamMarks``), the
coefficient from the row norms and samples of the two passes (``cheap_scale``), the non-finite policy
from what was kept (``cheap_policies``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from harness.cases.injection import DTYPES
from harness.clipmath import local_tensor, smallest_normal
from harness.run.case.effects import POLICIES, canonical_nans
from harness.run.case.factor_fit import Factor, FitSums, best_fit, normal_elements, relative_residual
from harness.run.audit.gradient_pass import Stats, sample_positions
from harness.run.case.measure import linear_digest

ROW_SLACK = {torch.float64: 48 * 2.0**-53}
"""How far a row norm's ratio before/after may stray from the coefficient by the rounding of the row
norms themselves (``ROW`` elements summed in fp32 on 16 lanes: at most ~21 units in the last place for
the ratio; twice that here): subtracted before a row's spread counts as non-uniform scaling."""
_FP32_ROW_SLACK = 48 * 2.0**-24



# -- the parameters' own check, without a copy ----------------------------------------------------------
@dataclass
class ParamMarks:
    """What a clip must leave alone, kept without copying the parameters: each local tensor's storage,
    version counter, shape, dtype and sampled bits."""

    marks: dict[str, tuple[int, int, tuple[int, ...], str]]
    words: dict[str, list[int]]

    @classmethod
    def of(cls, params: Sequence[tuple[str, nn.Parameter]]) -> "ParamMarks":
        marks, sampled = {}, {}
        for name, p in params:
            t = local_tensor(p).detach()
            marks[name] = (t.data_ptr(), t._version, tuple(t.shape), str(t.dtype))
            flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
            positions = torch.tensor(sample_positions(flat.numel()), dtype=torch.int64, device=flat.device)
            sampled[name] = flat.view(torch.uint8).view(-1, flat.element_size())[positions]
        by_device: dict[torch.device, list[str]] = {}
        for name, t in sampled.items():
            by_device.setdefault(t.device, []).append(name)
        words: dict[str, list[int]] = {}
        for names in by_device.values():
            every: list[int] = torch.cat([sampled[n].reshape(-1) for n in names]).tolist() if names else []
            at = 0
            for n in names:
                k = sampled[n].numel()
                words[n], at = every[at:at + k], at + k
        return cls(marks, words)

    def changed(self, after: "ParamMarks") -> list[str]:
        out = []
        for name, (ptr, version, shape, dtype) in self.marks.items():
            now = after.marks.get(name)
            if now is None:
                out.append(f"{name} (gone)")
            elif now[2:] != (shape, dtype):
                out.append(f"{name} ({shape} {dtype} -> {now[2]} {now[3]})")
            elif now[0] != ptr:
                out.append(f"{name} (storage replaced)")
            elif after.words[name] != self.words[name]:
                out.append(name)
            elif now[1] != version:
                out.append(f"{name} (written in place)")
        return out


# -- the coefficient without a copy ---------------------------------------------------------------------
def cheap_scale(before: Stats, after: Stats) -> list[float] | None:
    """The record's ``[c, residual, elements(, slack)]`` from two passes, as ``effects.applied_coefficients``
    measures it from copies: the coefficient fitted on the sampled elements as every reading fits
    (``factor_fit``), checked against the ratio of the sums of squares; the residual the largest relative
    deviation of a sampled element, of a row's norm ratio (minus the row norms' own rounding and the fit's
    slack) and of the two estimates. None where no factor applies (a zero gradient, or a non-finite value
    before or after)."""
    if not (before.finite and after.finite) or before.sq == 0.0 or before.rows is None or after.rows is None:
        return None
    magnitude = math.sqrt(after.sq / before.sq)
    dtype = DTYPES.get(before.dtype, torch.float64)
    a, b = torch.tensor(before.values, dtype=torch.float64), torch.tensor(after.values, dtype=torch.float64)
    normal = normal_elements(a, b, smallest_normal(dtype))
    everything = FitSums(float(a @ a), float(a @ b), len(a), float(a.abs().sum()))
    normal_a = a * normal
    factor = best_fit(everything, FitSums(float(normal_a @ normal_a), float(normal_a @ b), len(a)), dtype)
    if factor is None:  # no sampled element carries a value: the magnitudes alone
        factor = Factor(magnitude, 0.0)
    c = factor.c
    if c == 0.0:
        return [0.0, 0.0 if magnitude == 0.0 else math.inf, before.numel]
    slack = ROW_SLACK.get(before.rows.dtype, _FP32_ROW_SLACK) + factor.slack
    top = float((a * c).abs().max()) if len(a) else 0.0
    sampled = relative_residual(float((b - c * a).abs().max()) if len(a) else 0.0, top, dtype)
    agreement = max(0.0, abs(magnitude - abs(c)) / abs(c) - slack)
    rows_before, rows_after = before.rows.to(torch.float64), after.rows.to(torch.float64)
    held = rows_before > 0
    appeared = False
    if not bool(held.all()):  # rows of zeros carry no ratio (the usual gradient has none: nothing copied)
        appeared = bool((rows_after[~held] != 0).any())  # values where there were only zeros
        rows_before, rows_after = rows_before[held], rows_after[held]
    spread = math.inf if appeared else 0.0 if not rows_before.numel() else \
        float((rows_after / rows_before).sub_(abs(c)).abs_().max()) / abs(c)
    return factor.entry(max(sampled, agreement, max(0.0, spread - slack)), before.numel)


def cheap_policies(before: Stats, after: torch.Tensor | None, digest_before: str | None) -> dict[str, bool]:
    """Which non-finite policies one gradient is consistent with, from what was kept: ``leave`` by its
    digest before and after, ``zero`` and ``poison`` from the gradient after the call."""
    if after is None:
        return dict.fromkeys(POLICIES, False)
    nan = torch.isnan(after)
    nans = int(nan.sum())
    canonical = canonical_nans({"g": after})["g"]
    assert canonical is not None
    # zero: every element 0, NaN only where the gradient was not finite (by count: no copy to compare)
    return {"leave": digest_before is not None and digest_before == linear_digest(canonical),
            "zero": bool(((after == 0) | nan).all()) and nans <= sum(before.nonfinite),
            "poison": nans == after.numel()}
