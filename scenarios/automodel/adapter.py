"""NeMo Automodel: ``nemo_automodel.components.training.utils.scale_grads_and_clip_grad_norm`` (the
clip its LLM, KD, diffusion and retrieval recipes call) on a model set up as Automodel's MoE
parallelizer sets it up (the ``automodel_ep`` scenario).

Setup per case (``dress``), with Automodel's own pieces, run unmodified on CPU/gloo:

* meshes: ``mesh_utils._create_fsdp2_device_mesh(ParallelismSizes(dp_size=world, ep_size=ep))``, the
  helper behind ``MeshContext.build`` for the FSDP2 strategy: the world mesh ``(pp, dp_replicate,
  dp_shard, cp, tp)`` with its flattened ``dp_shard_cp``, and (ep > 1) ``moe_mesh = (ep_shard, ep)``.
  Built once per world size, EP size and process-group generation (they create process groups);
* experts, as ``moe.parallelizer.apply_ep`` / ``apply_fsdp`` treat them: ``GroupedExperts`` through
  Automodel's ``ExpertParallel`` style on the ``ep`` sub-mesh of ``moe_mesh``; TE experts left as
  rank-local tensors; then, where ep_shard > 1, ``fully_shard`` on its ``ep_shard`` sub-mesh with
  Automodel's ``_moe_shard_placement`` (dim 1);
* the dense block: ``parallelizer_utils.fully_shard_by_dtype`` on ``dp_shard_cp`` with the experts as
  ``ignored_params`` (ep > 1), as ``apply_fsdp`` calls it (no mixed-precision policy: there is no
  forward).

Parameters are first recreated at their size before EP/FSDP sharding (both shard what they are
given), so the local shapes end up those of the layout.

What is mocked, and why: ``GroupedExpertsTE`` cannot be built here (it constructs Transformer
Engine ``GroupedLinear`` modules; TE needs CUDA). Its parameters are rank-local tensors of this EP
rank's experts, and the one thing the clip reads from the module is the marker it stamps in
``__init__``, ``_nemo_ep_local_expert_params = True``; the adapter sets exactly that attribute on
the experts module of the ``te experts`` layouts (and leaves it off in ``te experts unmarked``).

The call: ``scale_grads_and_clip_grad_norm(max_norm, [model], norm_type=..., device_mesh=...,
moe_mesh=..., ep_axis_name="ep", foreach=True)``, as ``recipes/llm/train_ft.py`` calls it, except for
``dp_group_size`` / ``num_label_tokens``, left None: with them the function first divides expert
gradients by ``dp_group_size / ep_shard`` (undoing FSDP's reduce-scatter average over ``ep_shard``
instead of the whole DP group) and PP gradients by the token count. That is loss normalization of
raw backward gradients; the harness injects final gradients, so the scaling is not part of the clip
under test (and would be reported as a wrong coefficient).
"""

from __future__ import annotations

import datetime
import importlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from harness.spec.context import CaseContext, context
from harness.spec.model import parameter_values
from harness.targets.target import Finding, Target, synthetic

from .framework import FRAMEWORK as AUTOMODEL
from .scenario import EXPERTS, PREFIX, AutomodelSetup

_MESHES: dict[tuple[int, int], tuple[Any, DeviceMesh, DeviceMesh | None]] = {}
"""(world size, ep) -> (the default group they were built in, world mesh, moe mesh)."""


def _automodel(module: str) -> Any:
    """``nemo_automodel.<module>``, imported on first use (the framework is optional here, and it ships
    no type information: mypy sees Any, in an environment with or without it)."""
    return importlib.import_module(f"nemo_automodel.{module}")


def automodel_meshes(ctx: CaseContext, ep: int) -> tuple[DeviceMesh, DeviceMesh | None]:
    """Automodel's FSDP2 world mesh and MoE mesh for this world and EP size, built by Automodel's
    mesh helper once per process-group generation (a new default group drops the old ones)."""
    mesh_utils = _automodel("components.distributed.mesh_utils")
    sizes = _automodel("components.distributed.mesh").ParallelismSizes

    world = dist.group.WORLD
    key = (ctx.world_size, ep)
    hit = _MESHES.get(key)
    if hit is not None and hit[0] is world:
        return hit[1], hit[2]
    if any(entry[0] is not world for entry in _MESHES.values()):
        _MESHES.clear()
    device_mesh, moe_mesh = mesh_utils._create_fsdp2_device_mesh(
        sizes(dp_size=ctx.world_size, ep_size=ep), world_size=ctx.world_size)
    if ctx.world is not None:  # the case timeout on every group, as the harness gives its own meshes
        timeout = datetime.timedelta(seconds=ctx.world.timeout_s)
        for mesh in (device_mesh, moe_mesh, _dp_shard_cp(device_mesh)):
            for dim in range(mesh.ndim if mesh is not None else 0):
                assert mesh is not None
                dist.distributed_c10d._set_pg_timeout(timeout, mesh.get_group(dim))
    _MESHES[key] = (world, device_mesh, moe_mesh)
    return device_mesh, moe_mesh


