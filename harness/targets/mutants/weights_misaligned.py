"""Weights misaligned: per-parameter replica weights zipped with the filtered list of gradients.

The replica weights (1 / true replica count) are built for every trainable parameter, including
those whose gradient is None, but zipped with only the parameters that have a gradient; after the
first None gradient every later parameter is weighted with its predecessor's count (and the last
weight is dropped). It models a clip that computes its de-duplication metadata in one pass over
``model.parameters()`` (Megatron-style "is this a TP duplicate / how many replicas" flags, DeepSpeed's
per-parameter ``allreduce`` marks) and its gradient list in another, filtered by ``p.grad is not
None``: exact until an expert gets no tokens. The inf norm ignores weights, so it stays right.
"""

import torch
import torch.nn as nn

from harness.clipmath import combine, is_inf_norm, pow_sum, reduce_root_and_clip, trainable_with_grads
from harness.cases.context import context


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    ctx = context(model)
    counts = [ctx.true_replica_count(n) for n, p in model.named_parameters() if p.requires_grad]
    params = trainable_with_grads(model)
    local = 0.0
    for (_, p), count in zip(params, counts):  # the mistake: two lists filtered differently
        assert p.grad is not None  # trainable_with_grads
        part = pow_sum(p.grad, norm_type)
        if not is_inf_norm(norm_type):
            part /= count
        local = combine(local, part, norm_type)
    norm = reduce_root_and_clip(local, (p for _, p in params), max_norm=max_norm, norm_type=norm_type)
    return torch.tensor(norm, dtype=torch.float64)
