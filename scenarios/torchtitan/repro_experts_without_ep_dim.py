"""torchtitan's EP clip raises on experts FSDP-wrapped on a mesh without an ``ep`` axis.

``torchtitan.distributed.utils.clip_grad_norm_(..., ep_enabled=True)`` (the call its trainer makes
when ``expert_parallel_degree > 1``) splits the gradients by whether their DTensor mesh names an
``ep`` axis. torchtitan's own parallelize always builds the experts that way: ``distribute_tensor``
over ``ep`` (``Shard(0)``), then ``fully_shard`` on ``efsdp``, so FSDP2 puts them on ``(efsdp, ep)``;
that control layout is run first and is exact. Experts parallelized the way VeOmni and xorl do it
(plain EP-local tensors ``fully_shard``-ed on the ``efsdp`` sub-mesh alone) land in the non-EP group
next to the dense parameters on the flat FSDP mesh, and torch's ``get_total_norm`` stacks norms from
two meshes: ``RuntimeError: All operands in aten.stack.default must have the same mesh``
(pytorch/pytorch #180346; the mechanism is torch's).

Who reaches it: a direct call only (torchtitan's clip on a model another framework parallelized);
torchtitan's trainer never builds these meshes.

Run: ``torchrun --standalone --nproc_per_node=4 scenarios/torchtitan/repro_experts_without_ep_dim.py``
(2 or 4 ranks; ep = 2). The last line on rank 0: ``reported=raised true=<float> error=<the exception>``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

DIM, HIDDEN, EXPERTS, EP = 8, 4, 4, 2
EFSDP_AXIS, EP_AXIS = "efsdp", "ep"  # torchtitan's names for the sparse mesh's axes


class Experts(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, DIM, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1 = self.w1.to_local() if isinstance(self.w1, DTensor) else self.w1  # as torchtitan's GroupedExperts
        return torch.einsum("bd,edh->beh", x, w1)


class MoE(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.dense = nn.Linear(DIM, DIM)
        self.experts = Experts(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(self.dense(x)).square().sum()


def build(sparse: DeviceMesh, dense: DeviceMesh, experts_on_ep: bool) -> MoE:
    torch.manual_seed(0)  # every rank builds the global model, as torchtitan's builder does
    model = MoE(EXPERTS)
    ep_rank, local = sparse.get_local_rank(EP_AXIS), EXPERTS // EP
    if experts_on_ep:  # torchtitan's parallelize: the experts over ep
        model.experts.w1 = nn.Parameter(distribute_tensor(model.experts.w1.detach(), sparse[EP_AXIS], [Shard(0)]))
    else:  # VeOmni / xorl: each EP rank keeps its own experts as a plain tensor
        model.experts.w1 = nn.Parameter(model.experts.w1.detach()[ep_rank * local:(ep_rank + 1) * local].clone())
    fully_shard(model.experts, mesh=sparse[EFSDP_AXIS])
    fully_shard(model, mesh=dense)
    return model


def run(model: MoE, rank: int) -> tuple[str, float, str]:
    """Forward and backward, the truth gathered over every rank, then torchtitan's clip."""
    from torchtitan.distributed.utils import clip_grad_norm_

    torch.manual_seed(1 + rank)
    model(torch.randn(4, DIM)).backward()
    # every gradient element lives on exactly one rank (no replica): the squares sum
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = torch.stack([(g.to_local() if isinstance(g, DTensor) else g).double().square().sum() for g in grads]).sum()
    dist.all_reduce(local)
    try:
        total = clip_grad_norm_(list(model.parameters()), 1.0, foreach=True, pp_mesh=None, ep_enabled=True)
        return f"{float(total):.6f}", math.sqrt(float(local)), ""
    except RuntimeError as exc:
        return "raised", math.sqrt(float(local)), f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sparse = init_device_mesh("cpu", (world // EP, EP), mesh_dim_names=(EFSDP_AXIS, EP_AXIS))
    dense = sparse._flatten("fsdp")  # torchtitan's dense FSDP mesh: every rank
    for experts_on_ep in (True, False):
        model = build(sparse, dense, experts_on_ep)
        mesh = model.experts.w1.device_mesh if isinstance(model.experts.w1, DTensor) else None
        reported, true, error = run(model, rank)
        if rank == 0:
            how = "torchtitan's layout" if experts_on_ep else "experts without ep dim"
            print(f"world {world}, {how}: experts on {mesh}, dense on {dense}")
            print(f"reported={reported} true={true:.6f} error={error}")
    dist.barrier()  # every rank done with its collectives before any tears its groups down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
