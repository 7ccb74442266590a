"""Empty expert list: a rank that holds no expert gradient crashes instead of adding zero.

torchtitan's EP clip computed ``get_total_norm([])`` for the expert parameters of a dense-only
pipeline stage, got a plain ``tensor(0.)`` and called ``.full_tensor()`` on it (PR #1541; the same
for an empty non-EP list, PR #2270). Here: the reference clip, except that with ``ep > 1`` a rank
holding no gradient sharded over ``ep`` raises torchtitan's error.
"""

import torch
import torch.nn as nn

from harness.clipmath import trainable_with_grads
from harness.reference import clip_grad_norm as reference
from harness.cases.axes import MeshAxis
from harness.cases.context import context
from harness.cases.layout import Shard


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    ctx = context(model)
    if ctx.group_size(MeshAxis.EP) > 1:
        experts = [n for n, _ in trainable_with_grads(model)
                   if isinstance(ctx.declared_placement(n, MeshAxis.EP), Shard)]
        if not experts:
            raise AttributeError("'Tensor' object has no attribute 'full_tensor'")
    return reference(model, max_norm=max_norm, norm_type=norm_type)
