"""Scales a materialized copy: ``p.grad.full_tensor().mul_(coef)`` on DTensor gradients.

The norm is right and plain gradients are clipped in place, but a DTensor gradient is clipped
through ``full_tensor()``, which all-gathers the shards into a new tensor: the copy is scaled and
thrown away, the parameter's own shards never change. It models code written against plain tensors
and later handed FSDP2/TP DTensors (any ``.full_tensor()``, ``.redistribute()`` or ``.to_local()``
of a redistributed gradient used as if it were the gradient itself). No upstream report is known;
fuzzing with plain tensors only let it pass 60 examples, which is why the fuzzer draws DTensors.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from harness.clipmath import clip_coefficient, collective_device, reduce_op, root
from harness.reference import reference_partial


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    params, local = reference_partial(model, norm_type)
    total = torch.tensor([local, float(math.isnan(local))], dtype=torch.float64, device=collective_device())
    dist.all_reduce(total, op=reduce_op(norm_type))
    norm = math.nan if total[1] > 0 else root(float(total[0]), norm_type)
    coefficient = clip_coefficient(max_norm, norm)
    if math.isfinite(coefficient) and coefficient < 1.0:
        for _, p in params:
            assert p.grad is not None  # reference_partial: the parameters with gradients
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad  # the mistake: a copy
            grad.mul_(coefficient)
    return torch.tensor(norm, dtype=torch.float64)
