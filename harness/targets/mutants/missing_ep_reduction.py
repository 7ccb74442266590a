"""Missing EP reduction: partial norms are reduced over every mesh axis except ``ep``.

The expert-parallel axis is the one a dense-model clip never had (NeMo Automodel #3816, torchtitan
before ep_enabled): each EP group ends up clipping with the norm of its own experts.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.spec.axes import MeshAxis
from harness.clipmath import clip_coefficient, collective_scalar, reduce_op, root, scale_grads_
from harness.spec.context import context
from harness.reference import reference_partial


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    ctx = context(model)
    params, local = reference_partial(model, norm_type)
    total = collective_scalar(local)
    for axis in ctx.mesh_spec.names:
        if axis != MeshAxis.EP:
            dist.all_reduce(total, op=reduce_op(norm_type), group=ctx.group(axis))
    norm = root(float(total), norm_type)
    scale_grads_((p for _, p in params), clip_coefficient(max_norm, norm))
    return torch.tensor(norm, dtype=torch.float64)
