"""NeMo Automodel: ``nemo_automodel.components.training.utils.scale_grads_and_clip_grad_norm`` (the
clip its LLM, KD, diffusion and retrieval recipes call) on a model built, marked and parallelized by
Automodel's own code, gradients delivered by a backward through its FSDP2 units (the
``automodel_ep`` scenario). Runs unchanged on nemo-automodel 0.6.0 and 0.7.0 (``RELEASES``).

Setup per case (``dress``), in the order Automodel's recipe uses (``_transformers/infrastructure.py``:
the model built on the meta device at its global shapes, then ``_shard_ep_fsdp`` /
``_parallelize_moe``, then materialized):

* meshes: ``mesh_utils._create_fsdp2_device_mesh(ParallelismSizes(dp_size=world, ep_size=ep))``, the
  helper behind ``MeshContext.build`` for the FSDP2 strategy (world mesh with ``dp_shard_cp``; for
  ep > 1 ``moe_mesh = (ep_shard, ep)``), built once per world size, EP size and process-group
  generation; the axis names come from ``MeshContext.from_meshes(...).parallelize_axis_kwargs()``;
* the block's ``mlp`` is Automodel's ``MoE(MoEConfig(...), BackendConfig(...))``, built on meta: its
  ``Gate`` and the experts class its backend picks (``experts="torch"``: ``GroupedExperts``;
  ``experts="te", dispatcher="deepep"``: ``GroupedExpertsTE``, whose ``__init__`` stamps
  ``_nemo_ep_local_expert_params`` in 0.7.0). The dense parameters are recreated on meta at their
  global size; the root carries ``moe_config`` as Automodel's MoE models do;
* ``nemo_automodel.components.moe.parallelizer.parallelize_model(model, world_mesh, moe_mesh,
  mp_policy=MixedPrecisionPolicy(param_dtype=<case dtype>, reduce_dtype=float32), **axis kwargs)``,
  what both releases' recipes call for ep > 1 (``apply_ep``: ``ExpertParallel`` for torch experts,
  ``init_token_dispatcher`` for TE experts, which re-creates their per-rank ``GroupedLinear``s; then
  ``apply_fsdp``: experts on ``ep_shard`` with ``_moe_shard_placement``, the block by
  ``fully_shard_by_dtype`` with the experts ignored, the root). The control (ep = 1) goes through
  the same function with no ``moe_mesh`` (EP off: the experts are FSDP-sharded with the block). The
  mixed-precision policy keeps the parameters in the case's dtype for the forward (Automodel's
  default casts them to bf16, which would round fp32 gradients);
* ``model.to_empty(device)`` and the harness's parameter values (the recipe loads a checkpoint here).

``te experts unmarked`` (synthetic): the marker Automodel stamped is deleted after setup.

CPU stand-ins (``stand_ins.py``): ``GroupedExpertsTE`` constructs Transformer Engine ``GroupedLinear``
modules and ``apply_ep`` a DeepEP dispatcher, both CUDA-only. While Automodel builds and parallelizes
the model, ``sys.modules`` holds stand-ins that create TE's parameters (``weight{j}``, TE's shapes)
and a DeepEP buffer class that is never used; no forward of theirs runs. Everything of Automodel's
runs unmodified.

Gradients (``backward``): Automodel's training step runs FSDP2's backward, whose reduce-scatter
(sum over the FSDP group, divided by its size) produces the sharded gradients, before its clip; the
framework acts on gradients on the way. So the gradients arrive that way: every module's forward
is replaced (on the instance) by a loss linear in its parameters (``gradient_path``), the root's
forward runs through FSDP2's hooks (unshard, post-backward registration), and each parameter's
direction is the one FSDP2's reduction turns into exactly the layout's gradient
(``reduced_to(..., kept_axes=(ep,))``; the EP axis is not reduced by FSDP). The runner checks bit for
bit what arrived.

The call: ``scale_grads_and_clip_grad_norm(max_norm, [model], norm_type=..., device_mesh=...,
moe_mesh=..., ep_axis_name="ep", foreach=True)``, as ``recipes/llm/train_ft.py`` calls it, except for
``dp_group_size`` / ``num_label_tokens``, left None: with them the function first divides expert
gradients by ``dp_group_size / ep_shard`` and PP gradients by the token count, the other half of
the loss normalization whose first half is ``train_ft`` multiplying the loss by ``dp_group_size``
(the two cancel: the gradients that reach the norm are the same). The harness's linear loss has no
such multiplier, so the division is left out with it.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from harness.clipmath import local_tensor
from harness.cases.context import CaseContext, context
from harness.cases.model import parameter_values
from harness.targets.gradient_path import backward_linear, reduced_to
from harness.cases.target import Finding, Target, stock, synthetic

from .stand_ins import cpu_stand_ins, deepep_usable, ensure_imported
from .framework import FRAMEWORK as AUTOMODEL
from .scenario import DIM, EXPERTS, HIDDEN, NUM_EXPERTS, PREFIX, UNMARKED_SYNTHETIC, AutomodelSetup

def _automodel(module: str) -> Any:
    """``nemo_automodel.<module>``, imported on first use (the framework is optional here, and it ships
    no type information: mypy sees Any, in an environment with or without it)."""
    return importlib.import_module(f"nemo_automodel.{module}")


def automodel_meshes(ctx: CaseContext, ep: int) -> tuple[DeviceMesh, DeviceMesh | None]:
    """Automodel's FSDP2 world mesh and MoE mesh for this world and EP size, built by Automodel's
    mesh helper once per generation of process groups."""
    def build() -> tuple[DeviceMesh, DeviceMesh | None]:
        mesh_utils = _automodel("components.distributed.mesh_utils")
        sizes = _automodel("components.distributed.mesh").ParallelismSizes
        device_mesh, moe_mesh = mesh_utils._create_fsdp2_device_mesh(
            sizes(dp_size=ctx.world_size, ep_size=ep), world_size=ctx.world_size)
        ctx.give_case_timeout(device_mesh, moe_mesh, _dp_shard_cp(device_mesh))
        return device_mesh, moe_mesh

    return ctx.per_generation(("automodel-meshes", ctx.world_size, ep), build)


def _dp_shard_cp(device_mesh: DeviceMesh) -> DeviceMesh:
    """The FSDP mesh ``parallelize_model`` derives for ``dp_axis_names=("dp_shard_cp",)``."""
    axis = _automodel("components.distributed.mesh").MeshAxisName
    mesh: DeviceMesh = _automodel("components.distributed.mesh_utils").get_submesh(device_mesh, (axis.DP_SHARD_CP,))
    return mesh


def _regrow_on_meta(module: nn.Module, factors: dict[int, int]) -> None:
    """Recreate ``module``'s own (harness-built) parameters on the meta device at ``factors`` times
    their size on those dims: their global size, before Automodel's FSDP2 shards them."""
    for name, p in list(module.named_parameters()):
        shape = list(p.shape)
        for dim, factor in factors.items():
            shape[dim] *= factor
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        owner.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"),
                                                    requires_grad=p.requires_grad))


