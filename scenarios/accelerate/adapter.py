"""huggingface accelerate: ``Accelerator.clip_grad_norm_`` on a model accelerate itself prepared.

Setup per case (``dress``), as a training script does it:

* a fresh ``Accelerator`` with a ``ParallelismConfig`` of the variant's sizes (accelerate builds its
  own device mesh, ``(dp_replicate, dp_shard, tp)`` plus the flattened ``dp_shard_cp``), and for the
  ``accelerate`` target a ``FullyShardedDataParallelPlugin(fsdp_version=2)``;
* tensor-parallel parameters become DTensors on accelerate's ``tp`` mesh, as transformers'
  ``from_pretrained(tp_plan=...)`` leaves them (``Shard(0)`` column-parallel, ``Shard(1)``
  row-parallel, ``Replicate()``), or plain local shards for a ``use_dtensor=False`` style; the model
  records ``tp_size`` as transformers does (accelerate checks it in ``prepare``);
* ``accelerator.prepare(model, optimizer)``: for FSDP2 this is accelerate's own ``fsdp2_prepare_model``
  (``fully_shard`` on ``mesh[fsdp_dim_names]``). FSDP shards what it is given, so each FSDP-sharded
  parameter is first recreated at its size before FSDP (dim 0 times ``dp_shard``).

The clip is ``accelerator.clip_grad_norm_(model.parameters(), max_norm, norm_type)``, unmodified; for
FSDP2 it takes its FSDP branch (the parameters are the prepared model's), for TP the generic one; both
end in ``Accelerator._clip_grad_norm_dtensor_aware``.

CPU shim (only where accelerate's device gate applies, ``DistributedType.MULTI_CPU``): accelerate
honours ``fsdp_plugin`` and ``parallelism_config`` only for accelerator device types
(``AcceleratorState.__init__`` switches to ``DistributedType.FSDP`` for MULTI_GPU/XPU/... only, and
``ParallelismConfig._validate_accelerator`` rejects MULTI_CPU). The adapter therefore builds the
``Accelerator(cpu=True)`` without them and then sets on its state exactly what those branches set:
``distributed_type = FSDP`` and ``fsdp_plugin`` (FSDP2 only), ``parallelism_config`` and
``device_mesh = parallelism_config.get_device_mesh("cpu")``; for FSDP2 it then runs accelerate's own
``_validate_accelerator``. On an accelerator device no shim is used. Everything after (``prepare``,
``fsdp2_prepare_model``, ``clip_grad_norm_``) is accelerate's code, unmodified.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from harness.spec.axes import MeshAxis
from harness.spec.case import Variant
from harness.spec.context import CaseContext, context
from harness.spec.model import parameter_values
from harness.targets.target import Finding, Target, stock, torch_max_drops_nan

from .framework import FRAMEWORK as ACCELERATE
from .scenario import COLWISE, LOCAL, REPLICATE, ROWWISE, AccelerateSetup

_KEY = "accelerator"


def _accelerator(ctx: CaseContext, setup: AccelerateSetup) -> Any:
    """A fresh Accelerator for this case (accelerate's state is a process-wide singleton)."""
    # imported by name: accelerate ships no type information (no py.typed), and may be absent
    accelerate, state_module, utils = (importlib.import_module(m) for m in
                                       ("accelerate", "accelerate.state", "accelerate.utils"))
    Accelerator, DistributedType = accelerate.Accelerator, utils.DistributedType
    AcceleratorState, GradientState, PartialState = (state_module.AcceleratorState, state_module.GradientState,
                                                     state_module.PartialState)
    FullyShardedDataParallelPlugin, ParallelismConfig = utils.FullyShardedDataParallelPlugin, utils.ParallelismConfig

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if setup.fsdp else None
    config = ParallelismConfig(dp_replicate_size=setup.dp_replicate, dp_shard_size=setup.dp_shard,
                               tp_size=setup.tp)
    on_cpu = ctx.device.type == "cpu"
    if not on_cpu:
        return Accelerator(fsdp_plugin=plugin, parallelism_config=config)
    accelerator = Accelerator(cpu=True)
    state = accelerator.state
    assert state.distributed_type == DistributedType.MULTI_CPU, state.distributed_type
    if plugin is not None:  # what AcceleratorState.__init__ does for an accelerator device type
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.parallelism_config = config  # what Accelerator.__init__ does with a parallelism_config
    state.device_mesh = config.get_device_mesh(accelerator.device.type)
    if plugin is not None:
        config._validate_accelerator(accelerator)
    return accelerator


def _tp_placement(style: str) -> Placement:
    return {COLWISE: Shard(0), ROWWISE: Shard(1), REPLICATE: Replicate()}[style]


def dress(model: nn.Module, ctx: CaseContext) -> None:
    setup = ctx.case.variant.info_as(AccelerateSetup)
    accelerator = _accelerator(ctx, setup)
    mesh = accelerator.torch_device_mesh
    for name, p in list(model.named_parameters()):
        owner_path, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_path) if owner_path else model
        shape = list(p.shape)
        if setup.fsdp:
            shape[0] *= setup.dp_shard  # FSDP shards dim 0 of what it is given
        data = parameter_values(tuple(shape), p.dtype, p.device) if setup.fsdp else p.detach()
        style = setup.tp_styles.get(name)
        if style is not None and style != LOCAL:
            data = DTensor.from_local(data, mesh[MeshAxis.TP], (_tp_placement(style),), run_check=False)
        owner.register_parameter(leaf, nn.Parameter(data, requires_grad=p.requires_grad))
    if setup.tp > 1:
        setattr(model, "tp_size", setup.tp)  # what transformers records after tensor-parallelizing
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    prepared, _ = accelerator.prepare(model, optimizer)
    assert prepared is model, "accelerate prepared a new module; the harness clips the one it built"
    ctx.extras[_KEY] = accelerator


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> Any:
    """accelerate's Accelerator.clip_grad_norm_ over the prepared model's parameters."""
    accelerator = context(model).extras[_KEY]
    return accelerator.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)


