"""Gradients through a framework's own path: what an adapter's ``backward`` step builds on.

A framework that acts on gradients between the backward and the clip (FSDP2's reduce-scatter and its
divide factor, HSDP's all-reduce over the replicas, a post-accumulate hook) must be handed gradients
the way its trainer hands them over: by a backward through its wrapped model. The layout says what
each rank must hold *after* that path; these helpers build a backward that ends there exactly:

* a **loss linear in the parameters** (``install_linear_forwards``): every module that owns
  parameters gets a forward returning ``sum(p * direction)`` over its own parameters plus its
  children's outputs, so the root's forward runs every module's forward (the framework's forward
  hooks fire: FSDP2 unshards, registers its post-backward, ...) and the gradient each parameter
  receives is its direction, bit for bit (``d/dp sum(p * d) = d``);
* **directions that a reduction turns into the target** (``reduced_to``): FSDP2 sums the unsharded
  gradients of every rank and divides by the data-parallel size; a direction that is the target
  times that factor inside this rank's own shard, zero elsewhere, and zero on every replica but the
  first, sums to exactly the target times the factor (one non-zero term per element) and divides back
  to it (a power of two, exactly).

What the framework's path cannot deliver (a gradient that exists on some ranks of a reduction and not
on others; replicas its hooks would make of distinct gradients) the runner's bit-for-bit check
(``harness.run.case.delivery``) reports, and the layout is then synthetic for that framework.
"""

from __future__ import annotations

import types
from typing import Callable, Iterator, Mapping, Sequence, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def install_linear_forwards(root: nn.Module, directions: Mapping[str, torch.Tensor],
                            runs: Callable[[nn.Module], bool] | None = None) -> None:
    """Give ``root`` and every module below it a forward whose output is linear in the parameters
    named in ``directions`` (full dotted names from ``root``): ``sum(local(param) * direction)`` over
    the module's own parameters, plus the outputs of its children, called from inside it. The
    parameter is read from the module at call time, so a wrapper that swaps in an unsharded parameter
    for the forward (FSDP2) is the one differentiated; a DTensor parameter is differentiated through
    its local tensor (``to_local``), so its gradient is ``direction`` with the parameter's placements
    and no collective runs. Modules keep their classes and hooks; only ``forward`` is replaced, on the
    instance.

    ``runs``: which modules are *called* (their forward hooks fire), None for every one. A module it
    refuses is not called: its parameters' terms (and those of its children that are not called
    either) are summed inside the nearest module that is, reading the parameters from their own
    modules as before. For modules whose hooks expect activations, not the linear loss's empty call
    (tensor-parallel input/output redistribution on a linear layer) and act on no gradient."""
    own: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, direction in directions.items():
        module_path, _, leaf = name.rpartition(".")
        own.setdefault(module_path, []).append((leaf, direction))

    def linear_forward(module: nn.Module, path: str) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for leaf, direction in own.get(path, ()):
            param = getattr(module, leaf)
            local = param.to_local() if isinstance(param, DTensor) else param
            total = total + (local * direction).sum().to(torch.float64).cpu()
        for name, child in module.named_children():
            child_path = f"{path}.{name}" if path else name
            total = total + (child() if runs is None or runs(child) else linear_forward(child, child_path))
        return total

    for path, module in root.named_modules():
        module.forward = types.MethodType(lambda self, _path=path: linear_forward(self, _path), module)


def backward_linear(root: nn.Module, directions: Mapping[str, torch.Tensor],
                    runs: Callable[[nn.Module], bool] | None = None) -> None:
    """One forward and backward of the linear loss through ``root`` (its hooks included)."""
    install_linear_forwards(root, directions, runs)
    root().backward()


