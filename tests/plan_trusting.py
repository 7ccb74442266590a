"""A clip that trusts the declared plan, as torchtitan's and most FSDP2/DTensor clips do by design: a
parameter's copies are the ranks the plan says hold the same slice (every declared-Replicate axis, among
the ranks that hold the parameter at all). Exact when the plan tells the truth; counted wrong where it
lies, which is the plan's bug, not this clip's (``--plans honest``)."""

from __future__ import annotations

import torch
import torch.nn as nn

import harness
from harness.cases.layout import Replicate
from harness.clipmath import reduce_root_and_clip, trainable_with_grads, weighted_partial


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    ctx = harness.context(model)
    mesh = ctx.mesh_spec
    here = mesh.coordinate(ctx.rank)

    def declared_copies(name: str, _: nn.Parameter) -> int:
        sharded = [i for i, axis in enumerate(mesh.names) if not isinstance(ctx.declared_placement(name, axis), Replicate)]
        holders = ctx.param_spec(name).present_ranks or range(mesh.world_size)
        return sum(1 for r in holders if all(mesh.coordinate(r)[i] == here[i] for i in sharded))

    params = trainable_with_grads(model)
    local = weighted_partial(params, norm_type, declared_copies)
    return torch.tensor(reduce_root_and_clip(local, (p for _, p in params), max_norm=max_norm,
                                             norm_type=norm_type), dtype=torch.float64)
