"""The inf-norm branch crashes: only ``norm_type=inf`` takes a code path nobody ran.

ColossalAI's ``HybridParallelZeroOptimizer._compute_grad_norm`` calls the base method with its
arguments shifted (``TypeError: object of type 'float' has no len()``, 0.5.0, §6 row 33); VeOmni's
MoE-LoRA inf path called ``torch.maximum`` with three tensors (PR #758 review). Every other norm
type is the reference.
"""

import torch
import torch.nn as nn

from harness.clipmath import is_inf_norm
from harness.reference import clip_grad_norm as reference


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    if is_inf_norm(norm_type):
        raise TypeError("object of type 'float' has no len()")
    return reference(model, max_norm=max_norm, norm_type=norm_type)
