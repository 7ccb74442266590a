"""Recipe: torch FSDP2 + expert parallelism, audited after the user's own backward.

    torchrun --nproc_per_node=4 tests/audit_jobs/fsdp2_ep.py MODE OUT.json [save=PATH]

The model is wrapped as VeOmni and xorl wrap theirs: the dense layers ``fully_shard``-ed over every rank,
each EP rank's own experts (a stacked EP-local tensor) ``fully_shard``-ed on the ``ep_fsdp`` dim of an
``(ep, ep_fsdp)`` mesh (ep = 2). One real forward and backward (FSDP2's reduce-scatters), then
``harness.audit(model, clip, mesh=ep_mesh)`` (the mesh: the declared-vs-measured placement audit) with:

* ``per-mesh``: each shard's sum of squares, reduced over every rank (dense over FSDP; experts over
  ``ep_fsdp`` and then ``ep``), one root, ``clip_grads_with_norm_``: right;
* ``no-ep-reduce``: the experts reduced over ``ep_fsdp`` only (the missing EP reduction): caught;
* ``torch``: ``torch.nn.utils.clip_grad_norm_`` on the whole model: raises on every rank (pytorch #180346,
  norms on two meshes cannot be stacked), reported by the audit with each rank's cause.

With ``save=PATH`` the audit is saved: its layout keeps each DTensor on its own mesh (the experts on the
``ep_fsdp`` sub-mesh, the dense layers on every rank flattened), so ``torch-dtensor`` replays it
(tests/test_audit_replay.py).
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import harness
from job_output import save_as_asked, write

WIDTH, LOCAL_EXPERTS, EP, MAX_NORM = 8, 2, 2, 1e-3


class Experts(nn.Module):
    """This EP rank's experts, stacked; the tokens routed round-robin (token t to expert t mod E), so each
    expert's gradient is its own (a forward of its own, so FSDP2 gathers the weight around it)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(LOCAL_EXPERTS, WIDTH, WIDTH) / WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        routed = h.reshape(-1, LOCAL_EXPERTS, WIDTH).transpose(0, 1)
        return torch.einsum("etw,evw->etv", routed, self.weight)


class MoE(nn.Module):
    def __init__(self, ep_rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
        torch.manual_seed(10 + ep_rank)  # this EP rank's experts
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(self.dense(x)).pow(2).sum()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def make_clip(model: MoE, mode: str, ep_mesh):  # type: ignore[no-untyped-def]
    params = [p for p in model.parameters() if p.grad is not None]
    if mode == "torch":
        return lambda: torch.nn.utils.clip_grad_norm_(params, MAX_NORM)

    def clip() -> float:
        dense = sum(float(local(p.grad).double().pow(2).sum()) for p in model.dense.parameters())
        experts = float(local(model.experts.weight.grad).double().pow(2).sum())
        dense_t = torch.tensor([dense], dtype=torch.float64)
        dist.all_reduce(dense_t)
        experts_t = torch.tensor([experts], dtype=torch.float64)
        dist.all_reduce(experts_t, group=ep_mesh.get_group("ep_fsdp"))
        if mode == "per-mesh":
            dist.all_reduce(experts_t, group=ep_mesh.get_group("ep"))
        total = math.sqrt(float(dense_t) + float(experts_t))
        coefficient = min(1.0, MAX_NORM / (total + 1e-6))
        for p in params:  # each shard in place (torch's foreach clip refuses gradients on two meshes)
            local(p.grad).mul_(coefficient)
        return total

    return clip


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    ep_mesh = init_device_mesh("cpu", (EP, world // EP), mesh_dim_names=("ep", "ep_fsdp"))
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    model = MoE(ep_mesh.get_local_rank("ep"))
    fully_shard(model.experts, mesh=ep_mesh["ep_fsdp"])
    fully_shard(model.dense, mesh=flat)
    torch.manual_seed(100 + rank)  # each rank its own batch
    model(torch.randn(16, WIDTH)).backward()
    report = harness.audit(model, make_clip(model, mode, ep_mesh), max_norm=MAX_NORM, mesh=ep_mesh, restore=True)
    save_as_asked(report, sys.argv[3:])
    write(out, report)


if __name__ == "__main__":
    main()
