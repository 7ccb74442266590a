"""xorl's clip_grad_norm under-reports per-expert MoE LoRA gradients by 1/sqrt(ep_size) under minimax_m3's
EP plan, built the way xorl's trainer builds it (no clipcheck).

What it shows: xorl's builder (``build_training_model``) makes the model on the meta device at global
shapes, injects MoE LoRA at global shape (``inject_lora_into_model``), then ``build_parallelize_model``
applies the model's ``get_ep_plan()``, which slices only the patterns it lists. minimax_m3's plan lists
no LoRA factor, so every EP rank keeps a full-size ``[E, ...]`` copy of each factor, with the fallback
``Replicate`` placement; ``_build_ep_param_groups`` puts them in ``ep_replicated`` and the clip divides
their EP-summed p-th powers by ep_size, as if they were replicas. Their gradients are each EP rank's
own (its own experts' tokens; nothing sums them over EP), so the norm is 1/sqrt(ep) too small. The
qwen3_moe plan (which lists the factors) is the control: exact.

The gradients: each FSDP unit's forward runs (xorl's FSDP2 wrapping: unshard, reduce-scatter), the
experts module's forward being a loss linear in its LoRA factors with a direction seeded per rank (a
real MoE forward needs xorl's EP all-to-all, which gloo cannot run), then the server's
``synchronize_ep_replicated_gradients``, then ``clip_grad_norm``. The true norm counts a gradient once
if it is bit-identical on every EP rank, else once per rank.

Who reaches it: MoE LoRA training of minimax_m3 with expert parallelism: ``lora.enable_lora`` with
``lora.lora_target_modules`` naming gate_proj/up_proj/down_proj (minimax_m3's default targets are the
attention projections only), ``train.expert_parallel_size`` > 1, and ``model.moe_implementation: eager``
(with the global-shape factors, the ``native`` default's grouped GEMM raises "matrix batch sizes have to
match" in the first forward and ``triton`` asserts ``len(cumsum_M) == b.shape[0]``; eager trains the
first E/ep rows of every copy).

    PYTHONPATH=<xorl>/src torchrun --nproc_per_node=4 scenarios/xorl/repro_ep_lora_undercount.py minimax_m3
    PYTHONPATH=<xorl>/src torchrun --nproc_per_node=2 scenarios/xorl/repro_ep_lora_undercount.py qwen3_moe
"""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn

E, H, I, R = 8, 64, 128, 8


def main() -> None:
    plan_name = sys.argv[1] if len(sys.argv) > 1 else "minimax_m3"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from xorl.distributed.ep_gradients import synchronize_ep_replicated_gradients
    from xorl.distributed.fsdp2.clip_grad_norm import clip_grad_norm
    from xorl.distributed.parallel_state import init_parallel_state
    from xorl.distributed.torch_parallelize import build_parallelize_model
    from xorl.lora import freeze_base_parameters
    from xorl.lora.utils import inject_lora_into_model
    from xorl.models.layers.moe import MoEBlock

    init_parallel_state(dp_size=world, dp_shard_size=world, ep_size=world, dp_mode="fsdp2", device_type="cpu")

    class Layer(nn.Module):  # the decoder layer: xorl's FSDP unit around its real MoEBlock
        def __init__(self) -> None:
            super().__init__()
            self.mlp = MoEBlock(hidden_size=H, num_experts=E, top_k=2, intermediate_size=I, moe_implementation="eager")

        def forward(self) -> torch.Tensor:
            return self.mlp.experts()

    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Layer()])

    class Model(nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self) -> None:
            super().__init__()
            self.model = Body()
            self.config = SimpleNamespace(num_experts=E)

        def forward(self) -> torch.Tensor:
            return cast(Layer, self.model.layers[0])()

        def get_parallel_plan(self) -> object:
            return importlib.import_module(f"xorl.models.transformers.{plan_name}.parallelize").get_ep_plan()

        def init_weights(self) -> None:
            for p in self.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).normal_(0, 0.02)

    with torch.device("meta"):  # global shapes, as build_foundation_model(init_device="meta")
        model = Model()
    inject_lora_into_model(model, r=R, lora_alpha=2 * R, target_modules=["gate_proj", "up_proj", "down_proj"])
    build_parallelize_model(model, init_device="meta", weights_path=None, enable_mixed_precision=False,
                            enable_gradient_checkpointing=False, basic_modules=["Layer"])
    freeze_base_parameters(model)

    experts = cast(Layer, model.model.layers[0]).mlp.experts
    factors = [n for n, p in experts.named_parameters() if p.requires_grad]
    directions = {}
    for i, name in enumerate(factors):  # each EP rank's own gradient, seeded per rank
        shape = getattr(experts, name).to_local().shape  # ep_fsdp = 1: the local tensor is the unsharded one
        directions[name] = torch.randn(shape, generator=torch.Generator().manual_seed(5000 + i + 977 * (rank + 1)))
    experts.forward = lambda: sum((getattr(experts, n) * d).sum() for n, d in directions.items())
    model().backward()
    synchronize_ep_replicated_gradients(model)  # the server runs it before clip_gradients

    replicated, distinct = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for name in factors:
        grad = getattr(experts, name).grad.to_local().double()
        high, low = grad.clone(), grad.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        if bool((high == low).all()):
            replicated += grad.square().sum()
        else:
            distinct += grad.square().sum()
    dist.all_reduce(replicated)
    dist.all_reduce(distinct)
    true = float((replicated / world + distinct).sqrt())
    reported = float(clip_grad_norm(model, max_norm=1e9, norm_type=2.0))  # no clipping: the norm only
    if rank == 0:
        ids = {id(p) for p in getattr(model, "_ep_param_groups")["ep_replicated"]}
        shapes = {n: tuple(getattr(experts, n).to_local().shape) for n in factors[:2]}
        print(f"plan={plan_name} ep_size={world} num_experts={E} per-expert MoE LoRA (hybrid_shared=False)")
        print(f"  factor shapes on each rank: {shapes}")
        print(f"  classified ep_replicated: {[n for n in factors if id(getattr(experts, n)) in ids]}")
        print(f"reported={reported:.6f} true={true:.6f} ratio={reported / true:.6f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
