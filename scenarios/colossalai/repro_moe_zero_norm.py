"""ColossalAI (0.5.0, the newest release on PyPI; the same code in v0.5.1 and at HEAD), standalone: with
expert parallelism (ep > 1) the MoE hybrid plugin's ZeRO optimizer reports, and clips by, a gradient norm
that is neither the global one nor the same on every rank. Each rank gets
``||dense|| + ||its own experts||`` instead of ``sqrt(||dense||^2 + ||all experts||^2)``. Two defects:

* ``LowLevelZeroOptimizer.step`` (colossalai/zero/low_level/low_level_optim.py l.572-577) adds the norms
  of its gradient stores (non-MoE parameters, MoE parameters) linearly: ``norm_group +=
  self._compute_grad_norm(...)``; the stores hold disjoint parameters, whose norms add in squares.
  From hpcaitech/ColossalAI PR #5821 (commit 416580b, 2024-06-28); before it the MoE norm was a separate
  entry of ``norm_groups``, which ``calculate_global_norm_from_list`` adds in squares.
* the MoE store's norm is reduced over its own group, ``moe_dp``, and never over ``ep``
  (``HybridParallelZeroOptimizer._compute_grad_norm``, booster/plugin/hybrid_parallel_plugin.py
  l.842-924, sums over dp_pg, tp and pp; ``MoeHybridParallelZeroOptimizer`` keeps it): each rank counts
  only its own experts (the class of hpcaitech/ColossalAI #2192, filed in 2022 against older code).

Who reaches it: ``Booster(plugin=MoeHybridParallelPlugin(ep_size=k > 1, zero_stage=1, precision="bf16",
max_norm=m))``, ``booster.boost``, ``booster.backward(loss, optimizer)``, ``optimizer.step()``: ColossalAI's
own training loop, e.g. ColossalChat's ``examples/training_scripts/lora_finetune.py --plugin moe --ep k``
(its defaults: zero_stage 1, bf16, grad_clip 1.0).

Models (``--model``):

* ``mixtral`` (default): a tiny random ``MixtralForCausalLM`` built as lora_finetune.py builds it
  (``LazyInitContext``, ``AutoModelForCausalLM.from_config``, bf16, ``booster.boost``), so that
  ColossalAI's own Mixtral policy swaps in its ``EPMixtralSparseMoeBlock`` (experts split over ``ep``,
  marked by ``set_moe_tensor_ep_group``, tokens dispatched all-to-all); one real forward of the LM loss,
  ``booster.backward``, ``optimizer.step()``. Needs the transformers ColossalAI 0.5.0 pins
  (``transformers==4.51.3``; transformers 5 rewrote Mixtral's experts and the policy no longer applies).
* ``block``: one dense ``Linear`` and four expert ``Linear``s split over ``ep``, marked with
  ``set_moe_tensor_ep_group`` as ColossalAI's EP blocks mark theirs; any transformers.

The control: the true norm from the gradients ZeRO holds after its reduction, gathered (``get_param_grad``)
and counted once each (the dense ones checked bit-identical on every rank, each expert's on its replicas),
in float64; and ``--ep 1`` (one gradient store), where ColossalAI's report equals it. ColossalAI's
per-store norms (what ``step()`` combined) are recorded as ``_compute_grad_norm`` returned them, so that
each defect's share is computed from them: a partial fix must give exactly what the script predicts.

``--fix linear`` / ``--fix ep`` / ``--with-fix`` (both) apply, at run time, the proposed fix
(docs/findings/colossalai-moe-zero-norm.md): step() adds the stores' norms in squares; the MoE store's
norm is also reduced over the EP group its parameters carry.

Two CPU shims, none in ColossalAI: its ZeRO asserts an accelerator named cuda (a ``CpuAccelerator`` so
named, without streams); the ``block`` model needs a shardformer policy (one that replaces nothing).

    torchrun --nproc_per_node=2 scenarios/colossalai/repro_moe_zero_norm.py [--model block] [--ep 1] [--with-fix]
    (2 or 4 ranks; --ep defaults to the world size)
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import platform
import sys
import textwrap
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

# -- the proposed fix, applied at run time ------------------------------------------------------------

STEP_OLD = """\
            norm_group = 0
            for grad_store in self.pg_to_grad_store.values():
                working_grads = grad_store.get_working_grads_by_group_id(group_id)
                norm_group += self._compute_grad_norm(dp_pg=grad_store.torch_pg, gradients=working_grads)

            norm_groups.append(norm_group)
"""
STEP_NEW = """\
            norm_group = 0.0  # the stores hold disjoint parameters: their norms add in squares
            for grad_store in self.pg_to_grad_store.values():
                working_grads = grad_store.get_working_grads_by_group_id(group_id)
                norm_group += self._compute_grad_norm(dp_pg=grad_store.torch_pg, gradients=working_grads) ** 2

            norm_groups.append(norm_group**0.5)
