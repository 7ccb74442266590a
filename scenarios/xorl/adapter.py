"""xorl: its own ``clip_grad_norm`` on a model xorl itself built and parallelized, in the order and at
the shapes its trainer uses (``xorl.trainers.model_builder.build_training_model``, shared by the offline
Trainer and the server's ModelRunner), on the ``xorl_ep_lora`` scenario's layouts.

Setup per case (``dress``), with xorl's functions:

* ``init_parallel_state(dp_size=world, dp_shard_size=world, ep_size=ep, dp_mode="fsdp2")`` builds xorl's
  own meshes (gloo groups on CPU), with ``ep_intranode=False`` (its ``train.ep_intranode`` option) so
  that its ``(ep, ep_fsdp)`` mesh is row-major like the scenario's; the default packs EP groups on
  consecutive ranks instead, which moves ranks, not arithmetic. States are cached by topology and
  dropped when the harness starts a new generation of process groups.
* the model on the meta device at *global* shapes: a decoder layer (the FSDP unit named in
  ``_no_split_modules``) holding xorl's real ``MoEBlock`` (router ``gate`` and ``MoEExperts
  [E, H, 2I] / [E, I, H]``), in the case's dtype;
* LoRA injected by the functions the builder's ``_inject_lora`` calls (``inject_lora_into_model``,
  or ``inject_lora_into_model_with_moe`` with ``moe_hybrid_shared_lora``; ``_inject_lora`` itself
  ends by logging CUDA memory, which raises on CPU): ``MoEExpertsLoRA`` at global shape;
* ``build_parallelize_model(init_device="meta")`` with the variant's model folder's real
  ``get_ep_plan()``: ``ParallelPlan.apply`` slices the *listed* patterns to EP-local shape (an
  unlisted parameter keeps its global shape and gets the fallback ``Replicate``), ``fully_shard`` of
  the experts on ``ep_fsdp`` with ``Shard(1)``, of the layer and the root, gradient divide factor 1
  (a sum), ``to_empty`` + ``init_weights`` + ``reset_lora_parameters``, ``_build_ep_param_groups``;
* ``freeze_base_parameters`` (the builder's step 8): only the LoRA factors train.

Mixed precision is off (the gradients are in the case's dtype), as in the other adapters.

**xorl acts on gradients between the backward and the clip**: FSDP2's reduce-scatter over
``ep_fsdp`` (a sum: xorl sets the divide factor to 1), and the server's optimizer step runs
``synchronize_ep_replicated_gradients`` (a SUM over EP of the factors its plan marks ``EP_SUM``: the
hybrid-shared ones under a plan that lists them) just before ``clip_gradients``. So the ``backward``
step produces the gradients through that path: every module gets a forward linear in its own
parameters (``harness.targets.gradient_path``), one forward/backward through the root runs FSDP2's
hooks, and then xorl's ``synchronize_ep_replicated_gradients`` runs. Each parameter's direction is
this rank's target gradient times its unit's divide factor in this rank's own shard, and, for a
factor xorl sums over EP, on EP rank 0 only: what arrives is bit for bit the layout's gradient (the
runner checks it). On gloo, which has no ``PREMUL_SUM`` (FSDP2's op for a divide factor of 1 on a
group of 2 or more), those units sum with a plain SUM (FSDP2's ``set_force_sum_reduction_for_comms``).

Layouts xorl never builds are refused with the reason: every ``ep=1`` layout (xorl turns EP off at
``ep_size`` 1 and FSDP-shards the experts on dim 0 with their layer) and the ``minimax_m3
hybrid_shared=True`` ones (the seed's construction; see the scenario). xorl's process groups get the
case timeout, as the harness's own groups do.
"""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace
from typing import Any, Mapping, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from harness.cases.axes import MeshAxis
from harness.cases.context import CaseContext
from harness.cases.model import parameter_values
from harness.targets.gradient_path import (fsdp_divide_factors, install_linear_forwards, reduced_to,
                                           sum_then_divide_on_gloo)
from harness.cases.target import Finding, Target, stock

from .framework import FRAMEWORK as XORL
from .scenario import HIDDEN, INTERMEDIATE, RANK, XorlSetup

TOP_K = 2


class XorlToyDecoderLayer(nn.Module):
    """The FSDP unit xorl wraps (``_no_split_modules``), holding xorl's real ``MoEBlock``."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        block = importlib.import_module("xorl.models.layers.moe").MoEBlock
        self.mlp = block(hidden_size=HIDDEN, num_experts=experts, top_k=TOP_K, intermediate_size=INTERMEDIATE,
                         moe_implementation="native")


class XorlToyBody(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([XorlToyDecoderLayer(experts)])


def refuses(variant: Any) -> str | None:
    setup = variant.info_as(XorlSetup)
    if variant.ep_size == 1:
        return ("xorl turns EP off at ep_size 1 (ep_enabled is ep_size > 1): its experts are FSDP-sharded on dim 0 "
                "with their decoder layer, not this layout's (ep, ep_fsdp) Shard(1)")
    if setup.plan == "minimax_m3" and setup.hybrid_shared:
        return ("under minimax_m3's plan xorl never builds this hybrid_shared layout: the per-expert factors stay at "
                "global shape and the shared ones get the fallback Replicate without an EP sum")
    return None


def _parallel_state(ctx: CaseContext, ep: int) -> None:
    """xorl's parallel state for this world and EP size, built by xorl once per generation of process
    groups and made current; xorl's module global is reset when the generation ends (it holds the
    state's meshes, and so their groups)."""
    parallel_state = importlib.import_module("xorl.distributed.parallel_state")

    def build() -> Any:
        setattr(parallel_state, "_PARALLEL_STATE", None)
        parallel_state.init_parallel_state(dp_size=ctx.world_size, dp_shard_size=ctx.world_size, ep_size=ep,
                                           dp_mode="fsdp2", device_type=ctx.device.type, ep_intranode=False)
        state = parallel_state.get_parallel_state()
        ctx.give_case_timeout(state.device_mesh, state.ep_fsdp_device_mesh)
        return state

    state = ctx.per_generation(("xorl-parallel-state", ctx.world_size, ep), build)
    ctx.at_generation_end(_forget_parallel_state)
    setattr(parallel_state, "_PARALLEL_STATE", state)


