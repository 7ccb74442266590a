"""The job's mesh as ``harness.audit`` reads it: the mesh the user passed, or the root of the DTensor
parameters' mesh, as axis names and sizes, each DTensor parameter's declared placement per axis (what
the declared-vs-measured placement audit compares with the bits) and the axes its own mesh's dims span
(what a replay rebuilds its sub-mesh from)."""

from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as TorchShard

from harness.cases.layout import MeshSpec


def _root(mesh: DeviceMesh) -> DeviceMesh:
    get_root = getattr(mesh, "_get_root_mesh", None)
    return get_root() if callable(get_root) else mesh


def _my_group(mesh: DeviceMesh, dim: int) -> frozenset[int]:
    """The ranks of this rank's group along ``dim`` of ``mesh`` (a mesh holds this rank's slice only)."""
    ranks = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.mesh.shape[dim])
    me = dist.get_rank()
    for row in ranks.tolist():
        if me in row:
            return frozenset(row)
    return frozenset()


def _axes_of(mesh: DeviceMesh, dim: int, spec: MeshSpec) -> list[str] | None:
    """The axes of the job's mesh ``spec`` that dim ``dim`` of a (sub-, flattened) mesh spans: those
    whose groups, together, are its groups."""
    mine = _my_group(mesh, dim)
    me = dist.get_rank()
    names = list(spec.names)
    for size in range(1, len(names) + 1):
        for start in range(len(names) - size + 1):
            axes = names[start:start + size]
            group = next((g for g in spec.groups(*axes) if me in g), [])
            if frozenset(group) == mine:
                return axes
    return None


def job_mesh(params: Sequence[tuple[str, nn.Parameter]], mesh: DeviceMesh | None, world_size: int
             ) -> tuple[list[list[Any]] | None, dict[str, dict[str, Any]], dict[str, list[list[str]]], list[str]]:
    """This rank's view of the job's mesh (the one given, else the root of the DTensor parameters'
    mesh), as axis names and sizes; each DTensor parameter's declared placement per axis of it
    (``"R"`` or the tensor dim it is sharded on); each one's mesh dims as the axes each spans (where every
    dim maps: a replay rebuilds the DTensor on that sub-mesh, ``Variant.dtensor_axes``); notes on what
    could not be read."""
    notes: list[str] = []
    root = mesh if mesh is not None else next((_root(p.device_mesh) for _, p in params if isinstance(p, DTensor)),
                                              None)
    if root is None or not dist.is_initialized():
        return None, {}, {}, notes
    if root.size() != world_size or root.mesh.flatten().tolist() != list(range(world_size)):
        notes.append(f"the mesh {tuple(root.mesh.shape)} does not hold the {world_size} ranks in order: measured "
                     "on one axis of every rank instead")
        return None, {}, {}, notes
    names = root.mesh_dim_names or tuple(f"dim{i}" for i in range(root.ndim))
    pairs = [(str(n), int(s)) for n, s in zip(names, root.mesh.shape)]
    axes: list[list[Any]] = [list(pair) for pair in pairs]
    spec = MeshSpec(tuple(pairs))
    declared: dict[str, dict[str, Any]] = {}
    spans: dict[str, list[list[str]]] = {}
    for name, p in params:
        if not isinstance(p, DTensor):
            continue
        placed: dict[str, Any] = {}
        dims: list[list[str]] = []
        for dim, placement in enumerate(p.placements):
            covered = _axes_of(p.device_mesh, dim, spec)
            if covered is None:
                notes.append(f"{name}: its mesh dim {dim} spans no axes of the job's mesh; no declared placement")
                placed = {}
                break
            dims.append(covered)
            for axis in covered:
                placed[axis] = placement.dim if isinstance(placement, TorchShard) else "R"
        else:
            spans[name] = dims
        declared[name] = placed  # empty where unread: still a DTensor (a replay must not build it plain)
    return axes, declared, spans, notes
