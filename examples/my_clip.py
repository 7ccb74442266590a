# examples/my_clip.py -- run with: clipcheck run --nproc 4 --target examples/my_clip.py:clip (docs/writing-a-target.md)
import torch
import torch.distributed as dist

import harness
from harness import Shard


def clip(model, *, max_norm, norm_type=2.0):
    ctx = harness.context(model)
    local = torch.zeros((), dtype=torch.float64)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        placements = ctx.declared[name]                      # the plan's belief, per mesh axis
        replicas = 1
        for axis in ctx.mesh_spec.names:                     # replicated axes hold copies: count once
            if not isinstance(placements.get(axis), Shard):
                replicas *= ctx.group_size(axis)
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad   # DTensor or plain
        local += grad.double().abs().pow(norm_type).sum() / replicas
    dist.all_reduce(local)
    total = float(local) ** (1 / norm_type)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(min(1.0, max_norm / (total + 1e-6)))  # DTensor grads scale in place too
    return total