def _dp_shard_cp(device_mesh: DeviceMesh) -> DeviceMesh:
    """The FSDP mesh ``parallelize_model`` derives for ``dp_axis_names=("dp_shard_cp",)``."""
    axis = _automodel("components.distributed.mesh").MeshAxisName
    mesh: DeviceMesh = _automodel("components.distributed.mesh_utils").get_submesh(device_mesh, (axis.DP_SHARD_CP,))
    return mesh


def _regrow(module: nn.Module, factors: dict[int, int], skip: set[int] | None = None) -> None:
    """Recreate ``module``'s plain parameters at ``factors`` times their size on those dims (their
    size before the sharding that follows); ``skip`` holds ids left as they are."""
    for name, p in list(module.named_parameters()):
        if isinstance(p, DTensor) or (skip is not None and id(p) in skip):
            continue
        shape = list(p.shape)
        for dim, factor in factors.items():
            shape[dim] *= factor
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        owner.register_parameter(leaf, nn.Parameter(parameter_values(tuple(shape), p.dtype, p.device),
                                                    requires_grad=p.requires_grad))


def dress(model: nn.Module, ctx: CaseContext) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    axis = _automodel("components.distributed.mesh").MeshAxisName
    moe_parallelizer = _automodel("components.moe.parallelizer")
    fully_shard_by_dtype = _automodel("components.distributed.parallelizer_utils").fully_shard_by_dtype
    setup = ctx.case.variant.info_as(AutomodelSetup)
    device_mesh, moe_mesh = automodel_meshes(ctx, setup.ep)
    ctx.extras["automodel_meshes"] = (device_mesh, moe_mesh)
    experts = model.get_submodule(EXPERTS)
    block = model.get_submodule(PREFIX.rstrip("."))
    fsdp_mesh = _dp_shard_cp(device_mesh)

    ignored: set[nn.Parameter] | None = None
    if moe_mesh is not None:  # ep > 1: apply_ep, then the experts' own FSDP unit (apply_fsdp)
        ep_mesh, ep_shard_mesh = moe_mesh[axis.EP], moe_mesh[axis.EP_SHARD]
        # the experts' size before sharding: all of them on dim 0 when ExpertParallel is to split
        # them (TE builds this rank's alone), dim 1 whole before FSDP on ep_shard
        _regrow(experts, {0: ep_mesh.size() if setup.expert_parallel else 1, 1: ep_shard_mesh.size()})
        if setup.expert_parallel:
            parallelize_module(experts, ep_mesh, moe_parallelizer.ExpertParallel())
        elif setup.marked:
            setattr(experts, "_nemo_ep_local_expert_params", True)  # what GroupedExpertsTE.__init__ stamps
        if ep_shard_mesh.size() > 1:
            fully_shard(experts, mesh=ep_shard_mesh, shard_placement_fn=moe_parallelizer._moe_shard_placement)
        ignored = set(experts.parameters())
    if fsdp_mesh.size() > 1:
        _regrow(block, {0: fsdp_mesh.size()}, skip={id(p) for p in ignored or ()})
        fully_shard_by_dtype(block, mesh=fsdp_mesh, mp_policy=None, offload_policy=None, ignored_params=ignored)


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


TARGETS = (
    Target("automodel", clip,
           "nemo_automodel scale_grads_and_clip_grad_norm (device_mesh + moe_mesh, EP) on FSDP2/EP parameters",
           origin="adapter automodel", scenarios=("automodel_ep",), requires=AUTOMODEL, dress=dress,
           findings=(
               Finding("*te experts unmarked*", "NVIDIA-NeMo/Automodel #3816 (fixed by PR #3817 in 0.7.0)",
                       "experts without the EP-local marker, as every expert looked before the fix: no reduction over ep, each EP group clips by its own norm",
                       synthetic("0.7.0's MoE parallelizer marks every expert it builds; only releases before PR "
                                 "#3817 leave them unmarked")),)),
    Target("automodel-torch-clip", clip_torch_fast_path,
           "nemo_automodel scale_grads_and_clip_grad_norm with use_torch_clip_grad_norm=True (its torch fast path)",
           origin="adapter automodel", scenarios=("automodel_ep",), requires=AUTOMODEL, dress=dress,
           findings=(
               Finding("*te experts unmarked*", "NVIDIA-NeMo/Automodel #3816 (fixed by PR #3817 in 0.7.0)",
                       "as for automodel: the unmarked experts are never reduced over ep",
                       synthetic("0.7.0's MoE parallelizer marks every expert it builds; only releases before PR "
                                 "#3817 leave them unmarked")),)),
)
