"""Clips an fp32 copy: scales ``g.float()`` in place, so non-fp32 gradients are never clipped.

The norm is right, but each gradient is clipped through ``g.float().mul_(coef)``: for an fp32
gradient ``.float()`` is the tensor itself, for bf16/fp16 (and fp64: ``.float()`` narrows, so it
is a copy too) it is a temporary that is scaled and thrown away. It models clipping the wrong
tensors: fp32 master copies while the model's fp16 gradients stay as they were (fastai2#528), or
``clip_grads_with_norm_`` handed fresh tensors instead of the parameters (huggingface/transformers
PR #46113: norm right, no clipping applied).
"""

from harness.clipmath import local_tensor

from ._shapes import scales_a_copy

clip = scales_a_copy(lambda grad: local_tensor(grad).float())
