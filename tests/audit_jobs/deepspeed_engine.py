"""Recipe: DeepSpeed's engine audited from its own step (``engine.clip_fp32_gradients``, ZeRO-0, fp32).

A dense layer and a ``deepspeed.moe.layer.MoE`` with 4 experts, ``deepspeed.initialize`` with
``gradient_clipping``, then the user's step: ``loss = engine(x)``, ``engine.backward(loss)`` (the engine's
own data-parallel and expert-data-parallel all-reduce), and ``engine.step()``, whose
``_take_model_step`` calls ``clip_fp32_gradients``: the audit wraps that method for the step.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=4 tests/audit_jobs/deepspeed_engine.py EP OUT.json

``EP``: the expert-parallel size. ``ep=1`` (every expert on every rank) is where DeepSpeed 0.19.8 is
right; ``ep=world`` (owner-sharded experts) is DeepSpeed #8475: its fp32 clip averages the per-rank norms.
Rank 0 writes the audit and, computed here without the harness, the mean of the per-rank norms over
the true norm (the ratio the finding predicts) to OUT.json.
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

import harness
from job_output import write

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


def predicted_ratio(net: nn.Module) -> float:
    """The mean of the per-rank norms (what #8475's clip reports) over the norm of the distinct gradients
    (replicas found by comparing them whole: every gradient gathered, fine at this size)."""
    mine = {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    rank_norms = [math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values())) for grads in every]
    distinct: list[torch.Tensor] = []
    for grads in every:
        for g in grads.values():
            if not any(g.shape == d.shape and torch.equal(g, d) for d in distinct):
                distinct.append(g)
    true = math.sqrt(sum(float(g.double().pow(2).sum()) for g in distinct))
    return sum(rank_norms) / len(rank_norms) / true


def main() -> None:
    ep, out = int(sys.argv[1]), sys.argv[2]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    importlib.import_module("deepspeed.comm.torch")
    setattr(sys.modules["deepspeed.comm.torch"], "build_shm_op", lambda: None)  # a CPU fast path not used here
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    net = Net(ep_size=ep)
    config = {"train_batch_size": world, "gradient_clipping": MAX_NORM, "zero_optimization": {"stage": 0}}
    engine: Any
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.0), config=config)

    torch.manual_seed(1 + dist.get_rank())
    engine.backward(engine(torch.randn(TOKENS, WIDTH)))
    ratio = predicted_ratio(net)
    with harness.auditing(net, engine, "clip_fp32_gradients", max_norm=MAX_NORM, restore=True) as hook:
        engine.step()
    write(out, hook.report, predicted_ratio=ratio)


if __name__ == "__main__":
    main()