def _refuses_tp(variant: Variant) -> str | None:
    if variant.info_as(AccelerateSetup).fsdp:
        return "an FSDP2 layout: the accelerate target clips it (accelerate-tp is the TP-only call path)"
    return None


def transformers_major() -> int | None:
    """The installed transformers' major version, read from its metadata (nothing imported)."""
    try:
        return int(importlib.metadata.version("transformers").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def _refuses_fsdp(variant: Variant) -> str | None:
    setup = variant.info_as(AccelerateSetup)
    if not setup.fsdp:
        return "a TP-only layout: the accelerate-tp target clips it (accelerate is the FSDP2 call path)"
    major = transformers_major()
    if setup.tp > 1 and major is not None and major >= 5:
        return ("FSDP2+TP: accelerate 1.15.0's prepare imports transformers.integrations.tensor_parallel."
                "ReplicateParallel, which transformers 5 removed (installed here for VeOmni and NeMo Automodel; "
                "with transformers 4.57.6 this layout is exact)")
    return None


TARGETS = (
    Target("accelerate", clip, "accelerate Accelerator.clip_grad_norm_ on an FSDP2 (fsdp_version=2) prepared model",
           origin="adapter accelerate", scenarios=("accelerate_fsdp2",), requires=ACCELERATE, dress=dress,
           refuses=_refuses_fsdp,
           findings=(
               torch_max_drops_nan("*fsdp2 nan*"),)),
    Target("accelerate-tp", clip, "accelerate Accelerator.clip_grad_norm_ on a TP (DTensor + plain) model",
           origin="adapter accelerate", scenarios=("accelerate_fsdp2",), requires=ACCELERATE, dress=dress,
           refuses=_refuses_tp,
           findings=(
               Finding("*tp experts plain*", None,
                       "accelerate 1.15.0's _clip_grad_norm_dtensor_aware (the PR #4219 fix) adds the plain-tensor group's norm rank-locally, right only while plain gradients are replicas; TP-sharded plain experts (transformers' grouped_gemm / local_* styles, the gpt-oss plan) make each rank clip by its own norm: report to huggingface/accelerate with: clipcheck run --nproc 4 --scenario accelerate_fsdp2 --target accelerate-tp --variant 'tp experts plain' --norm-type 2",
                       stock("transformers 4.x tp_plan='auto' on a model whose TP plan shards plain experts "
                             "(gpt-oss, dots.llm1: grouped_gemm / local_* styles), clipped by accelerate")),
               torch_max_drops_nan("*tp mixed plain/DTensor nan*"),)),
)
