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
(``harness.run.delivery``) reports, and the layout is then synthetic for that framework.
"""

from __future__ import annotations

import types
from typing import Mapping, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def install_linear_forwards(root: nn.Module, directions: Mapping[str, torch.Tensor]) -> None:
    """Give ``root`` and every module below it a forward whose output is linear in the parameters
    named in ``directions`` (full dotted names from ``root``): ``sum(local(param) * direction)`` over
    the module's own parameters, plus the outputs of its children, called from inside it. The
    parameter is read from the module at call time, so a wrapper that swaps in an unsharded parameter
    for the forward (FSDP2) is the one differentiated; a DTensor parameter is differentiated through
    its local tensor (``to_local``), so its gradient is ``direction`` with the parameter's placements
    and no collective runs. Modules keep their classes and hooks; only ``forward`` is replaced, on the
    instance."""
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
        for child in module.children():
            total = total + child()
        return total

    for path, module in root.named_modules():
        module.forward = types.MethodType(lambda self, _path=path: linear_forward(self, _path), module)


def backward_linear(root: nn.Module, directions: Mapping[str, torch.Tensor]) -> None:
    """One forward and backward of the linear loss through ``root`` (its hooks included)."""
    install_linear_forwards(root, directions)
    root().backward()


def reduced_to(param: DTensor, target: torch.Tensor, factor: float,
               over: Sequence[int] | None = None) -> torch.Tensor:
    """The unsharded direction this rank contributes so that a reduction over ``param``'s mesh that
    sums every rank's unsharded gradient, divides by ``factor`` and keeps each rank's shard (FSDP2's
    reduce-scatter, HSDP's all-reduce over the replicas) leaves exactly ``target`` (this rank's local
    gradient) on this rank: ``target * factor`` in this rank's slice of the unsharded tensor when it is
    the first coordinate of every ``Replicate`` mesh axis, zero everywhere else. Exact when ``factor``
    is a power of two and ``target * factor`` stays finite.

    ``over``: the mesh dims the reduction acts on (FSDP's), None for all of them. The other dims keep
    their placements in the "unsharded" tensor: FSDP2 on a parameter that is already a DTensor on
    another mesh dim (expert parallelism, TP) unshards only its own dims, so its unsharded gradient
    is still this rank's part along the others."""
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the parameter's mesh"
    dims = range(mesh.ndim) if over is None else over
    kept = [placement if axis not in dims else Replicate() for axis, placement in enumerate(param.placements)]
    unsharded_shape, base = compute_local_shape_and_global_offset(param.shape, mesh, kept)
    full = torch.zeros(unsharded_shape, dtype=target.dtype, device=target.device)
    if all(coordinate[axis] == 0 for axis in dims if isinstance(param.placements[axis], Replicate)):
        shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, param.placements)
        full[tuple(slice(o - b, o - b + n) for o, b, n in zip(offset, base, shape))] = target * factor
    return full
