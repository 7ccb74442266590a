"""The reference clip: correct by construction for any layout the harness can describe.

Each rank adds sum |g|^p of its local gradients, each weighted by 1/(number of ranks holding the same
slice), then one SUM all-reduce over the world and a single root (a MAX all-reduce, no weights, for
the inf norm). Weighting instead of rank filtering means every rank takes the same code path and
the same single collective, whatever it holds: a rank with no experts, or an expert whose gradient
is None, adds zero and still joins the reduction.

It reads the true layout through ``harness.context(model)``; it is the control target that every
other target is compared with, and the harness's own checks are shown to pass on it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from harness.clipmath import reduce_root_and_clip, trainable_with_grads, weighted_partial
from harness.cases.context import context


def reference_partial(model: nn.Module, norm_type: float) -> tuple[list[tuple[str, nn.Parameter]], float]:
    """The trainable parameters with gradients, and this rank's correctly de-duplicated share of the
    global p-th power sum: the reference's first half. The mutants reuse it and go wrong afterwards."""
    ctx = context(model)
    params = trainable_with_grads(model)
    return params, weighted_partial(params, norm_type, lambda name, _: ctx.true_replica_count(name))


def clip_grad_norm(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    params, local = reference_partial(model, norm_type)
    norm = reduce_root_and_clip(local, (p for _, p in params), max_norm=max_norm, norm_type=norm_type)
    return torch.tensor(norm, dtype=torch.float64)
