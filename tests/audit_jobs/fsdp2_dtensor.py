"""A DTensor job whose audit is saved and replayed with ``torch-dtensor`` (run by tests/test_audit_replay.py).

    torchrun --nproc_per_node=4 tests/audit_jobs/fsdp2_dtensor.py MODE OUT.json save=PATH

An MLP ``fully_shard``-ed over every rank (FSDP2: DTensor parameters sharded on one mesh, ``fsdp``), one real
forward and backward (its reduce-scatters), then ``harness.audit`` of ``torch.nn.utils.clip_grad_norm_`` on
the whole model:

* ``honest``: the MLP alone: torch's clip counts each shard once, right;
* ``replicate-lie``: beside it, a DTensor declared ``Replicate`` on the same mesh whose gradients differ on
  every rank (each rank's own batch, no all-reduce: its ``to_local`` in the forward): torch's clip takes
  the norm of a replicated DTensor on each rank alone, so the ranks disagree, and the audit says the
  declared placement is wrong.

The saved layout keeps the DTensors (their mesh and placements), so the replay of ``torch-dtensor`` on CPU
ranks judges torch's clip on the same placements and must reach the job's verdict.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate

import harness
from job_output import save_as_asked, write

WIDTH, MAX_NORM = 8, 1e-3


class Net(nn.Module):
    def __init__(self, mesh, lie: bool) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH))
        self.lie = nn.Parameter(DTensor.from_local(torch.randn(WIDTH), mesh, [Replicate()])) if lie else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.lie is not None:
            h = h * self.lie.to_local()  # its gradient stays this rank's own: declared Replicate, measured distinct
        return h.pow(2).sum()


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    model = Net(mesh, lie=mode == "replicate-lie")
    fully_shard(model.body, mesh=mesh)
    torch.manual_seed(100 + dist.get_rank())  # each rank its own batch
    model(torch.randn(16, WIDTH)).backward()
    report = harness.audit(model, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM),
                           max_norm=MAX_NORM)
    save_as_asked(report, sys.argv[3:])
    write(out, report)


if __name__ == "__main__":
    main()
