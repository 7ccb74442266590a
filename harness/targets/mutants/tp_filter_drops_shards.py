"""TP-duplicate filter applied to shards: TP-sharded gradients are counted on TP rank 0 only.

Megatron counts a parameter on every TP rank only when it is marked ``tensor_model_parallel``; the
grouped-GEMM expert weights of megatron-core 0.16.1 were not, so the TP-duplicate filter kept only
TP rank 0's shards (NVIDIA/Megatron-LM PR #5916; the param-norm twin in Megatron-Bridge PR #4998).
"""

import torch
import torch.nn as nn

from harness.clipmath import reduce_root_and_clip, trainable_with_grads, weighted_partial
from harness.cases.axes import MeshAxis
from harness.cases.context import context
from harness.cases.layout import Shard


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    ctx = context(model)
    params = trainable_with_grads(model)
    mesh = ctx.mesh_spec
    off_rank0 = mesh.has(MeshAxis.TP) and mesh.coordinate(ctx.rank)[mesh.index(MeshAxis.TP)] != 0
    counted = [(n, p) for n, p in params
               if not (off_rank0 and isinstance(ctx.declared_placement(n, MeshAxis.TP), Shard))]
    local = weighted_partial(counted, norm_type, lambda name, _: ctx.true_replica_count(name))
    return torch.tensor(reduce_root_and_clip(local, (p for _, p in params), max_norm=max_norm,
                                             norm_type=norm_type), dtype=torch.float64)
