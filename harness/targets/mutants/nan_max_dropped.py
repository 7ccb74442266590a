"""NaN dropped by MAX: the inf norm merges partial maxima with a bare float MAX all-reduce, no NaN flag.

The p-norms are the reference's. For the inf norm each rank's NaN-aware local maximum goes through
a plain ``all_reduce(op=MAX)``, as in Megatron's ``get_grad_norm_fp32`` and DeepSpeed's
``clip_grad_norm_`` inf branches. gloo's float MAX keeps a NaN only when rank 0 holds it (measured
on 2 and 4 ranks, fp32 and fp64: NaN on rank 0 -> NaN, NaN on any other rank -> the finite maximum
of the rest), so with a NaN gradient away from rank 0 a finite inf norm is reported and the
gradients, NaN included, are clipped as if nothing happened.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.clipmath import clip_coefficient, collective_scalar, is_inf_norm, reduce_root_and_clip, scale_grads_
from harness.reference import reference_partial


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    params, local = reference_partial(model, norm_type)
    if not is_inf_norm(norm_type):
        norm = reduce_root_and_clip(local, (p for _, p in params), max_norm=max_norm, norm_type=norm_type)
        return torch.tensor(norm, dtype=torch.float64)
    total = collective_scalar(local)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)  # the mistake: no NaN flag rides along
    norm = float(total)
    scale_grads_((p for _, p in params), clip_coefficient(max_norm, norm))
    return torch.tensor(norm, dtype=torch.float64)
