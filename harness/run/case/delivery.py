"""Gradients that arrive the way the framework's trainer produces them.

A framework that does something to gradients between the backward and the clip (a post-accumulate
hook that sums shared factors over EP, FSDP's reduce-scatter, a bucketed all-reduce, a cast) would be
bypassed by gradients written into ``.grad`` after its setup: the clip would then see a state no user
of the framework can reach. Such an adapter gives its target a ``backward`` step that produces the
layout's gradients *through* that path (a forward/backward through the framework's wrapped model with
a loss linear in per-parameter seeded directions, or gradients set before the framework's hooks run,
then the hooks), and this module checks that what arrived is, bit for bit, what the layout says.

When it is not, the layout is not reachable through the framework's path (its hooks made replicas of
what the layout says are distinct, say), and the case is a harness error naming the parameters: the
layout must then be marked synthetic (``Variant.synthetic``), where the gradients are injected after
the setup and the case is never called a finding.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from harness.run.case.effects import canonical_nans
from harness.run.case.truth_cache import same_bits

Grads = Mapping[str, "torch.Tensor | None"]


def expected_copies(generated: Grads, device: torch.device) -> dict[str, torch.Tensor | None]:
    """What the framework's path must deliver on this rank, as tensors the adapter may use freely
    (directions of a loss, say) without touching the harness's own copy."""
    return {name: (g.to(device, copy=True) if g is not None else None) for name, g in generated.items()}


def undelivered(expected: Grads, arrived: Grads, limit: int = 4) -> list[str]:
    """One line per parameter whose arrived gradient is not bit-identical to the expected one (NaNs
    compared as NaNs, whatever their payload; None
    where one was expected, or the reverse; another shape or dtype; other values), at most ``limit``
    named and the rest counted."""
    problems: list[str] = []
    expected, arrived = canonical_nans(expected), canonical_nans(arrived)  # NaN payloads carry no meaning
    for name, want in expected.items():
        got = arrived.get(name)
        if want is None and got is None:
            continue
        if want is None or got is None:
            problems.append(f"{name}: {'no gradient' if got is None else 'a gradient'} where the layout has "
                            f"{'one' if got is None else 'none'}")
        elif same_bits({name: want}, {name: got}):
            continue
        elif tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            problems.append(f"{name}: {tuple(got.shape)} {got.dtype} instead of {tuple(want.shape)} {want.dtype}")
        else:
            diff = (got.double() - want.double()).abs().nan_to_num(nan=float("inf"))
            problems.append(f"{name}: {int((diff != 0).sum())} of {want.numel()} elements differ "
                            f"(largest difference {float(diff.max()):.3g})")
    return summarized(problems, limit)


def summarized(lines: Sequence[str], limit: int) -> list[str]:
    """The first ``limit`` lines, and how many more there were."""
    out = list(lines[:limit])
    if len(lines) > limit:
        out.append(f"(+{len(lines) - limit} more)")
    return out
