"""torchtitan: ``torchtitan.distributed.utils.clip_grad_norm_`` on a model parallelized the way
torchtitan's trainer parallelizes it, with gradients that arrive the way its training step
produces them.

Between the backward and the clip, torchtitan acts on gradients through FSDP2 only: its
``apply_fsdp_to_decoder`` wraps every block with ``fully_shard`` (gradient division disabled:
``set_gradient_divide_factor(1.0)``, the loss is scaled by the global token count instead), whose
post-backward reduce-scatters each gradient over the parameter's FSDP mesh. Expert parallelism acts
on activations only (the token dispatcher's all-to-all, forward and backward), and the MoE
load-balancing hook runs before the optimizer step, after the clip, on a buffer. So both targets
have a ``backward`` step: a forward and backward through the FSDP-wrapped model with a loss linear
in per-parameter directions (``harness.targets.gradient_path``) that FSDP's reduce-scatter turns
into exactly the layout's gradients.

* ``torchtitan`` (the ``torchtitan_ep`` scenario): the trainer's order. The model is built on the
  meta device at its global shapes (EP-local, for experts another framework left local), then
  torchtitan's parallelize: the routed experts distributed over ``ep`` with ``Shard(0)``
  (``distribute_tensor``, what ``Module.parallelize`` does with ``spmd_backend="partial_dtensor"``),
  then torchtitan's own ``apply_fsdp_to_decoder`` (dense on the flat FSDP mesh, experts on
  ``efsdp``, its choice of shard dim, ``param_dtype`` the case dtype and ``reduce_dtype`` fp32),
  then ``to_empty``. The clip is the trainer's call: ``clip_grad_norm_(model.parameters(),
  max_norm, foreach=True, pp_mesh=None, ep_enabled=ep > 1)`` (the trainer passes no norm type: L2;
  the inf norm is a direct call).
* ``torchtitan-pp`` (the built-in ``pipeline_stages`` scenario, dense stages): each rank holds its
  stage's parameters; the dp-sharded ones are ``fully_shard``-ed per module on the stage's ``dp``
  mesh, as torchtitan's FSDP does inside a stage (divide factor 1). The shared scenario keeps the
  norms replicated over ``dp``, which torchtitan's FSDP would shard too: they stay DTensors
  ``Replicate`` on ``dp`` and the backward gives them their gradients directly (no reduction crosses
  a replica there). The clip gets ``pp_mesh``, as the trainer passes it. Layouts torchtitan itself
  rejects are refused, with its reason: a weight tied across stages (``NotImplementedError: Weight
  tying is not supported with Pipeline Parallel``) and expert stages (EP with PP is not modelled by
  this adapter).

The ``spmd_types`` backend (torchtitan 0.3.0's default) does not run on torch 2.13 (``fully_shard``
with ``dp_mesh_dims`` rejects its plain-tensor parameters); ``partial_dtensor`` and ``full_dtensor``
give every parameter the placements modelled here (checked on torchtitan's qwen3 MoE debug model at
world 4, ep 2: dense ``Shard(0)`` on the flat mesh, experts ``(_StridedShard(0), Shard(0))`` on
``(efsdp, ep)``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from harness.clipmath import local_tensor
from harness.cases.axes import MeshAxis
from harness.cases.variant import Variant
from harness.cases.context import CaseContext, context
from harness.cases.layout import MeshSpec, Shard
from harness.cases.model import parameter_values, torch_placements
from harness.targets.gradient_path import backward_linear, reduced_to
from harness.cases.target import Finding, Target, direct_call, synthetic

from .framework import FRAMEWORK as TORCHTITAN
from .scenario import LIES, NUM_EXPERTS, SPARSE, DTensorMeshes


def _replace(model: nn.Module, name: str, value: torch.Tensor, requires_grad: bool) -> None:
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    module.register_parameter(leaf, nn.Parameter(value, requires_grad=requires_grad))


def _unsharded_shape(local: Sequence[int], declared: Mapping[str, object], spec: MeshSpec) -> tuple[int, ...]:
    """The shape before the parallelism the declared placements name (what the model builder makes)."""
    shape = list(local)
    for axis, placement in declared.items():
        if isinstance(placement, Shard):
            shape[placement.dim] *= spec.size(axis)
    return tuple(shape)


def _as_decoder(model: nn.Module) -> None:
    """The attributes torchtitan's ``apply_fsdp_to_decoder`` reads of its ``Decoder``: the harness's
    model has the same module tree, without embeddings, final norm or head."""
    layers = nn.ModuleDict(dict(model.get_submodule("layers").named_children()))
    model.layers = layers
    for attribute, value in (("enable_weight_tying", False), ("tok_embeddings", None), ("norm", None),
                             ("lm_head", None)):
        setattr(model, attribute, value)
    for block in layers.values():
        if hasattr(block, "moe"):
            setattr(block, "moe_enabled", True)
            setattr(block.get_submodule("moe.routed_experts.inner_experts"), "num_experts", NUM_EXPERTS)


def _sum_on_gloo(model: nn.Module, ctx: CaseContext) -> None:
    """gloo has no ``PREMUL_SUM``, the op FSDP2 picks for torchtitan's divide factor 1: there, the same
    sum through ``force_sum_reduction_for_comms`` (a plain SUM, then a division by 1), the reduction
    torchtitan itself selects with ``enable_fsdp_symm_mem``."""
    if ctx.device.type == "cpu":  # gloo carries the CPU tensors
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def _materialize(model: nn.Module, device: torch.device) -> None:
    """``to_empty`` after parallelizing, as the trainer does, then cheap exact values (the trainer's
    ``init_weights``; the values do not matter to the clip)."""
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            local = local_tensor(p)
            local.copy_(parameter_values(tuple(local.shape), local.dtype, local.device))


def dress(model: nn.Module, ctx: CaseContext) -> None:
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    kinds = ctx.case.variant.info_as(DTensorMeshes).of
    ep = ctx.group_size(MeshAxis.EP)
    for name, p in list(model.named_parameters()):  # the builder, on meta
        shape = _unsharded_shape(p.shape, ctx.declared[name], ctx.mesh_spec)
        _replace(model, name, torch.empty(shape, dtype=p.dtype, device="meta"), p.requires_grad)
    if ep > 1:  # torchtitan's parallelize: the routed experts over ep (EFSDP-kind experts stay EP-local)
        for name, p in list(model.named_parameters()):
            if kinds[name] == SPARSE:
                placement = torch_placements({MeshAxis.EP: ctx.declared[name][MeshAxis.EP]},
                                             MeshSpec.of(**{MeshAxis.EP: ep}))
                _replace(model, name, distribute_tensor(p.detach(), ctx.mesh[MeshAxis.EP], list(placement)),
                         p.requires_grad)
    _as_decoder(model)
    dense_mesh = ctx.mesh._flatten(MeshAxis.FSDP)  # torchtitan's dense FSDP mesh: every rank, one axis
    apply_fsdp_to_decoder(model, dense_mesh, param_dtype=ctx.case.variant.injection.torch_dtype,
                          reduce_dtype=torch.float32, pp_enabled=False, ep_degree=ep,
                          edp_mesh=ctx.mesh[MeshAxis.EFSDP] if ep > 1 else None)
    _sum_on_gloo(model, ctx)
    _materialize(model, ctx.device)


def backward(model: nn.Module, ctx: CaseContext, grads: dict[str, torch.Tensor | None]) -> None:
    """The training step's backward: FSDP2 reduce-scatters (sums: divide factor 1) over each
    parameter's FSDP mesh; EP does not reduce gradients, so ``ep`` is a kept axis."""
    directions = {}
    for name, p in model.named_parameters():
        grad = grads.get(name)
        if grad is not None:
            assert isinstance(p, DTensor)  # every parameter is FSDP's after dress
            directions[name] = reduced_to(p, grad, 1.0, kept_axes=(MeshAxis.EP,))
    backward_linear(model, directions)


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torchtitan.distributed.utils.clip_grad_norm_ as its trainer calls it (foreach, no PP,
    ``ep_enabled`` when ep > 1)."""
    from torchtitan.distributed.utils import clip_grad_norm_

    ep_enabled = context(model).group_size(MeshAxis.EP) > 1
    return clip_grad_norm_(list(model.parameters()), max_norm, norm_type, foreach=True, pp_mesh=None,
                           ep_enabled=ep_enabled)


def dress_stages(model: nn.Module, ctx: CaseContext) -> None:
    """Each stage's dp-sharded parameters ``fully_shard``-ed per module on the stage's ``dp`` mesh
    (built at their unsharded shape on meta first); the rest DTensors ``Replicate`` on ``dp``."""
    stage_mesh = ctx.mesh[MeshAxis.DP]
    dp = ctx.group_size(MeshAxis.DP)
    dtype = ctx.case.variant.injection.torch_dtype
    owners: list[str] = []
    for name, p in list(model.named_parameters()):
        placement = ctx.declared[name][MeshAxis.DP]
        if isinstance(placement, Shard):
            _replace(model, name, torch.empty(_unsharded_shape(p.shape, {MeshAxis.DP: placement},
                                                               MeshSpec.of(**{MeshAxis.DP: dp})),
                                              dtype=p.dtype, device="meta"), p.requires_grad)
            owner = name.rpartition(".")[0]
            if owner not in owners:
                owners.append(owner)
        else:
            placements = torch_placements({MeshAxis.DP: placement}, MeshSpec.of(**{MeshAxis.DP: dp}))
            _replace(model, name, DTensor.from_local(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                     stage_mesh, placements, run_check=False), p.requires_grad)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for owner in owners:
        module = model.get_submodule(owner)
        fully_shard(module, mesh=stage_mesh, mp_policy=policy, reshard_after_forward=False)  # PP: no reshard
        assert isinstance(module, FSDPModule)
        module.set_gradient_divide_factor(1.0)
    _sum_on_gloo(model, ctx)
    _materialize(model, ctx.device)


def backward_stages(model: nn.Module, ctx: CaseContext, grads: dict[str, torch.Tensor | None]) -> None:
    """Each stage's backward: FSDP reduce-scatters its units over ``dp``; the replicated norms get
    their gradients as they are (``dp`` kept: nothing reduces them)."""
    directions = {}
    for name, p in model.named_parameters():
        grad = grads.get(name)
        if grad is None:
            continue
        sharded = isinstance(ctx.declared[name][MeshAxis.DP], Shard)
        assert isinstance(p, DTensor)  # FSDP's, or a replicated DTensor (dress_stages)
        directions[name] = reduced_to(p, grad, 1.0, kept_axes=() if sharded else (MeshAxis.DP,))
    backward_linear(model, directions)


def refuses_stage_layout(variant: Variant) -> str | None:
    """torchtitan's own answer to a pipeline layout it does not build (see the module docstring)."""
    mesh = variant.layout.mesh
    if not mesh.has(MeshAxis.PP) or not mesh.has(MeshAxis.DP):
        return "expert stages (EP with PP) are not modelled by the torchtitan-pp adapter"
    pp = mesh.index(MeshAxis.PP)
    for spec in variant.layout:
        ranks = spec.present_ranks if spec.present_ranks is not None else frozenset(range(mesh.world_size))
        if len({mesh.coordinate(r)[pp] for r in ranks}) > 1:
            return ("a weight tied across stages: torchtitan raises NotImplementedError('Weight tying is not "
                    "supported with Pipeline Parallel.')")
    return None


