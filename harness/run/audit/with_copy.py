"""The coefficient a clip applied, measured exactly from the copy ``restore=True`` keeps, at the size of a
real model: ``effects.applied_coefficients``'s numbers (least-squares factor per gradient, the largest
relative residual), computed in float64 blocks on the gradients' own device, so the measurement needs one
block of scratch memory, not the float64 copies of every gradient (and a host copy on a GPU) the
harness's small cases can afford (what those copies took: docs/performance.md, "Figures cited by the
code")."""

from __future__ import annotations

import math
from typing import Iterator, Mapping

import torch

from harness.clipmath import smallest_normal
from harness.run.case.factor_fit import Factor, FitSums, best_fit, fit, normal_elements, relative_residual

BLOCK = 1 << 20
"""Elements converted to float64 at once (8 MiB of scratch per operand)."""

Grads = Mapping[str, "torch.Tensor | None"]


def blocked_coefficients(pre: Grads, post: Grads) -> tuple[dict[str, list[float]], list[str]]:
    """``({name: [c, residual, elements(, slack)]}, vanished)``, the ``scale`` and ``vanished`` of
    ``applied_coefficients``, fitted as every reading fits (``factor_fit``); no factor for a gradient with a
    non-finite value before or after, or an all-zero one. Two passes over each gradient's blocks, the numbers
    kept on the device and brought to the host once per pass (and, for a gradient whose sums are not finite,
    its finiteness); a third only for a gradient whose fit on all elements has a slack (gradients near their
    dtype's smallest normal number, in practice fp16 ones clipped hard)."""
    vanished = [n for n, before in pre.items() if before is not None and post.get(n) is None]
    names = [n for n, before in pre.items() if before is not None and post.get(n) is not None]
    if not names:
        return {}, vanished
    sums = []  # per gradient: sum a*a, sum a*b, max |a|, on its device
    for name in names:
        a, b = _flat(pre[name]), _flat(post[name])
        acc = torch.zeros(3, dtype=torch.float64, device=a.device)
        for x, y in _blocks(a, b):
            acc[0] += torch.dot(x, x)
            acc[1] += torch.dot(x, y)
            acc[2] = torch.maximum(acc[2], _max_abs(x))
        sums.append(acc)
    factors: dict[str, Factor] = {}
    residuals = []
    for name, (denom, dot, top) in zip(names, [acc.tolist() for acc in _host(sums)]):
        a, b = _flat(pre[name]), _flat(post[name])
        # finite sums prove finite values (a NaN or inf in a or b reaches sum a*a or sum a*b); only a
        # gradient whose sums are not finite (rare) is checked element by element
        if not (math.isfinite(denom) and math.isfinite(dot)) and not (
                bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            continue
        everything = FitSums(denom, dot, a.numel())
        whole = fit(everything, a.dtype)
        factor = best_fit(*_separated(a, b), a.dtype) if whole is not None and whole.slack > 0.0 else whole
        if factor is None:
            continue
        factors[name] = factor
        worst = torch.zeros((), dtype=torch.float64, device=a.device)
        for x, y in _blocks(a, b):
            worst = torch.maximum(worst, _max_abs(y.sub_(x, alpha=factor.c)))
        residuals.append((name, worst, top * max(abs(factor.c), 1e-300), a.numel()))
    worst_host = _host([r[1] for r in residuals])
    scale = {name: factors[name].entry(relative_residual(float(w), scaled_top, _flat(pre[name]).dtype), numel)
             for (name, _, scaled_top, numel), w in zip(residuals, worst_host)}
    return scale, vanished


def _separated(a: torch.Tensor, b: torch.Tensor) -> tuple[FitSums, FitSums]:
    """The fit's sums over all elements with sum |a| (a tighter slack than Cauchy-Schwarz gives), and over
    the elements that are normal numbers before and after (``factor_fit.best_fit``): one more pass."""
    sums = torch.zeros(5, dtype=torch.float64, device=a.device)
    smallest = smallest_normal(a.dtype)
    for x, y in _blocks(a, b):
        sums[0] += torch.dot(x, x)
        sums[1] += torch.dot(x, y)
        sums[2] += x.abs().sum()
        x.mul_(normal_elements(x, y, smallest))
        sums[3] += torch.dot(x, x)
        sums[4] += torch.dot(x, y)
    denom, dot, abs_sum, normal_denom, normal_dot = sums.tolist()
    return FitSums(denom, dot, a.numel(), abs_sum), FitSums(normal_denom, normal_dot, a.numel())


def _blocks(a: torch.Tensor, b: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``a`` and ``b`` block by block in float64, converted into two scratch buffers allocated once per
    gradient (a fresh float64 tensor per block left the CPU allocator holding about one more copy of
    the gradients by the end: docs/audit.md, "Cost"; docs/performance.md, "Figures cited by the code").
    ``y`` may be overwritten."""
    n = min(BLOCK, a.numel())
    bx = torch.empty(n, dtype=torch.float64, device=a.device)
    by = torch.empty(n, dtype=torch.float64, device=a.device)
    for start in range(0, a.numel(), BLOCK):
        k = min(BLOCK, a.numel() - start)
        x, y = bx[:k], by[:k]
        x.copy_(a[start:start + k])
        y.copy_(b[start:start + k])
        yield x, y


def _max_abs(x: torch.Tensor) -> torch.Tensor:
    """max |x| through ``aminmax`` (on CPUs many times faster than ``abs().max()``)."""
    if not x.numel():
        return torch.zeros((), dtype=x.dtype, device=x.device)
    low, high = torch.aminmax(x)
    return torch.maximum(-low, high)


def _flat(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None  # only present gradients are measured
    return t.detach().reshape(-1)


def _host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the host, one transfer per device (a GPU synchronized once, not per gradient)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for indices in by_device.values():
        moved = torch.stack([tensors[i].reshape(-1) for i in indices]).cpu()
        for row, i in enumerate(indices):
            out[i] = moved[row].reshape(tensors[i].shape)
    return out
