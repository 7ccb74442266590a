"""Deliberately broken clip functions: positive controls for the harness's checks.

Each one is the reference clip with exactly one thing wrong, so each should trip exactly the check
named in its docstring (and the reference itself trips none).
"""

import math
import os

import torch
import torch.distributed as dist

from harness.clipmath import local_tensor, trainable_with_grads
from harness.reference import clip_grad_norm as reference


def norm_off(model, *, max_norm, norm_type=2.0):
    """norm: clips correctly but reports a norm 1% too large."""
    return reference(model, max_norm=max_norm, norm_type=norm_type) * 1.01


def ranks_disagree(model, *, max_norm, norm_type=2.0):
    """agree: rank 1 reports the norm one ulp higher (well inside the value tolerance)."""
    total = float(reference(model, max_norm=max_norm, norm_type=norm_type))
    return math.nextafter(total, math.inf) if dist.get_rank() == 1 else total


def no_clip(model, *, max_norm, norm_type=2.0):
    """coefficient: reports the right norm, never scales the gradients."""
    saved = {n: local_tensor(p.grad).clone() for n, p in trainable_with_grads(model)}
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    for n, p in trainable_with_grads(model):
        local_tensor(p.grad).copy_(saved[n])
    return total


def replica_drift(model, *, max_norm, norm_type=2.0):
    """replicas: rank 1 nudges one gradient after clipping, so its replicas stop being identical."""
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    if dist.get_rank() == 1:
        _, p = trainable_with_grads(model)[0]
        local_tensor(p.grad).view(-1)[0] *= 1 + 2**-20
    return total


def raise_on_rank1(model, *, max_norm, norm_type=2.0):
    """raised: rank 1 raises while rank 0 is already inside the all-reduce."""
    if dist.get_rank() == 1:
        raise ValueError("broken on purpose")
    return reference(model, max_norm=max_norm, norm_type=norm_type)


def skip_collective_on_rank1(model, *, max_norm, norm_type=2.0):
    """raised (by timeout): rank 1 skips the all-reduce that rank 0 waits in; nobody raises."""
    if dist.get_rank() == 1:
        return torch.tensor(1.0)
    return reference(model, max_norm=max_norm, norm_type=norm_type)


def exit_on_rank1(model, *, max_norm, norm_type=2.0):
    """A dead rank: the process of rank 1 vanishes mid-case."""
    if dist.get_rank() == 1:
        os._exit(7)
    return reference(model, max_norm=max_norm, norm_type=norm_type)