def clip_stages(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torchtitan.distributed.utils.clip_grad_norm_ with pp_mesh, as its trainer calls it (foreach, no EP)."""
    from torchtitan.distributed.utils import clip_grad_norm_

    pp_mesh: DeviceMesh = context(model).mesh[MeshAxis.PP]
    return clip_grad_norm_(list(model.parameters()), max_norm, norm_type, foreach=True, pp_mesh=pp_mesh)


TARGETS = (
    Target("torchtitan", clip,
           "torchtitan.distributed.utils.clip_grad_norm_ (ep_enabled) on torchtitan's FSDP2/EP model",
           origin="adapter torchtitan", scenarios=("torchtitan_ep",), requires=TORCHTITAN, dress=dress,
           backward=backward,
           findings=(
               Finding("*placement lies*", "none for torchtitan: a lying plan (the class of modelscope/mcore-bridge "
                       "PR #173, NVIDIA-NeMo/Megatron-Bridge PR #5396)",
                       "torchtitan trusts the DTensor placements; a factor declared Replicate but distinct is "
                       "counted once", synthetic(LIES)),
               Finding("*experts without ep dim*", "pytorch/pytorch #180346",
                       "experts on a mesh without ep join the dense parameters in torchtitan's non-EP group, and "
                       "torch's get_total_norm stacks norms from two meshes: it raises",
                       direct_call("torchtitan.distributed.utils.clip_grad_norm_(..., ep_enabled=True) on a model "
                                   "whose experts another framework FSDP-wrapped on an expert-data-parallel mesh "
                                   "without an ep axis (VeOmni, xorl); torchtitan's parallelize always puts "
                                   "them on (efsdp, ep)"),
                       owner="pytorch/pytorch", repro="scenarios/torchtitan/repro_experts_without_ep_dim.py"),)),
    Target("torchtitan-pp", clip_stages,
           "torchtitan.distributed.utils.clip_grad_norm_ (pp_mesh) on each stage's FSDP2 model",
           origin="adapter torchtitan", scenarios=("pipeline_stages",), requires=TORCHTITAN, dress=dress_stages,
           backward=backward_stages, refuses=refuses_stage_layout),
)
