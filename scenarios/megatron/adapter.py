"""Megatron-core: ``get_grad_norm_fp32`` and ``clip_grad_by_total_norm_fp32`` on parameters marked
the way Megatron marks them (the ``megatron_moe_tp`` scenario), with the gradient selection and the
dense/expert split of its optimizers.

What the clip does here, as Megatron's optimizer does it:
* gradients for the norm: ``param_is_not_shared`` and ``param_is_not_tensor_parallel_duplicate``
  (Megatron's own filter, given the TP group);
* the dense optimizer reduces its norm over the model-parallel group (TP; there is no PP here), the
  expert optimizer over TP x EP; the two norms are combined as ``ChainedOptimizer.get_grad_norm``
  combines norms from different stats groups, sqrt(n_dense^2 + n_expert^2);
* ``clip_grad_by_total_norm_fp32`` scales every gradient by the one total.
Megatron's optimizers clip with the L2 norm only.

On CPU: megatron-core allocates its norm buffers with ``device='cuda'``. ``cuda_on_cpu`` redirects
exactly those allocations to the CPU (a TorchFunctionMode, active only around the two calls, only
when CUDA is absent); and the gradients are passed as ``decoupled_grad`` (Megatron's supported
alternative gradient attribute), because its ``.grad`` path asserts ``torch.cuda.FloatTensor``.
Megatron itself runs unmodified.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, cast

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from harness.run.devices import accelerator_for
from harness.spec.axes import MeshAxis
from harness.spec.context import CaseContext, context
from harness.targets.target import Finding, Target, stock

from .framework import FRAMEWORK as MEGATRON
from .scenario import MegatronMarks, ParamMarks


class _CudaOnCpu(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_on_cpu(device: torch.device) -> Iterator[None]:
    """Redirect ``device='cuda'`` allocations to the CPU when the world's device is the CPU (no CUDA, or
    a gloo launch on a GPU machine, where the gradients are CPU tensors); a no-op on a CUDA world."""
    if accelerator_for(device) == "cuda":
        yield
        return
    with _CudaOnCpu():
        yield


def dress(model: nn.Module, ctx: CaseContext) -> None:
    marks = ctx.case.variant.info_as(MegatronMarks).of
    for name, p in model.named_parameters():
        for attribute, value in marks.get(name, ParamMarks()).attributes().items():
            setattr(p, attribute, value)


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> float:
    """Megatron-core's fp32 grad norm (dense and expert optimizers, chained) and its clip by total norm."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    ctx = context(model)
    tp = ctx.group(MeshAxis.TP)
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]

    def for_norm(selected: list[nn.Parameter]) -> list[torch.Tensor]:
        return [cast(torch.Tensor, p.grad) for p in selected  # params: those with a gradient
                if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p, tp)]

    dense = [p for p in params if getattr(p, "allreduce", True)]
    experts = [p for p in params if not getattr(p, "allreduce", True)]
    for p in params:
        p.decoupled_grad = p.grad  # type: ignore[attr-defined]  # read by Megatron's use_decoupled_grad
    with cuda_on_cpu(ctx.device):
        dense_norm = get_grad_norm_fp32(for_norm(dense), grad_stats_parallel_group=tp)
        expert_norm = get_grad_norm_fp32(for_norm(experts), grad_stats_parallel_group=ctx.group_over((MeshAxis.EP, MeshAxis.TP)))
        total = math.sqrt(dense_norm**2 + expert_norm**2)
        clip_grad_by_total_norm_fp32(params, max_norm, total, use_decoupled_grad=True)
    return total


TARGETS = (
    Target("megatron", clip, "megatron-core get_grad_norm_fp32 + clip_grad_by_total_norm_fp32 (dense + expert)",
           origin="adapter megatron", scenarios=("megatron_moe_tp",), requires=MEGATRON, dress=dress,
           dtypes=("fp32", "bf16"), norm_types=(2.0,),
           findings=(
               Finding("*experts unmarked*", "NVIDIA/Megatron-LM PR #5916 (0.16.1 predates it)",
                       "grouped-GEMM experts not marked tensor-parallel: the TP-duplicate filter keeps them on TP rank 0 only",
                       stock("--moe-grouped-gemm with TP > 1 and EP > 1 on megatron-core before PR #5916")),)),
)
