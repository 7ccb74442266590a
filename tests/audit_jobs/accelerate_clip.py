"""Recipe: accelerate's ``Accelerator.clip_grad_norm_`` audited in the user's own loop.

    torchrun --nproc_per_node=4 tests/audit_jobs/accelerate_clip.py MODE OUT.json

``Accelerator(cpu=True)`` under torchrun (accelerate's MULTI_CPU), one real forward and
``accelerator.backward``, then ``harness.audit(model, lambda: accelerator.clip_grad_norm_(...))``:

* ``ddp``: the model ``accelerator.prepare``d (DistributedDataParallel): replicas; accelerate is right;
* ``tp-dtensor``: a tensor-parallel expert as a DTensor sharded on a 1-D mesh (``Shard(0)``, the dense part
  kept in sync by hand as TP's replicated layers are): accelerate's ``_clip_grad_norm_dtensor_aware``
  reduces the DTensor group over its mesh; right, and the audit also checks the declared placement;
* ``tp-plain``: the same expert as a plain local tensor (transformers' ``local_colwise`` / 5.5 to 5.14
  TP shards, our finding "tp experts plain"): accelerate takes the plain group's norm rank-locally and
  the audit catches it (each rank reports its own shards).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import harness
from job_output import write

WIDTH, MAX_NORM = 8, 1e-3


class Net(nn.Module):
    """A dense layer, and an expert whose output columns are split over the ranks (column-parallel,
    outputs gathered): ``expert`` holds this rank's rows of the logical ``(WIDTH * world, WIDTH)`` weight."""

    def __init__(self, mode: str, world: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(WIDTH, WIDTH)
        full = torch.randn(WIDTH * world, WIDTH)
        if mode == "tp-dtensor":
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
            self.expert = nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
        elif mode == "tp-plain":
            self.expert = nn.Parameter(full.chunk(world)[dist.get_rank()].clone())
        else:
            self.expert = nn.Parameter(full[:WIDTH].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense(x)
        w = self.expert.to_local() if isinstance(self.expert, DTensor) else self.expert
        return (h @ w.t()).pow(2).sum()


def main() -> None:
    from accelerate import Accelerator

    mode, out = sys.argv[1], sys.argv[2]
    accelerator = Accelerator(cpu=True)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = Net(mode, world)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    if mode == "ddp":
        model, optimizer = accelerator.prepare(model, optimizer)
    torch.manual_seed(1 + rank if mode == "ddp" else 1)  # TP ranks see the same batch, DP ranks their own
    accelerator.backward(model(torch.randn(16, WIDTH)))
    if mode != "ddp":  # the replicated dense layer of a TP group: identical on every rank
        for p in model.dense.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
    params = list(model.parameters())
    report = harness.audit(model, lambda: accelerator.clip_grad_norm_(params, MAX_NORM), max_norm=MAX_NORM,
                           restore=True)
    write(out, report)


if __name__ == "__main__":
    main()
