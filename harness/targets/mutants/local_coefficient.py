"""Clip coefficient from the local norm: the reported norm is global, the scaling is not.

The global norm is computed (and logged) correctly, but each rank scales its gradients by
max_norm / (its own local norm), so replicas and shards are clipped by different factors
(the per-stage clip of torchtitan #596 and xorl's PP path).
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.clipmath import clip_coefficient, collective_scalar, combine, pow_sum, reduce_op, root, scale_grads_
from harness.reference import reference_partial


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    params, local = reference_partial(model, norm_type)
    total = collective_scalar(local)
    dist.all_reduce(total, op=reduce_op(norm_type))
    own = 0.0
    for _, p in params:
        assert p.grad is not None  # reference_partial: the parameters with gradients
        own = combine(own, pow_sum(p.grad, norm_type), norm_type)
    scale_grads_((p for _, p in params), clip_coefficient(max_norm, root(own, norm_type)))
    return torch.tensor(root(float(total), norm_type), dtype=torch.float64)
