"""Inf norm summed: for the inf norm, rank-local maxima are SUMmed instead of MAXed.

The p-norm path is right; the inf branch reuses its reduction (the class of torchrec #3199 and of
ColossalAI's inf branch): the reported maximum grows with the number of ranks holding gradients.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.clipmath import clip_coefficient, collective_scalar, root, scale_grads_
from harness.reference import reference_partial


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    params, local = reference_partial(model, norm_type)
    total = collective_scalar(local)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)  # the mistake: SUM whatever the norm type
    norm = root(float(total), norm_type)
    scale_grads_((p for _, p in params), clip_coefficient(max_norm, norm))
    return torch.tensor(norm, dtype=torch.float64)
