"""DeepSpeed #8475 through the engine: the fp32 clip reports the mean of per-rank norms when ranks own
different experts, so it under-reports the global norm and under-clips.

What it runs (DeepSpeed's own API only): a dense layer and a ``deepspeed.moe.layer.MoE`` with 4 experts
sharded over every rank (``ep_size = world``), ``deepspeed.initialize`` with ZeRO-0, fp32 and
``gradient_clipping`` (the configuration of the seed report, AutoEP/MoE with ZeRO-0 fp32), then
``loss = engine(x)``, ``engine.backward(loss)`` (the engine's own data-parallel / expert-data-parallel
gradient all-reduce) and ``engine.step()``, whose ``_take_model_step`` calls ``clip_fp32_gradients``.
The gradients the optimizer then receives are read by a step pre-hook: the coefficient the clip applied
gives the norm it computed (``max_norm / coefficient - 1e-6``). The true norm: every rank's gradients
after ``engine.backward`` gathered on rank 0, each logical parameter counted once (dense ones and the
gate are replicated on every rank, expert ``i`` lives on rank ``i // (4 / world)``).

Who reaches it: stock, every DeepSpeed MoE/AutoEP run with ep_size > 1, ZeRO-0, fp32 and gradient
clipping on (``gradient_clipping`` defaults to 1.0).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 scenarios/deepspeed/repro_engine_mean_of_norms.py

Last line on rank 0: ``reported=<the engine's norm> true=<the norm> ratio=<reported/true>``.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

NUM_EXPERTS, WIDTH, TOKENS, MAX_NORM = 4, 8, 16, 1e-3


class Net(nn.Module):
    def __init__(self, ep_size: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.dense = nn.Linear(WIDTH, WIDTH, bias=False)
        self.moe = MoE(hidden_size=WIDTH, expert=nn.Linear(WIDTH, WIDTH, bias=False), num_experts=NUM_EXPERTS,
                       ep_size=ep_size, k=1, capacity_factor=float(NUM_EXPERTS), min_capacity=TOKENS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _, _ = self.moe(self.dense(x))
        return out.pow(2).sum()


def logical_grads(net: Net, ep_rank: int) -> dict[str, torch.Tensor]:
    """This rank's gradients by logical parameter (experts by their global index)."""
    local = net.moe.num_local_experts
    out = {"dense": net.dense.weight, "gate": net.moe.deepspeed_moe.gate.wg.weight}
    for j, expert in enumerate(net.moe.deepspeed_moe.experts.deepspeed_experts):
        out[f"expert{ep_rank * local + j}"] = expert.weight
    return {name: p.grad.detach().clone() for name, p in out.items() if p.grad is not None}


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    importlib.import_module("deepspeed.comm.torch")
    # DeepSpeed's CPU shared-memory comm op (a fast path this script does not use) would be JIT-built first
    setattr(sys.modules["deepspeed.comm.torch"], "build_shm_op", lambda: None)
    import deepspeed
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights everywhere (the engine broadcasts them anyway)
    net = Net(ep_size=world)
    config = {"train_batch_size": world, "gradient_clipping": MAX_NORM, "zero_optimization": {"stage": 0}}
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    engine: Any
    engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)

    torch.manual_seed(1 + rank)  # each data-parallel rank its own batch
    loss = engine(torch.randn(TOKENS, WIDTH))
    engine.backward(loss)
    ep_rank = dist.get_rank(group=groups._get_expert_parallel_group(f"ep_size_{world}"))
    before = logical_grads(net, ep_rank)

    clipped: dict[str, torch.Tensor] = {}
    optimizer.register_step_pre_hook(lambda *_: clipped.update(logical_grads(net, ep_rank)))
    engine.step()  # _take_model_step: clip_fp32_gradients, then the optimizer
    norm_before = math.sqrt(sum(float(g.double().pow(2).sum()) for g in before.values()))
    norm_after = math.sqrt(sum(float(g.double().pow(2).sum()) for g in clipped.values()))
    coefficient = norm_after / norm_before
    reported = MAX_NORM / coefficient - 1e-6

    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, before)
    rank_norms = [math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values())) for grads in gathered]
    if rank == 0:
        unique: dict[str, torch.Tensor] = {}
        for grads in gathered:
            for name, g in grads.items():
                assert name not in unique or torch.equal(unique[name], g), f"replicas of {name} differ"
                unique[name] = g
        true = math.sqrt(sum(float(g.double().pow(2).sum()) for g in unique.values()))
        print(f"per-rank norms {', '.join(f'{n:.6f}' for n in rank_norms)}; their mean "
              f"{sum(rank_norms) / world:.6f}; clip coefficient applied {coefficient:.6g} (max_norm={MAX_NORM})")
        print(f"reported={reported:.6f} true={true:.6f} ratio={reported / true:.6f}", flush=True)


if __name__ == "__main__":
    main()