def reduced_to(param: DTensor, target: torch.Tensor, factor: float,
               kept_axes: Sequence[str] = ()) -> torch.Tensor:
    """The unsharded direction this rank contributes so that a reduction over ``param``'s mesh that
    sums every rank's unsharded gradient, divides by ``factor`` and keeps each rank's shard (FSDP2's
    reduce-scatter, HSDP's all-reduce over the replicas) leaves exactly ``target`` (this rank's local
    gradient) on this rank: ``target * factor`` in this rank's slice of the unsharded tensor when it is
    the first coordinate of every ``Replicate`` mesh axis, zero everywhere else. Exact when ``factor``
    is a power of two and ``target * factor`` stays finite.

    ``kept_axes``: mesh axes the reduction does not cross, where the parameter stays sharded or
    replicated in the forward (EP, TP: FSDP2 composes its own axis with a DTensor parameter's mesh,
    and its unsharded parameter is then a DTensor on those axes). The direction is then this rank's
    local tensor over the kept axes (the one the forward differentiates), with ``target * factor`` in
    the chunk FSDP keeps on this rank (``torch.chunk`` of that tensor along the shard dim, as FSDP2
    shards it), and a ``Replicate`` on a kept axis is no replica to zero (nothing sums over it)."""
    if kept_axes:
        return _reduced_within(param, target, factor, kept_axes)
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the parameter's mesh"
    full = torch.zeros(param.shape, dtype=target.dtype, device=target.device)
    if all(coordinate[axis] == 0 for axis, placement in enumerate(param.placements)
           if isinstance(placement, Replicate)):
        shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, param.placements)
        full[tuple(slice(o, o + n) for o, n in zip(offset, shape))] = target * factor
    return full


def _reduced_within(param: DTensor, target: torch.Tensor, factor: float, kept_axes: Sequence[str]) -> torch.Tensor:
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or ()
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the parameter's mesh"
    kept = [axis for axis, name in enumerate(names) if name in kept_axes]
    reduced = [axis for axis in range(mesh.ndim) if axis not in kept]
    if kept:
        local_shape, _ = compute_local_shape_and_global_offset(
            param.shape, mesh[tuple(names[axis] for axis in kept)], [param.placements[axis] for axis in kept])
    else:
        local_shape = tuple(param.shape)
    full = torch.zeros(local_shape, dtype=target.dtype, device=target.device)
    if all(coordinate[axis] == 0 for axis in reduced if isinstance(param.placements[axis], Replicate)):
        region = full
        for axis in reduced:
            placement = param.placements[axis]
            if isinstance(placement, (Shard, _StridedShard)):  # FSDP's shard of the kept-axes local tensor
                region = torch.chunk(region, mesh.size(axis), dim=placement.dim)[coordinate[axis]]
        region.copy_(target * factor)
    return full


def _fsdp_units(root: nn.Module) -> Iterator[tuple[FSDPModule, FSDPParamGroup]]:
    """Every FSDP2 unit under ``root`` that holds parameters, with its parameter group."""
    for module in root.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None and group.fsdp_params:
                yield module, group


def fsdp_divide_factors(root: nn.Module) -> dict[int, float]:
    """What FSDP2 divides each parameter's reduced gradient by (the ``factor`` of ``reduced_to``), by
    the id of the parameter (its sharded DTensor): its unit's ``gradient_divide_factor`` where the
    framework set one, else FSDP2's default, the unit's data-parallel size (its mesh's size: shard x
    replicate). A parameter of no FSDP unit is absent."""
    factors: dict[int, float] = {}
    for _, group in _fsdp_units(root):
        for fsdp_param in group.fsdp_params:
            param = fsdp_param.sharded_param
            mesh_size = cast(DTensor, param).device_mesh.size()
            factors[id(param)] = float(group.gradient_divide_factor or mesh_size)
    return factors


def sum_then_divide_on_gloo(root: nn.Module) -> None:
    """On gloo, let FSDP2 units whose divide factor is not their shard group's size (FSDP2 reduce-
    scatters those with ``PREMUL_SUM(1 / factor)``, which gloo lacks) SUM and divide afterwards
    instead (FSDP2's own ``set_force_sum_reduction_for_comms``): the same gradients for directions
    from ``reduced_to``. Only those units: on a shard group of one, torch 2.13's forced SUM divides
    twice (in its single-rank copy and after). Nothing changes on other backends."""
    if dist.get_backend() != "gloo":
        return
    for module, group in _fsdp_units(root):
        factor = group.gradient_divide_factor
        shard_size = cast(DTensor, group.fsdp_params[0].sharded_param).device_mesh.size(-1)  # FSDP2 shards last
        if factor is not None and shard_size > 1 and factor != shard_size:
            module.set_force_sum_reduction_for_comms(True)
