"""Experts dropped from the norm: only the dense gradients are counted, every gradient is clipped.

DeepSpeed's unfused fp16 path discarded the expert half of the norm (PR #8613: 6.0 vs 10.0, so the
model is under-clipped); any clip that iterates the non-expert parameter group only does the same.
"""

import torch
import torch.nn as nn

from harness.clipmath import clip_coefficient, scale_grads_

from ._shapes import group_norms


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    dense, experts, dense_norm, _ = group_norms(model, norm_type)
    scale_grads_(dense + experts, clip_coefficient(max_norm, dense_norm))
    return torch.tensor(dense_norm, dtype=torch.float64)