def _moe(setup: AutomodelSetup, dtype: torch.dtype) -> nn.Module:
    """Automodel's own ``MoE`` on the meta device, its experts class picked by its backend config."""
    layers = _automodel("components.moe.layers")
    config = _automodel("components.moe.config").MoEConfig(
        n_routed_experts=NUM_EXPERTS, n_shared_experts=0, n_activated_experts=2, n_expert_groups=1,
        n_limited_groups=1, train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0,
        score_func="softmax", route_scale=1.0, dim=DIM, inter_dim=2 * DIM, moe_inter_dim=HIDDEN,
        norm_topk_prob=False, dtype=dtype)
    backend_config = _automodel("components.models.common.utils").BackendConfig
    backend = (backend_config(experts="te", dispatcher="deepep") if setup.te
               else backend_config(experts="torch", dispatcher="torch"))
    with torch.device("meta"):
        moe: nn.Module = layers.MoE(config, backend)
    return moe


def dress(model: nn.Module, ctx: CaseContext) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    ensure_imported()
    setup = ctx.case.variant.info_as(AutomodelSetup)
    if setup.te and not deepep_usable():
        raise RuntimeError("Automodel's moe/megatron/fused_a2a was imported before the DeepEP stand-in: "
                           "its TE experts cannot get a dispatcher in this process")
    dtype = next(p.dtype for p in model.parameters())
    device_mesh, moe_mesh = automodel_meshes(ctx, setup.ep)
    ctx.extras["automodel_meshes"] = (device_mesh, moe_mesh)
    axes = _automodel("components.distributed.mesh").MeshContext.from_meshes(
        device_mesh, moe_mesh).parallelize_axis_kwargs()
    fsdp_size = _dp_shard_cp(device_mesh).size()

    block = model.get_submodule(PREFIX.rstrip("."))
    for child in ("self_attn", "input_layernorm"):
        _regrow_on_meta(block.get_submodule(child), {0: fsdp_size})
    with cpu_stand_ins():
        moe = _moe(setup, dtype)
        setattr(block, "mlp", moe)
        setattr(model, "moe_config", moe.get_submodule("experts").config)  # what Automodel's MoE models expose
        _automodel("components.moe.parallelizer").parallelize_model(
            model, world_mesh=device_mesh, moe_mesh=moe_mesh,
            mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32), **axes)
    if setup.unmarked:  # synthetic: the state before PR #3817
        experts = model.get_submodule(EXPERTS)
        if hasattr(experts, "_nemo_ep_local_expert_params"):
            delattr(experts, "_nemo_ep_local_expert_params")
    model.to_empty(device=ctx.device)
    with torch.no_grad():
        for p in model.parameters():
            local = local_tensor(p)
            local.copy_(parameter_values(tuple(local.shape), local.dtype, local.device))


