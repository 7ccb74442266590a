"""Group norms added linearly: the dense and the expert norm are summed, not combined as p-norms.

ColossalAI's MoE ZeRO optimizer keeps one gradient store per group and does ``norm_group +=
self._compute_grad_norm(...)`` per store (0.5.0 and HEAD, §6 row 33): ||a|| + ||b|| instead of
(||a||^p + ||b||^p)^(1/p), too large whenever both groups hold gradients.
"""

import math

import torch
import torch.nn as nn

from harness.clipmath import clip_coefficient, is_inf_norm, scale_grads_

from ._shapes import group_norms


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    dense, experts, dense_norm, expert_norm = group_norms(model, norm_type)
    total = max(dense_norm, expert_norm) if is_inf_norm(norm_type) else dense_norm + expert_norm
    if math.isnan(dense_norm) or math.isnan(expert_norm):
        total = math.nan
    scale_grads_(dense + experts, clip_coefficient(max_norm, total))
    return torch.tensor(total, dtype=torch.float64)