def _forget_parallel_state() -> None:
    parallel_state = sys.modules.get("xorl.distributed.parallel_state")
    if parallel_state is not None:
        setattr(parallel_state, "_PARALLEL_STATE", None)


def dress(model: nn.Module, ctx: CaseContext) -> None:
    from xorl.distributed.torch_parallelize import build_parallelize_model
    from xorl.lora import freeze_base_parameters
    from xorl.lora.utils import inject_lora_into_model, inject_lora_into_model_with_moe

    setup = ctx.case.variant.info_as(XorlSetup)
    _parallel_state(ctx, ctx.group_size(MeshAxis.EP))
    with torch.device("meta"):
        body = XorlToyBody(setup.experts).to(ctx.case.injection.torch_dtype)
    model.add_module("model", body)  # the harness's synthetic tree, replaced
    plan = importlib.import_module(f"xorl.models.transformers.{setup.plan}.parallelize").get_ep_plan
    setattr(model, "config", SimpleNamespace(num_experts=setup.experts))
    setattr(model, "_no_split_modules", [XorlToyDecoderLayer.__name__])
    setattr(model, "get_parallel_plan", plan)

    def init_weights() -> None:  # called by xorl after to_empty(): the harness's parameter values
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                local.copy_(parameter_values(tuple(local.shape), local.dtype, local.device))

    setattr(model, "init_weights", init_weights)
    lora = dict(r=RANK, lora_alpha=2 * RANK, target_modules=["gate_proj", "up_proj", "down_proj"])
    if setup.hybrid_shared:  # _inject_lora's MoE-aware branch
        inject_lora_into_model_with_moe(model, moe_hybrid_shared_lora=True, **lora)
    else:
        inject_lora_into_model(model, **lora)
    build_parallelize_model(model, init_device="meta", weights_path=None, enable_mixed_precision=False,
                            enable_gradient_checkpointing=False, basic_modules=[XorlToyDecoderLayer.__name__])
    freeze_base_parameters(model)


def backward(model: nn.Module, ctx: CaseContext, grads: Mapping[str, torch.Tensor | None]) -> None:
    """One forward/backward through the model xorl parallelized (FSDP2's reduce-scatter), then the EP
    sum of ``synchronize_ep_replicated_gradients`` the server runs before its clip."""
    from xorl.distributed.ep_gradients import synchronize_ep_replicated_gradients
    from xorl.distributed.parallel_state import get_parallel_state

    ep_rank = get_parallel_state().ep_rank
    summed_over_ep = {id(p) for p in getattr(model, "_ep_param_groups")["ep_replicated_gradient_sync"]}
    named, factors = dict(model.named_parameters()), fsdp_divide_factors(model)
    directions = {}
    for name, target in grads.items():
        if target is None:
            raise RuntimeError(f"{name}: xorl's backward gives every LoRA factor a gradient on every rank; this "
                               "layout has none here")
        param = cast(DTensor, named[name])  # every factor is in the experts' FSDP2 unit
        direction = reduced_to(param, target, factors[id(param)])
        directions[name] = direction if id(param) not in summed_over_ep or ep_rank == 0 else torch.zeros_like(direction)
    sum_then_divide_on_gloo(model)
    install_linear_forwards(model, directions)
    model().backward()
    synchronize_ep_replicated_gradients(model)


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """xorl.distributed.fsdp2.clip_grad_norm.clip_grad_norm (its EP-aware path; the model's
    ``clip_grad_norm_`` that xorl's ``clip_gradients`` calls)."""
    from xorl.distributed.fsdp2.clip_grad_norm import clip_grad_norm

    return clip_grad_norm(model, max_norm=max_norm, norm_type=norm_type)


TARGETS = (
    Target("xorl", clip, "xorl's clip_grad_norm on a model xorl built and parallelized (MoEExpertsLoRA, its EP plan)",
           origin="adapter xorl", scenarios=("xorl_ep_lora",), requires=XORL, dress=dress, backward=backward,
           refuses=refuses,
           findings=(
               Finding("*plan=minimax_m3 hybrid_shared=False*", "togethercomputer/xorl (the motivating seed report)",
                       "minimax_m3's ep_plan lists no LoRA factor: they keep their global shape, get the fallback "
                       "Replicate, and the clip takes the per-EP-rank gradients for replicas (sum over ep / ep): "
                       "1/sqrt(ep)",
                       stock("minimax_m3 MoE LoRA training with expert parallelism: lora.enable_lora with "
                             "lora.lora_target_modules naming gate_proj/up_proj/down_proj (minimax_m3's default "
                             "targets are attention only), train.expert_parallel_size > 1 and "
                             "model.moe_implementation eager (native and triton stop at the first forward on the "
                             "global-shape factors)"),
                       norms=("L2",), repro="scenarios/xorl/repro_ep_lora_undercount.py"),)),
)
