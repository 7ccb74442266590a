"""torchtitan: ``torchtitan.distributed.utils.clip_grad_norm_`` on DTensor parameters laid out the
way torchtitan lays them out.

* ``torchtitan`` (the ``torchtitan_ep`` scenario, ``ep_enabled=True``): every parameter becomes a
  DTensor on the mesh its scenario names, with its *declared* placements, sharing storage with the
  harness's local tensor: ``dense`` parameters on a 1-D mesh over all ranks, ``sparse`` ones on the
  case's ``(efsdp, ep)`` mesh, ``efsdp`` ones on that mesh's ``efsdp`` axis alone.
* ``torchtitan-pp`` (the built-in ``pipeline_stages`` scenario, dense stages): each rank holds its
  stage's parameters only, as DTensors on the stage's ``dp`` mesh (FSDP inside a stage), and the
  clip gets ``pp_mesh``, as torchtitan's trainer passes it. Layouts torchtitan itself rejects are
  refused, with torchtitan's reason: a weight tied across stages (its decoder raises
  ``NotImplementedError: Weight tying is not supported with Pipeline Parallel``) and expert stages
  (EP with PP is not modelled by this adapter).

The gradients are then injected as DTensors with the same placements.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from harness.spec.axes import MeshAxis
from harness.spec.case import Variant
from harness.spec.context import CaseContext, context
from harness.spec.layout import MeshSpec
from harness.spec.model import torch_placements
from harness.targets.target import Finding, Target, direct_call, synthetic

from .framework import FRAMEWORK as TORCHTITAN
from .scenario import DENSE, SPARSE, DTensorMeshes


def _mesh_for(kind: str, ctx: CaseContext) -> tuple[DeviceMesh, MeshSpec]:
    if kind == DENSE:
        assert dist.group.WORLD is not None  # a case runs in an initialized world
        flat = DeviceMesh.from_group(dist.group.WORLD, ctx.device.type, mesh_dim_names=(MeshAxis.DP_SHARD_CP,))
        return flat, MeshSpec.of(**{MeshAxis.DP_SHARD_CP: ctx.world_size})
    if kind == SPARSE:
        return ctx.mesh, ctx.mesh_spec
    return ctx.mesh[kind], MeshSpec.of(**{kind: ctx.group_size(kind)})


def dress(model: nn.Module, ctx: CaseContext) -> None:
    kinds = ctx.case.variant.info_as(DTensorMeshes).of
    for name, p in list(model.named_parameters()):
        mesh, spec = _mesh_for(kinds[name], ctx)
        declared = dict(ctx.declared[name])
        if kinds[name] == DENSE:  # sharded over every rank: one dim-0 shard per rank of the flat mesh
            declared = {MeshAxis.DP_SHARD_CP: next(iter(declared.values()))}
        _as_dtensor(model, name, p, mesh, torch_placements(declared, spec))


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torchtitan.distributed.utils.clip_grad_norm_ with ep_enabled=True (foreach, no PP)."""
    from torchtitan.distributed.utils import clip_grad_norm_

    params = [p for p in model.parameters() if p.requires_grad]
    return clip_grad_norm_(params, max_norm, norm_type, foreach=True, pp_mesh=None, ep_enabled=True)


def _as_dtensor(model: nn.Module, name: str, p: nn.Parameter, mesh: DeviceMesh, placements: Sequence[Placement]) -> None:
    """Replace ``name`` by a DTensor parameter sharing ``p``'s storage."""
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    dtensor = DTensor.from_local(p.detach(), mesh, placements, run_check=False)
    module.register_parameter(leaf, nn.Parameter(dtensor, requires_grad=p.requires_grad))


def dress_stages(model: nn.Module, ctx: CaseContext) -> None:
    """Each stage's parameters as DTensors on the stage's ``dp`` mesh, placed as declared there."""
    stage_mesh = ctx.mesh[MeshAxis.DP]
    stage_spec = MeshSpec.of(**{MeshAxis.DP: ctx.group_size(MeshAxis.DP)})
    for name, p in list(model.named_parameters()):
        placements = torch_placements({MeshAxis.DP: ctx.declared[name][MeshAxis.DP]}, stage_spec)
        _as_dtensor(model, name, p, stage_mesh, placements)


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
    """torchtitan.distributed.utils.clip_grad_norm_ with pp_mesh (foreach, no EP)."""
    from torchtitan.distributed.utils import clip_grad_norm_

    params = [p for p in model.parameters() if p.requires_grad]
    return clip_grad_norm_(params, max_norm, norm_type, foreach=True, pp_mesh=context(model).mesh[MeshAxis.PP])


TARGETS = (
    Target("torchtitan", clip, "torchtitan.distributed.utils.clip_grad_norm_ (ep_enabled=True) on DTensors",
           origin="adapter torchtitan", scenarios=("torchtitan_ep",), requires=TORCHTITAN, dress=dress,
           findings=(
               Finding("*placement lies*", "none for torchtitan: a lying plan (the class of modelscope/mcore-bridge PR #173, NVIDIA-NeMo/Megatron-Bridge PR #5396)",
                       "torchtitan trusts the DTensor placements; a factor declared Replicate but distinct is counted once",
                       synthetic("torchtitan's own parallelize functions place every parameter honestly")),
               Finding("*experts without ep dim*", "ByteDance-Seed/VeOmni PR #185 (experts DTensors without their EP dimension)",
                       "experts on a mesh without ep: torchtitan raises on the mixed meshes",
                       direct_call("torchtitan's clip_grad_norm_(ep_enabled=True) on experts parallelized by "
                                   "another framework onto a mesh without an ep dim")),)),
    Target("torchtitan-pp", clip_stages,
           "torchtitan.distributed.utils.clip_grad_norm_ (pp_mesh) on each stage's DTensors",
           origin="adapter torchtitan", scenarios=("pipeline_stages",), requires=TORCHTITAN, dress=dress_stages,
           refuses=refuses_stage_layout),
)
