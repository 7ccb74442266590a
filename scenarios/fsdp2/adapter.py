"""torch FSDP2: parameters wrapped by ``fully_shard`` on the meshes the ``fsdp2_meshes`` scenario
names, gradients clipped by stock ``torch.nn.utils.clip_grad_norm_``.

Setup per case (``dress``): each FSDP unit's parameters are recreated at their size *before* FSDP
sharding (FSDP shards what it is given), then ``fully_shard`` wraps the unit; inner units first, as
a training script would. FSDP2's DTensor parameters then have exactly the layout's local shapes.

FSDP2 acts on gradients between the backward and the clip: its post-backward hook reduce-scatters
each unit's gradients over the unit's mesh (all-reduces them over an HSDP replicate axis) and divides
them by the data-parallel size. So the target has a ``backward`` step: a forward and backward through
the wrapped model with a loss linear in per-parameter directions (``harness.targets.gradient_path``),
which that reduction turns into exactly the layout's gradients (a NaN included: it survives the sum).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from harness.cases.axes import MeshAxis
from harness.cases.context import CaseContext
from harness.cases.model import parameter_values
from harness.targets.gradient_path import backward_linear, reduced_to
from harness.cases.target import Finding, Target, direct_call
from harness.targets.target import torch_max_drops_nan

from .scenario import CASE, WORLD, FsdpWrapping


def _mesh(kind: str, ctx: CaseContext) -> tuple[DeviceMesh, int]:
    """The mesh an FSDP unit shards over, and how many shards its sharded dim is cut into."""
    if kind == WORLD:
        assert dist.group.WORLD is not None  # a case runs in an initialized world
        mesh = DeviceMesh.from_group(dist.group.WORLD, ctx.device.type, mesh_dim_names=(MeshAxis.FSDP,))
        return mesh, ctx.world_size
    if kind == CASE:  # HSDP: replicate over the outer axes, shard over the last
        return ctx.mesh, ctx.mesh_spec.sizes[-1]
    return ctx.mesh[kind], ctx.group_size(kind)


def dress(model: nn.Module, ctx: CaseContext) -> None:
    for unit in ctx.case.variant.info_as(FsdpWrapping).units:
        path, dim = unit.path, unit.shard_dim
        module = model.get_submodule(path) if path else model
        mesh, shards = _mesh(unit.mesh, ctx)
        for name, p in list(module.named_parameters()):
            if isinstance(p, DTensor):  # already sharded by an inner unit
                continue
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            shape = list(p.shape)
            shape[dim] *= shards
            owner.register_parameter(leaf, nn.Parameter(parameter_values(tuple(shape), p.dtype, p.device),
                                                        requires_grad=p.requires_grad))

        def shard_dim(_p: nn.Parameter, d: int = dim) -> Shard:
            return Shard(d)

        fully_shard(module, mesh=mesh, shard_placement_fn=shard_dim)


def backward(model: nn.Module, ctx: CaseContext, grads: dict[str, torch.Tensor | None]) -> None:
    """A training step's backward: FSDP2 reduces every gradient over its unit's mesh and divides by
    that mesh's size (its default divide factor: the data-parallel size)."""
    directions = {}
    for name, p in model.named_parameters():
        grad = grads.get(name)
        if grad is not None:
            assert isinstance(p, DTensor)  # every parameter is FSDP's after dress
            directions[name] = reduced_to(p, grad, float(p.device_mesh.size()))
    backward_linear(model, directions)


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the FSDP2 model's (DTensor) parameters."""
    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    return total.full_tensor() if isinstance(total, DTensor) else total


TARGETS = (
    Target("torch-fsdp2", clip, "torch.nn.utils.clip_grad_norm_ on an FSDP2 (fully_shard) model",
           origin="adapter torch-fsdp2", scenarios=("fsdp2_meshes",), dress=dress, backward=backward,
           findings=(
               Finding("*mixed meshes*", "pytorch/pytorch #180346",
                       "torch.stack of norms from two meshes raises",
                       direct_call("torch.nn.utils.clip_grad_norm_ on a model fully_shard-ed on two meshes (experts "
                                   "on an expert-data-parallel sub-mesh, as VeOmni and xorl wrap them); frameworks "
                                   "that call torch's clip on two meshes meet it too (the torchtune target's "
                                   "'tp+fsdp base plan' rows; NeMo Automodel's KD recipe before its PR #3302)"),
                       repro="scenarios/fsdp2/repro_mixed_meshes.py"),
               torch_max_drops_nan("*nan on last rank*"),)),
)