"""


def fix_linear_sum() -> None:
    """low_level_optim.py l.572-577: step() adds the stores' norms in squares (STEP_OLD -> STEP_NEW)."""
    from colossalai.zero.low_level import low_level_optim

    source = textwrap.dedent(inspect.getsource(low_level_optim.LowLevelZeroOptimizer.step))
    old, new = textwrap.dedent(STEP_OLD), textwrap.dedent(STEP_NEW)
    indent = "        "  # the loop body inside `def step` once dedented
    old = textwrap.indent(old, indent).replace(indent + "\n", "\n")
    new = textwrap.indent(new, indent).replace(indent + "\n", "\n")
    assert source.count(old) == 1, "LowLevelZeroOptimizer.step is not the 0.5.0 code this fix is for"
    scope: dict[str, Any] = {}
    exec(compile(source.replace(old, new), low_level_optim.__file__, "exec"), vars(low_level_optim), scope)
    low_level_optim.LowLevelZeroOptimizer.step = scope["step"]


def fix_ep_reduction() -> None:
    """moe_hybrid_parallel_plugin.py: the MoE store's norm is reduced over EP as well (over moe_dp, tp and
    pp it already is), with the EP group the MoE parameters carry (``set_moe_tensor_ep_group``)."""
    from colossalai.accelerator import get_accelerator
    from colossalai.booster.plugin.hybrid_parallel_plugin import HybridParallelZeroOptimizer
    from colossalai.booster.plugin.moe_hybrid_parallel_plugin import MoeHybridParallelZeroOptimizer
    from colossalai.tensor.moe_tensor.api import is_moe_tensor

    init = MoeHybridParallelZeroOptimizer.__init__

    def __init__(self: Any, optimizer: Any, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        moe_dp_group = inspect.signature(init).bind(self, optimizer, model, *args, **kwargs).arguments["moe_dp_group"]
        self.moe_dp_pg = moe_dp_group
        self.ep_pg = next((getattr(p, "ep_group") for p in model.parameters() if is_moe_tensor(p)), None)
        init(self, optimizer, model, *args, **kwargs)

    def _compute_grad_norm(self: Any, dp_pg: Any, gradients: list, norm_type: float = 2) -> float:
        norm = HybridParallelZeroOptimizer._compute_grad_norm(self, dp_pg, gradients, norm_type)
        if dp_pg is not self.moe_dp_pg or self.ep_pg is None or dist.get_world_size(self.ep_pg) == 1:
            return norm
        norm_type = float(norm_type)
        total = torch.tensor([norm if norm_type == math.inf else norm**norm_type], dtype=torch.float64,
                             device=get_accelerator().get_current_device())
        dist.all_reduce(total, op=dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM, group=self.ep_pg)
        return float(total.item()) if norm_type == math.inf else float(total.item()) ** (1.0 / norm_type)

    MoeHybridParallelZeroOptimizer.__init__ = __init__
    MoeHybridParallelZeroOptimizer._compute_grad_norm = _compute_grad_norm


# -- CPU shims -----------------------------------------------------------------------------------------

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


# -- the two models ------------------------------------------------------------------------------------

EXPERTS = 4


class MoEBlock(nn.Module):
    """A dense Linear, then the sum of this EP rank's experts (of EXPERTS, each initialized from its global
    index, so that ep=1 and ep=k are the same parameters)."""

    def __init__(self, ep: int, ep_rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(16, 16)
        held = range(ep_rank * EXPERTS // ep, (ep_rank + 1) * EXPERTS // ep)
        experts = [nn.Linear(16, 16, bias=False) for _ in held]
        for expert, index in zip(experts, held):
            nn.init.normal_(expert.weight, generator=torch.Generator().manual_seed(1000 + index))
        self.experts = nn.ModuleList(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense(x)
        return sum((expert(h) for expert in self.experts), torch.zeros_like(h))


class Frozen(torch.optim.SGD):  # the parameters stay as they are; ZeRO still reduces, measures and clips
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


def block_step(plugin: Any, rank: int) -> tuple[Any, Any]:
    from colossalai.booster import Booster
    from colossalai.tensor.moe_tensor.api import set_moe_tensor_ep_group

    booster = Booster(plugin=plugin)
    model = MoEBlock(plugin.ep_size, dist.get_rank(plugin.ep_group))
    for p in model.experts.parameters():
        set_moe_tensor_ep_group(p, plugin.ep_group)
    model, optimizer, *_ = booster.boost(model, Frozen(model.parameters(), lr=0.0))
    x = torch.randn(8, 16, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1 + rank))
    booster.backward(model(x).float().square().mean(), optimizer)
    return model, optimizer


def mixtral_step(plugin: Any, rank: int) -> tuple[Any, Any]:
    import transformers
    from colossalai.booster import Booster
    from colossalai.lazy import LazyInitContext
    from transformers import AutoModelForCausalLM, MixtralConfig

    if int(transformers.__version__.split(".")[0]) >= 5:
        sys.exit(f"--model mixtral needs the transformers of ColossalAI 0.5.0's requirements (4.51.3); found "
                 f"{transformers.__version__}: install transformers==4.51.3 or run --model block")
    booster = Booster(plugin=plugin)
    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                           num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)  # every rank the same weights (lora_finetune.py loads them from a checkpoint)
    with LazyInitContext(default_device=torch.device("cpu")):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", torch_dtype=torch.bfloat16)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.set_default_dtype(torch.bfloat16)
    model, optimizer, *_ = booster.boost(model=model, optimizer=optimizer)
    torch.set_default_dtype(torch.float)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(100 + rank))
    booster.backward(model(input_ids=ids, labels=ids).loss, optimizer)
    return model, optimizer


# -- the run -------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("mixtral", "block"), default="mixtral")
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: the world size)")
    parser.add_argument("--fix", choices=("none", "linear", "ep", "both"), default="none")
    parser.add_argument("--with-fix", action="store_const", const="both", dest="fix", help="--fix both")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ep = args.ep or world
    _cpu_as_cuda()
    if args.fix in ("linear", "both"):
        fix_linear_sum()
    if args.fix in ("ep", "both"):
        fix_ep_reduction()
    from colossalai.booster.plugin.hybrid_parallel_plugin import HybridParallelZeroOptimizer
    from colossalai.booster.plugin.moe_hybrid_parallel_plugin import MoeHybridParallelPlugin
    from colossalai.tensor.moe_tensor.api import is_moe_tensor

    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=ep, zero_stage=1, precision="bf16", max_norm=1.0,
                                     enable_fused_normalization=False, enable_flash_attention=False,
                                     custom_policy=_no_shard_policy() if args.model == "block" else None)
    model, optimizer = (block_step if args.model == "block" else mixtral_step)(plugin, rank)

    # the control: the gradients ZeRO holds (gathered from its partitions), each counted once, in float64
    dense: list[torch.Tensor] = []
    experts: list[torch.Tensor] = []
    for p in model.unwrap().parameters():
        grad = optimizer.get_param_grad(p) if p.requires_grad else None  # a collective over p's store
        if grad is not None:
            (experts if is_moe_tensor(p) else dense).append(grad.detach().double().flatten())
    mine = {"ep_rank": dist.get_rank(plugin.ep_group), "dense": torch.cat(dense),
            "experts": torch.cat(experts) if experts else torch.zeros(0, dtype=torch.float64)}
    held: list[Any] = [None] * world
    dist.all_gather_object(held, mine)
    assert all(torch.equal(h["dense"], held[0]["dense"]) for h in held), "dense gradients differ across ranks"
    by_ep: dict[int, torch.Tensor] = {}
    for h in held:  # one copy of each EP rank's experts (its moe_dp replicas must hold the same)
        assert torch.equal(by_ep.setdefault(h["ep_rank"], h["experts"]), h["experts"]), "expert replicas differ"
    true = math.sqrt(float(held[0]["dense"].square().sum()) + sum(float(e.square().sum()) for e in by_ep.values()))

    # ColossalAI's per-store norms, as step() gets them from _compute_grad_norm (before any fix's EP reduction)
    stores: dict[str, float] = {}
    compute = HybridParallelZeroOptimizer._compute_grad_norm

    def record(self: Any, dp_pg: Any, gradients: list, norm_type: float = 2) -> float:
        norm = compute(self, dp_pg, gradients, norm_type)
        single = dp_pg is plugin.mixed_dp_group and dp_pg is plugin.moe_dp_group
        stores["all" if single else "experts" if dp_pg is plugin.moe_dp_group else "dense"] = norm
        return norm

    HybridParallelZeroOptimizer._compute_grad_norm = record
    optimizer.step()
    HybridParallelZeroOptimizer._compute_grad_norm = compute
    reported = float(optimizer.get_grad_norm())
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, (mine["ep_rank"], stores, reported))
    dist.barrier()
    if rank == 0:
        import importlib.metadata

        versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in ("colossalai", "torch", "transformers"))
        print(f"{versions}, python {platform.python_version()}; model={args.model} world={world} ep={ep} "
              f"moe_dp={world // ep} fix={args.fix}")
        print("ColossalAI's store norms (_compute_grad_norm, as step() got them) and what step() reported:")
        for r, (ep_rank, norms, got) in enumerate(rows):
            parts = "  ".join(f"||{name}|| {value:.6f}" for name, value in norms.items())
            print(f"rank {r} (ep rank {ep_rank}): {parts}  reported {got:.6f}")
        if ep > 1:
            d = rows[0][1]["dense"]
            e = {ep_rank: norms["experts"] for ep_rank, norms, _ in rows}  # one per EP rank
            e_all = math.sqrt(sum(v * v for v in e.values()))
            print(f"from the store norms: sqrt(dense^2 + sum over ep ranks experts^2) = {math.hypot(d, e_all):.6f}; "
                  f"the gathered gradients give {true:.6f}")
            for r, (ep_rank, _, got) in enumerate(rows):
                own = e[ep_rank]
                print(f"rank {r}: as shipped dense + own = {d + own:.6f}; squares fixed only (own experts) "
                      f"{math.hypot(d, own):.6f}; EP fixed only (dense + all experts) {d + e_all:.6f}; "
                      f"both {math.hypot(d, e_all):.6f}")
        print(f"reported={reported:.6f} true={true:.6f} ratio={reported / true:.6f}")
    dist.barrier()  # every rank done with its collectives before any tears its groups down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
