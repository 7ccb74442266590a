"""torchtitan: ``torchtitan.distributed.utils.clip_grad_norm_(..., ep_enabled=True)`` on DTensor
parameters laid out the way torchtitan lays out a MoE model (the ``torchtitan_ep`` scenario).

Setup per case (``dress``): every parameter becomes a DTensor on the mesh its scenario names, with
its *declared* placements, sharing storage with the harness's local tensor: ``dense`` parameters on a
1-D mesh over all ranks, ``sparse`` ones on the case's ``(efsdp, ep)`` mesh, ``efsdp`` ones on that
mesh's ``efsdp`` axis alone. The gradients are then injected as DTensors with the same placements.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from harness.spec.axes import MeshAxis
from harness.spec.context import CaseContext
from harness.spec.layout import MeshSpec
from harness.spec.model import torch_placements
from harness.targets.target import Target

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
        placements = torch_placements(declared, spec)
        module_path, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_path)
        dtensor = DTensor.from_local(p.detach(), mesh, placements, run_check=False)
        module.register_parameter(leaf, nn.Parameter(dtensor, requires_grad=p.requires_grad))


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torchtitan.distributed.utils.clip_grad_norm_ with ep_enabled=True (foreach, no PP)."""
    from torchtitan.distributed.utils import clip_grad_norm_

    params = [p for p in model.parameters() if p.requires_grad]
    return clip_grad_norm_(params, max_norm, norm_type, foreach=True, pp_mesh=None, ep_enabled=True)


TARGETS = (
    Target("torchtitan", clip, "torchtitan.distributed.utils.clip_grad_norm_ (ep_enabled=True) on DTensors",
           origin="adapter torchtitan", scenarios=("torchtitan_ep",), requires=TORCHTITAN, dress=dress),
)
