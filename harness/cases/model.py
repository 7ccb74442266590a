"""Materialize a layout on one rank: a synthetic nn.Module with parameters at their local shapes.

Parameters are created directly at EP-local (and FSDP-local) shapes, as frameworks do when weights
are loaded pre-sliced, so a clip function sees exactly what it would see in training. Names are the
layout's dotted names, so ``model.named_parameters()`` and the layout agree.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict

from typing import Mapping

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

from harness.clipmath import local_tensor
from harness.cases.injection import Injection, local_grad
from harness.cases.layout import Layout, MeshSpec, Placement, Shard
from harness.cases.variant import DTensorAxes, mesh_dim_name, whole_mesh_dims


def torch_placements(placements: Mapping[str, Placement], mesh: MeshSpec) -> tuple:
    """Our placements, in mesh-axis order, as torch DTensor placements."""
    return dims_placements(placements, whole_mesh_dims(mesh.names))


def dims_placements(placements: Mapping[str, Placement], dims: tuple[tuple[str, ...], ...]) -> tuple:
    """Our placements as torch's, one per DTensor mesh dim: a dim's axes (several where it is flattened)
    share its one placement, so its first axis's says it."""
    out = []
    for dim in dims:
        p = placements.get(dim[0])
        out.append(TorchShard(p.dim) if isinstance(p, Shard) else TorchReplicate())
    return tuple(out)


def dtensor_mesh(mesh: DeviceMesh, dims: tuple[tuple[str, ...], ...]) -> DeviceMesh:
    """The sub-mesh of ``mesh`` whose dims span ``dims`` (``Variant.dtensor_axes``): sliced by axis names
    as a training script slices it, one dim of several axes flattened (torch keeps one flattened mesh
    per name, so every parameter on it shares it, as in the job)."""
    if len(dims) == 1 and len(dims[0]) > 1:
        return mesh[dims[0]]._flatten(mesh_dim_name(dims[0]))
    names = tuple(dim[0] for dim in dims)
    return mesh if names == mesh.mesh_dim_names else mesh[names]


def parameter_values(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Cheap, non-zero, exactly representable values (1, 1.125, ..., 1.875) for the parameters
    themselves: a target that scales or overwrites parameters instead of gradients changes them
    visibly (zeros would hide ``p.mul_(c)``). A fresh tensor on every call (a target may write to it);
    a small one is copied from a pattern kept per shape: every case builds its model anew, and the
    pattern's five tensor ops were a third of building one."""
    if math.prod(shape) > _KEPT_PATTERN_NUMEL:
        return _parameter_pattern.__wrapped__(shape, dtype, device)
    return _parameter_pattern(shape, dtype, device).clone()


_KEPT_PATTERN_NUMEL = 1 << 16
"""Patterns up to this many elements are kept (at most 512 of them): large ones would hold memory."""


@functools.lru_cache(maxsize=512)
def _parameter_pattern(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return (1 + (torch.arange(math.prod(shape), device=device) % 8) / 8).to(dtype).reshape(shape)


def install_parameter(root: nn.Module, dotted: str, parameter: nn.Parameter) -> None:
    """Register ``parameter`` at the dotted path ``dotted`` under ``root`` (a second name for a
    parameter already in the model ties the two)."""
    _install(root, dotted, parameter)


def _install(root: nn.Module, dotted: str, parameter: nn.Parameter) -> None:
    *path, leaf = dotted.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    module.register_parameter(leaf, parameter)


def build_model(
    layout: Layout,
    injection: Injection,
    rank: int,
    device: torch.device,
    *,
    mesh: DeviceMesh | None = None,
    dtensor_placements: Mapping[str, Mapping[str, Placement]] | None = None,
    plain: frozenset[str] = frozenset(),
    dtensor_axes: DTensorAxes | None = None,
) -> nn.Module:
    """The rank-local model. With ``dtensor_placements``, parameters are DTensors on ``mesh`` (on the
    sub-mesh ``dtensor_axes`` names for a parameter, if any) with those (declared) placements, except the
    ones in ``plain``; otherwise plain tensors. Absent parameters are simply not there."""
    root = nn.Module()
    for spec in layout:
        if layout.local_box(spec, rank) is None:
            continue
        data = parameter_values(layout.held_shape(spec, rank), injection.torch_dtype_of(layout.piece(spec, rank)),
                                device)
        if dtensor_placements is not None and spec.name not in plain:
            assert mesh is not None
            dims = (dtensor_axes or {}).get(spec.name, whole_mesh_dims(layout.mesh.names))
            placements = dims_placements(dtensor_placements.get(spec.name, {}), dims)
            data = DTensor.from_local(data, dtensor_mesh(mesh, dims), placements, run_check=False)
        _install(root, spec.name, nn.Parameter(data, requires_grad=spec.trainable))
    return root


_GENERATED: "OrderedDict[tuple[int, int, int], tuple[Layout, Injection, dict[str, torch.Tensor | None]]]" = \
    OrderedDict()
_GENERATED_KEPT = 8


def generated_grads(layout: Layout, injection: Injection, rank: int) -> dict[str, torch.Tensor | None]:
    """This rank's generated gradients of a variant, hashed once and kept for its later cases (every
    target, norm type and bound of a variant runs on the same gradients; hashing each element again
    was a large share of a case's CPU: docs/performance.md, "Earlier figures"). Keyed by the objects,
    kept alive while cached: read them, never write into them."""
    key = (id(layout), id(injection), rank)
    entry = _GENERATED.get(key)
    if entry is None or entry[0] is not layout or entry[1] is not injection:
        entry = (layout, injection, {spec.name: local_grad(layout, injection, spec, rank) for spec in layout
                                     if layout.local_box(spec, rank) is not None})
        _GENERATED[key] = entry
        while len(_GENERATED) > _GENERATED_KEPT:
            _GENERATED.popitem(last=False)
    _GENERATED.move_to_end(key)
    return entry[2]


def inject_grads(model: nn.Module, layout: Layout, injection: Injection, rank: int) -> None:
    """Give every parameter this rank's gradient (or None), wrapped like the parameter itself; a copy
    of the generated one, since the function under test writes into it."""
    generated = generated_grads(layout, injection, rank)
    for name, p in model.named_parameters():
        grad = generated[name]
        if grad is not None:
            grad = grad.to(local_tensor(p).device, copy=True)
            if isinstance(p, DTensor):
                grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False)
        p.grad = grad


def local_grads(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor | None]:
    """Rank-local gradient tensors by name; None where absent or without a gradient."""
    params = dict(model.named_parameters())
    out: dict[str, torch.Tensor | None] = {}
    for name in names:
        p = params.get(name)
        out[name] = None if p is None or p.grad is None else local_tensor(p.grad)
    return out
