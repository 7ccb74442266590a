"""Megatron-core: ``get_grad_norm_fp32`` and ``clip_grad_by_total_norm_fp32`` on parameters built and
marked by megatron-core's own code (the ``megatron_moe_tp`` scenario), with the gradient selection and
the dense/expert split of its optimizers.

Where the marks come from (``dress``, per case, with this case's TP group and sizes):
* the column- and row-parallel dense weights are the ``weight`` Parameters of megatron's own
  ``ColumnParallelLinear`` / ``RowParallelLinear`` built at the layout's global shapes (the layout's
  values copied in), so their ``tensor_model_parallel`` marks are megatron's;
* the layernorm and router weights carry no mark (megatron sets none the norm reads);
* the experts (a stacked tensor per projection): ``experts TP-linear (SequentialMLP)`` get the marks
  megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` give an expert linear (``is_expert=True``,
  built here at a small shape and read off); ``experts grouped GEMM (TE)`` are marked by
  ``megatron.core.extensions.transformer_engine._set_expert_parameter_attributes`` (what
  ``TEGroupedLinear`` calls since Megatron-LM PR #5916). A megatron-core without that function
  (0.16.1) marks them inside ``TEGroupedLinear.__init__``, which needs Transformer Engine (CUDA only):
  the dress raises, so the case is a SKIP with that reason, not a verdict on marks we would set.

What the clip does here, as Megatron's (non-distributed) optimizer does it:
* gradients for the norm: ``param_is_not_shared`` and ``param_is_not_tensor_parallel_duplicate``
  (Megatron's own filter, given the TP group, and the expert-TP group where the installed version's
  filter takes one, as its optimizer passes it; ``param_is_not_gtp_duplicate`` where it exists);
* the dense optimizer reduces its norm over the model-parallel group (TP; there is no PP here), the
  expert optimizer over TP x EP; the two norms are combined as ``ChainedOptimizer.get_grad_norm``
  combines norms from different stats groups, sqrt(n_dense^2 + n_expert^2);
* ``clip_grad_by_total_norm_fp32`` scales every gradient by the one total.
Megatron's optimizers clip with the L2 norm only.

Megatron acts on gradients between backward and clip, and what it leaves is what this adapter
injects, so there is no ``backward`` step: its ``DistributedDataParallel`` accumulates them into
``param.main_grad`` (grad buffers) and ``finish_grad_sync`` all-reduces them, dense ones over the
data-parallel group and experts over the expert-data-parallel group, scaled to the mean (with
sequence parallelism ``finalize_model_grads`` also all-reduces the layernorm / router gradients over
TP). With the non-distributed optimizer this scenario models, that ends at data-parallel replicas of
identical, TP/EP-structured gradients: the layout's gradients (replicated over ``dp``, TP-duplicates
identical over ``tp``). The optimizer then hands them to the clip as they are (``FP32Optimizer``:
``param.grad = param.main_grad``) or as an fp32 copy (``Float16OptimizerWithFloat16Params``:
``main_param.grad = main_grad.float()``), whose norm is the norm of the same values. The distributed
optimizer (reduce-scatter, norm over its dist-opt group) is not modelled.

On CPU: megatron-core allocates its norm buffers with ``device='cuda'``. ``cuda_on_cpu`` redirects
exactly those allocations to the CPU (a TorchFunctionMode, active only around the two calls, only
when CUDA is absent); and the gradients are passed as ``decoupled_grad`` (Megatron's supported
alternative gradient attribute), because its ``.grad`` path asserts ``torch.cuda.FloatTensor``.
Megatron itself runs unmodified.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from typing import Any, Iterator, cast

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from harness.run.world.devices import accelerator_for
from harness.cases.axes import MeshAxis
from harness.cases.context import CaseContext, context
from harness.cases.target import Finding, Target, stock

from .framework import FRAMEWORK as MEGATRON
from .scenario import PREFIX, MegatronExperts


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


_MARKS = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce")


def _adopt(model: nn.Module, name: str, parameter: nn.Parameter) -> None:
    """Megatron's Parameter in place of the layout's (same name and local shape, its values copied)."""
    old = model.get_parameter(name)
    if tuple(parameter.shape) != tuple(old.shape):
        raise RuntimeError(f"{name}: megatron builds {tuple(parameter.shape)} locally, the layout {tuple(old.shape)}")
    parameter.data = old.detach().clone()
    parameter.requires_grad_(old.requires_grad)
    module_path, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(module_path), leaf, parameter)


def _copy_marks(source: torch.Tensor, target: nn.Parameter) -> None:
    for attribute in _MARKS:
        if hasattr(source, attribute):
            setattr(target, attribute, getattr(source, attribute))


def dress(model: nn.Module, ctx: CaseContext) -> None:
    """Parameters and marks from megatron-core's own layers and functions (see the module docstring)."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    experts = ctx.case.variant.info_as(MegatronExperts).module
    tp_group, tp, ep = ctx.group(MeshAxis.TP), ctx.group_size(MeshAxis.TP), ctx.group_size(MeshAxis.EP)
    params = dict(model.named_parameters())
    dtype = params[PREFIX + "self_attention.linear_qkv.weight"].dtype
    config = ModelParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=tp, use_cpu_initialization=True, params_dtype=dtype)
    init = torch.nn.init.zeros_
    hidden = params[PREFIX + "input_layernorm.weight"].shape[0]
    qkv = ColumnParallelLinear(hidden, 2 * hidden, config=config, init_method=init, bias=False, gather_output=False,
                               tp_group=tp_group)
    proj = RowParallelLinear(hidden, hidden, config=config, init_method=init, bias=False, input_is_parallel=True,
                             skip_bias_add=True, tp_group=tp_group)
    _adopt(model, PREFIX + "self_attention.linear_qkv.weight", qkv.weight)
    _adopt(model, PREFIX + "self_attention.linear_proj.weight", proj.weight)
    fc1, fc2 = params[PREFIX + "mlp.experts.linear_fc1.weight"], params[PREFIX + "mlp.experts.linear_fc2.weight"]
    if experts == "sequential":
        column = ColumnParallelLinear(hidden, 2 * tp, config=config, init_method=init, bias=False, gather_output=False,
                                      is_expert=True, tp_group=tp_group)
        row = RowParallelLinear(2 * tp, hidden, config=config, init_method=init, bias=False, input_is_parallel=True,
                                skip_bias_add=True, is_expert=True, tp_group=tp_group)
        _copy_marks(column.weight, fc1)
        _copy_marks(row.weight, fc2)
        return
    try:
        from megatron.core.extensions.transformer_engine import _set_expert_parameter_attributes
    except ImportError:
        raise RuntimeError(
            f"megatron-core {MEGATRON.version()} marks --moe-grouped-gemm experts inside TEGroupedLinear.__init__, "
            "which needs Transformer Engine (CUDA only): not constructible here; Megatron-LM PR #5916 moved the "
            "marks into extensions.transformer_engine._set_expert_parameter_attributes") from None
    for parameter, parallel_mode in ((fc1, "column"), (fc2, "row")):
        holder = nn.Module()
        holder.weight = parameter  # the layout's Parameter itself: megatron's function marks it
        _set_expert_parameter_attributes(holder, parallel_mode, ep > 1)  # use_expert_pgs: EP > 1 (ETP == TP)


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> float:
    """Megatron-core's fp32 grad norm (dense and expert optimizers, chained) and its clip by total norm."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
    from megatron.core.tensor_parallel import layers as tensor_parallel_layers
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    ctx = context(model)
    tp = ctx.group(MeshAxis.TP)
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]

    # what the installed version's optimizer passes its filter: the expert-TP group too since PR #5916
    # (here ETP == TP), and its generalized-TP filter where it has one
    takes_expert_group = "expert_tp_group" in inspect.signature(param_is_not_tensor_parallel_duplicate).parameters
    gtp_filter = getattr(tensor_parallel_layers, "param_is_not_gtp_duplicate", lambda _: True)

    def not_duplicate(p: nn.Parameter) -> bool:
        if takes_expert_group:
            return bool(param_is_not_tensor_parallel_duplicate(p, tp_group=tp, expert_tp_group=tp))
        return bool(param_is_not_tensor_parallel_duplicate(p, tp))

    def for_norm(selected: list[nn.Parameter]) -> list[torch.Tensor]:
        return [cast(torch.Tensor, p.grad) for p in selected  # params: those with a gradient
                if param_is_not_shared(p) and not_duplicate(p) and gtp_filter(p)]

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
               Finding("*experts grouped GEMM (TE)*", "NVIDIA/Megatron-LM PR #5916 (merged; 0.16.1 predates it)",
                       "TEGroupedLinear leaves grouped-GEMM expert weights unmarked tensor_model_parallel, so the "
                       "TP-duplicate filter keeps them on TP rank 0 only (an under-count); not reproduced here: "
                       "0.16.1 builds those weights only with Transformer Engine (CUDA), and megatron-core with "
                       "PR #5916 (0.19.2) passes",
                       stock("--moe-grouped-gemm on the Transformer Engine stack (the default --transformer-impl) "
                             "with --tensor-model-parallel-size 2 --expert-model-parallel-size 2 (expert TP = TP by "
                             "default) on megatron-core before PR #5916, as the PR states it")),)),
)
