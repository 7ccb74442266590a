"""huggingface accelerate: ``Accelerator.clip_grad_norm_`` on a model accelerate itself prepared.

Setup per case (``dress``), as a training script does it:

* a fresh ``Accelerator`` with a ``ParallelismConfig`` of the variant's sizes (accelerate builds its
  own device mesh, ``(dp_replicate, dp_shard, tp)`` plus the flattened ``dp_shard_cp``), and for the
  ``accelerate`` target a ``FullyShardedDataParallelPlugin(fsdp_version=2)``;
* tensor-parallel parameters become DTensors on accelerate's ``tp`` mesh, as transformers'
  ``from_pretrained(tp_plan=...)`` leaves them (``Shard(0)`` column-parallel, ``Shard(1)``
  row-parallel, ``Replicate()``), or plain local shards for a ``use_dtensor=False`` style (transformers
  4.x's ``grouped_gemm`` / ``local_*``, every style of transformers 5.5 to 5.14); the model
  records ``tp_size`` as transformers does (accelerate checks it in ``prepare``);
* ``accelerator.prepare(model, optimizer)``: for FSDP2 this is accelerate's own ``fsdp2_prepare_model``
  (``fully_shard`` on ``mesh[fsdp_dim_names]``). FSDP shards what it is given, so each FSDP-sharded
  parameter is first recreated at its size before FSDP (dim 0 times ``dp_shard``).

Gradients (``backward``): accelerate acts on them between the backward and the clip where FSDP2
holds the model: its post-backward reduce-scatter over ``fsdp_dim_names`` (divided by the
data-parallel size; HSDP all-reduces over ``dp_replicate`` too). So they come through accelerate's own
path, for both targets: one forward of the prepared model (a loss linear in the parameters,
``harness.targets.gradient_path``, through every FSDP module's hooks) and ``accelerator.backward(loss)``
(what a training script calls), with ``reduced_to`` directions that FSDP2's reduction turns into
exactly the layout's shards; the runner checks bit for bit what arrived. TP without FSDP: accelerate
does nothing to gradients (``prepare`` only checks ``model.tp_size``; no DDP wrapper under a
``ParallelismConfig`` with tp), and the same backward gives each DTensor parameter its gradient with
its own placements, each plain one its own tensor. Modules other than FSDP modules are not called
(their parameters are read by the enclosing FSDP module or the root): the TP hooks transformers
installs on them redistribute activations and touch no gradient.

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
from typing import Any, Mapping

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from harness.cases.axes import MeshAxis
from harness.cases.variant import Variant
from harness.cases.context import CaseContext, context
from harness.cases.model import parameter_values
from harness.targets.gradient_path import install_linear_forwards, reduced_to
from harness.cases.target import Finding, Target, direct_call, stock
from harness.targets.target import torch_max_drops_nan

from .framework import FRAMEWORK as ACCELERATE
from .scenario import COLWISE, LOCAL, LOCAL_ROWWISE, REPLICATE, ROWWISE, AccelerateSetup

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
    # the mesh accelerate builds for this topology, once per generation of process groups (a job builds it
    # once); accelerate's singleton state, which holds it, is reset when the generation ends
    config.device_mesh = state.device_mesh = ctx.per_generation(
        ("accelerate-mesh", setup.dp_replicate, setup.dp_shard, setup.tp),
        lambda: config.build_device_mesh(accelerator.device.type))
    ctx.at_generation_end(_reset_accelerate_state)
    if plugin is not None:
        config._validate_accelerator(accelerator)
    return accelerator


def _reset_accelerate_state() -> None:
    state_module = importlib.import_module("accelerate.state")
    state_module.AcceleratorState._reset_state(reset_partial_state=True)
    state_module.GradientState._reset_state()


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
        if style is not None and style not in (LOCAL, LOCAL_ROWWISE):
            data = DTensor.from_local(data, mesh[MeshAxis.TP], (_tp_placement(style),), run_check=False)
        owner.register_parameter(leaf, nn.Parameter(data, requires_grad=p.requires_grad))
    if setup.tp > 1:
        setattr(model, "tp_size", setup.tp)  # what transformers records after tensor-parallelizing
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    prepared, _ = accelerator.prepare(model, optimizer)
    assert prepared is model, "accelerate prepared a new module; the harness clips the one it built"
    ctx.extras[_KEY] = accelerator


def backward(model: nn.Module, ctx: CaseContext, grads: Mapping[str, torch.Tensor | None]) -> None:
    """The layout's gradients through accelerate's own path: one forward of the prepared model (a loss
    linear in the parameters, ``harness.targets.gradient_path``) and ``accelerator.backward(loss)``.

    FSDP2: the forward runs through every FSDP module's hooks (all-gather, post-backward), and each
    rank contributes ``reduced_to`` directions so that FSDP2's reduce-scatter over accelerate's
    ``fsdp_dim_names`` (sum, divided by the data-parallel size; HSDP's all-reduce over
    ``dp_replicate``) leaves exactly the layout's shard on every rank. TP: a DTensor parameter is
    differentiated through its local tensor (its gradient is a DTensor with the parameter's placements,
    as torch's TP backward leaves it), a plain one directly. Modules that are not FSDP modules are not
    called (their parameters are read by the nearest FSDP module, or the root): transformers' TP
    hooks on them redistribute activations and touch no gradient."""
    setup = ctx.case.variant.info_as(AccelerateSetup)
    accelerator = ctx.extras[_KEY]
    fsdp_axes = set(accelerator.parallelism_config.fsdp_dim_names) if setup.fsdp else set()
    factor = setup.dp_replicate * setup.dp_shard
    directions: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        target = grads.get(name)
        if target is None:
            continue
        if setup.fsdp:
            assert isinstance(p, DTensor), f"{name}: FSDP2 left it a plain tensor"
            kept = tuple(axis for axis in p.device_mesh.mesh_dim_names or () if axis not in fsdp_axes)  # TP
            directions[name] = reduced_to(p, target, factor, kept_axes=kept)
        else:
            directions[name] = target
    install_linear_forwards(model, directions, runs=lambda module: isinstance(module, FSDPModule))
    accelerator.backward(model())


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
        return ("FSDP2+TP: accelerate's prepare (1.15.0, 1.16.0) imports transformers.integrations.tensor_parallel."
                "ReplicateParallel, which transformers 5 removed (installed here for VeOmni and NeMo Automodel; "
                "with transformers 4.57.6 this layout is exact)")
    return None


_TRANSFORMERS = "huggingface/transformers"
_TP_REPRO = "scenarios/accelerate/repro_tp_plain_experts.py"
_EXPERTS_PLAIN = (
    "transformers leaves TP-sharded experts as plain local tensors, unmarked (4.x: its use_dtensor=False styles, "
    "dots.llm1's local_colwise / local_rowwise, gpt-oss's grouped_gemm), so no clip can tell them from replicas: "
    "accelerate's clip_grad_norm_ (1.15.0 and 1.16.0, the PR #4219 fix; older releases raise on the mixed "
    "plain/DTensor gradients) takes the plain group's norm rank-locally and each rank clips by its own, too small "
    "norm. With 4.x the model's own TP backward already leaves the replicated gradients different per rank before "
    "any clip (its gather style all-reduces the forward only), so the ranks drift apart whatever the clip does. "
    "Fixed in transformers from 5.16 (every TP shard a DTensor). Report to huggingface/transformers with the repro")
_EXPERTS_PLAIN_REACH = (
    "transformers 4.x (4.57.6 checked) from_pretrained(tp_plan='auto') on a model whose TP plan keeps experts "
    "plain (dots.llm1; gpt-oss has the same layout but with torch 2.13 its biased o_proj raises in the first "
    "training forward), trained by transformers' Trainer (accelerate ParallelismConfig(tp_size=N), "
    "accelerator.clip_grad_norm_ at max_grad_norm=1.0: L2) with accelerate 1.15/1.16; not with transformers from "
    "5.16 (5.16.1, 5.17.0, 5.18.0 checked: DTensors)")
_ALL_PLAIN = (
    "transformers 5.3 to 5.14 (5.3.0, 5.5.4, 5.10.4, 5.14.1 checked; 5.15 not run) leave every TP shard a plain "
    "local tensor, unmarked (accelerate's prepare logs that it skips such a model's TP preparation), so no clip can "
    "tell shards from replicas: accelerate's clip_grad_norm_ has one plain group and calls "
    "torch.nn.utils.clip_grad_norm_ on the rank-local gradients, whatever the accelerate version, and each rank "
    "clips by the norm of its own shards; the ranks disagree. Fixed in transformers from 5.16 (DTensor shards). "
    "Report to huggingface/transformers with the repro run under 5.3 to 5.14")
_ALL_PLAIN_REACH = (
    "transformers 5.3 to 5.14 from_pretrained(tp_plan='auto') on any model with a TP plan, trained by transformers' "
    "Trainer (accelerate ParallelismConfig(tp_size=N), accelerator.clip_grad_norm_ at max_grad_norm=1.0: L2), any "
    "accelerate version; not with transformers 4.x (colwise/rowwise DTensors) nor from 5.16 (5.16.1, 5.17.0, 5.18.0 "
    "checked: DTensors)")
_LINF_DIRECT = (
    "a loop calling accelerator.clip_grad_norm_(params, max_norm, norm_type=inf) itself on such a model: "
    "transformers' Trainer clips with the L2 norm only (clip_grad_norm_(model.parameters(), max_grad_norm))")

TARGETS = (
    Target("accelerate", clip, "accelerate Accelerator.clip_grad_norm_ on an FSDP2 (fsdp_version=2) prepared model",
           origin="adapter accelerate", scenarios=("accelerate_fsdp2",), requires=ACCELERATE, dress=dress,
           backward=backward, refuses=_refuses_fsdp,
           findings=(
               torch_max_drops_nan("*fsdp2 nan*"),)),
    Target("accelerate-tp", clip, "accelerate Accelerator.clip_grad_norm_ on a TP (DTensor + plain) model",
           origin="adapter accelerate", scenarios=("accelerate_fsdp2",), requires=ACCELERATE, dress=dress,
           backward=backward, refuses=_refuses_tp,
           findings=(
               Finding("*tp experts plain*", None, _EXPERTS_PLAIN, stock(_EXPERTS_PLAIN_REACH), norms=("L2",),
                       owner=_TRANSFORMERS, repro=_TP_REPRO),
               Finding("*tp experts plain*", None, _EXPERTS_PLAIN, direct_call(_LINF_DIRECT), norms=("Linf",),
                       owner=_TRANSFORMERS, repro=_TP_REPRO),
               Finding("*tp all plain*", None, _ALL_PLAIN, stock(_ALL_PLAIN_REACH), norms=("L2",),
                       owner=_TRANSFORMERS, repro=_TP_REPRO),
               Finding("*tp all plain*", None, _ALL_PLAIN, direct_call(_LINF_DIRECT), norms=("Linf",),
                       owner=_TRANSFORMERS, repro=_TP_REPRO),
               torch_max_drops_nan("*tp mixed plain/DTensor nan*"),)),
)
