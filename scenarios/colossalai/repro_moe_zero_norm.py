"""ColossalAI (0.5.0, the newest release; the same code at HEAD), standalone: the MoE hybrid plugin's
ZeRO optimizer reports, and clips by, a norm that is neither the global one nor the same on every
rank. ``LowLevelZeroOptimizer.step`` adds the norms of its two gradient stores linearly
(``norm_group += _compute_grad_norm(...)``), and the expert store's norm is reduced over ``moe_dp``
only, never over ``ep`` (hpcaitech/ColossalAI #2192's class): each rank gets
``||dense|| + ||its own experts||`` instead of ``sqrt(||dense||^2 + ||all experts||^2)``.

Who reaches it, stock: ``Booster(plugin=MoeHybridParallelPlugin(ep_size=k > 1, zero_stage=1,
precision="bf16", max_norm=...))``, ``booster.boost(model, optimizer)``, ``booster.backward(loss,
optimizer)``, ``optimizer.step()``: ColossalAI's own training loop.

Here ep = world (each rank holds its own 4/world experts, marked with ``set_moe_tensor_ep_group`` as
ColossalAI's EP MoE blocks mark theirs), a real forward and ``booster.backward``; the true norm is
taken from the gradients ZeRO holds after its reduction (``get_param_grad``): the dense ones are the
same on every rank, the experts' are every rank's own. Two CPU shims, none in ColossalAI: its ZeRO
asserts an accelerator named cuda (a ``CpuAccelerator`` so named, without streams), and shardformer
needs a policy for the model (one that replaces nothing, passed as the plugin's ``custom_policy``).

    torchrun --nproc_per_node=2 scenarios/colossalai/repro_moe_zero_norm.py   (2 or 4 ranks)
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn


def _cpu_as_cuda() -> None:
    from colossalai.accelerator import CpuAccelerator, set_accelerator

    class CpuAsCuda(CpuAccelerator):
        def __init__(self) -> None:
            super().__init__()
            self._name = "cuda"

        def Stream(self, *args: Any, **kwargs: Any) -> None:
            return None

        def current_stream(self, *args: Any) -> None:
            return None

        def stream(self, stream: Any) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

        def synchronize(self, *args: Any) -> None:
            return None

    set_accelerator(CpuAsCuda())


def _no_shard_policy() -> Any:
    from colossalai.shardformer.policies.base_policy import Policy

    class NoShard(Policy):
        def config_sanity_check(self) -> None:
            return None

        def preprocess(self) -> nn.Module:
            return self.model

        def module_policy(self) -> dict:
            return {}

        def postprocess(self) -> nn.Module:
            return self.model

    return NoShard()


class MoEBlock(nn.Module):
    def __init__(self, local_experts: int) -> None:
        super().__init__()
        self.dense = nn.Linear(16, 16)
        self.experts = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(local_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense(x)
        return sum((expert(h) for expert in self.experts), torch.zeros_like(h))


class Frozen(torch.optim.SGD):  # the parameters stay as they are; ZeRO still reduces, measures and clips
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    _cpu_as_cuda()
    from colossalai.booster import Booster
    from colossalai.booster.plugin.moe_hybrid_parallel_plugin import MoeHybridParallelPlugin
    from colossalai.tensor.moe_tensor.api import set_moe_tensor_ep_group

    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=world, zero_stage=1, precision="bf16",
                                     max_norm=1.0, custom_policy=_no_shard_policy())
    torch.manual_seed(0)
    model = MoEBlock(4 // world)
    torch.manual_seed(1 + rank)  # every EP rank its own experts and tokens
    for name, p in model.named_parameters():
        if name.startswith("experts."):
            nn.init.normal_(p)
            set_moe_tensor_ep_group(p, plugin.ep_group)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, Frozen(model.parameters(), lr=0.0))
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    booster.backward(model(x).float().square().mean(), optimizer)

    dense = experts = 0.0
    for name, p in model.unwrap().named_parameters():
        squares = float(optimizer.get_param_grad(p).double().square().sum())
        if "experts" in name:
            experts += squares
        else:
            dense += squares
    own = torch.tensor([experts], dtype=torch.float64)
    dist.all_reduce(own)
    true = math.sqrt(dense + float(own))
    optimizer.step()
    reported = float(optimizer.get_grad_norm())
    print(f"rank {rank}: reported {reported:.6f}, ||dense|| + ||own experts|| = "
          f"{math.sqrt(dense) + math.sqrt(experts):.6f}", flush=True)
    dist.barrier()
    if rank == 0:
        import importlib.metadata
        print(f"colossalai {importlib.metadata.version('colossalai')}, ep={world}: every rank should report "
              f"sqrt(dense^2 + all experts^2)")
        print(f"reported={reported:.6f} true={true:.6f} ratio={reported / true:.6f}")
    dist.barrier()  # every rank done with its collectives before any tears its groups down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