def _ep_axes(param: DTensor) -> tuple[str, ...]:
    """The mesh axes FSDP2 does not reduce ``param``'s gradient over: Automodel's ``ep`` axis (which
    ``ExpertParallel`` shards and nothing reduces)."""
    ep = _automodel("components.distributed.mesh").MeshAxisName.EP
    return tuple(name for name in param.device_mesh.mesh_dim_names or () if name == ep)


def backward(model: nn.Module, ctx: CaseContext, grads: dict[str, torch.Tensor | None]) -> None:
    """A backward through Automodel's FSDP2 units whose reduce-scatter leaves exactly ``grads``."""
    directions: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        target = grads.get(name)
        if target is None or not p.requires_grad:
            continue
        if isinstance(p, DTensor):
            kept = _ep_axes(p)
            names = p.device_mesh.mesh_dim_names or ()
            factor = math.prod(p.device_mesh.size(d) for d, axis in enumerate(names) if axis not in kept)
            directions[name] = reduced_to(p, target, factor, kept_axes=kept)
        else:
            directions[name] = target
    backward_linear(model, directions)


def _scale_grads_and_clip(model: nn.Module, max_norm: float, norm_type: float, torch_fast_path: bool) -> Any:
    axis = _automodel("components.distributed.mesh").MeshAxisName
    scale_grads_and_clip_grad_norm = _automodel("components.training.utils").scale_grads_and_clip_grad_norm

    device_mesh, moe_mesh = context(model).extras["automodel_meshes"]
    return scale_grads_and_clip_grad_norm(
        max_norm, [model], norm_type=norm_type, pp_enabled=False, device_mesh=device_mesh, moe_mesh=moe_mesh,
        ep_axis_name=axis.EP.value if moe_mesh is not None else None, pp_axis_name=None, foreach=True,
        use_torch_clip_grad_norm=torch_fast_path)


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | float:
    """nemo_automodel.components.training.utils.scale_grads_and_clip_grad_norm, as train_ft calls it."""
    total: torch.Tensor | float = _scale_grads_and_clip(model, max_norm, norm_type, torch_fast_path=False)
    return total


def clip_torch_fast_path(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | float:
    """The same with ``use_torch_clip_grad_norm=True``: Automodel may then hand the parameters to
    ``torch.nn.utils.clip_grad_norm_``, which cannot combine DTensors of the dense and expert meshes
    (the crash behind Automodel PR #3302); 0.7.0 takes that path only for plain, non-EP parameters."""
    total: torch.Tensor | float = _scale_grads_and_clip(model, max_norm, norm_type, torch_fast_path=True)
    return total


_REPRO = "scenarios/automodel/repro_te_experts_ep_norm.py"
_BEFORE_FIX = ("nemo-automodel before 0.7.0 (0.6.0: checked): the LLM recipes (train_ft) with "
               "model.backend experts: te, dispatcher: deepep and distributed ep_size > 1")


def _findings(how: str) -> tuple[Finding, ...]:
    return (
        Finding("*te experts unmarked*", "NVIDIA-NeMo/Automodel #3816 (fixed by PR #3817 in 0.7.0)",
                f"TE experts without the EP-local marker, the state before PR #3817: {how}",
                synthetic(UNMARKED_SYNTHETIC), repro=_REPRO),
        Finding("*te experts", "NVIDIA-NeMo/Automodel #3816 (fixed by PR #3817 in 0.7.0)",
                f"releases before PR #3817 (0.6.0) build TE experts without the EP-local marker: {how}",
                stock(_BEFORE_FIX), repro=_REPRO),
    )


TARGETS = (
    Target("automodel", clip,
           "nemo_automodel scale_grads_and_clip_grad_norm (device_mesh + moe_mesh, EP) on FSDP2/EP parameters",
           origin="adapter automodel", scenarios=("automodel_ep",), requires=AUTOMODEL, dress=dress,
           backward=backward,
           findings=_findings("no reduction over ep, each EP coordinate clips by sqrt(dense^2 + own experts^2)")),
    Target("automodel-torch-clip", clip_torch_fast_path,
           "nemo_automodel scale_grads_and_clip_grad_norm with use_torch_clip_grad_norm=True (its torch fast path)",
           origin="adapter automodel", scenarios=("automodel_ep",), requires=AUTOMODEL, dress=dress,
           backward=backward,
           findings=_findings("as for automodel: the TE experts are never reduced over ep")),
)
