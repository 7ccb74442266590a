"""xorl: its own ``clip_grad_norm`` over its own MoE LoRA module, EP plan and parameter groups, on the
``xorl_ep_lora`` scenario's layouts.

Setup per case (``dress``), the sequence xorl's ``parallelize`` runs, with xorl's functions:
* the scenario's expert block is replaced by a real ``MoEExpertsLoRA`` built at EP-local shape
  (``num_local_experts = E / ep_size``), with the scenario's ``hybrid_shared`` setting;
* the real EP plan of the variant's model (``qwen3_moe`` or ``minimax_m3``, ``get_ep_plan()``) is
  applied with ``ParallelPlan.apply(..., already_local=True)``;
* the expert module is wrapped by ``fully_shard`` on the ``ep_fsdp`` sub-mesh with ``Shard(1)``;
* ``_build_ep_param_groups`` builds the groups the clip reads.
xorl reads its process groups from a parallel-state singleton; the adapter installs one holding the
case's mesh and groups (the attributes its EP clip path reads), fresh for every case.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from harness.spec.axes import MeshAxis
from harness.spec.context import CaseContext
from harness.targets.target import Finding, Target, stock

from .framework import FRAMEWORK as XORL
from .scenario import XorlSetup

EXPERTS_PATH = "model.layers.0.mlp"


def dress(model: nn.Module, ctx: CaseContext) -> None:
    import xorl.distributed.parallel_state as parallel_state
    from xorl.distributed.torch_parallelize import _build_ep_param_groups
    from xorl.models.layers.moe.lora import MoEExpertsLoRA, MoELoRAConfig

    setup = ctx.case.variant.info_as(XorlSetup)
    ep = ctx.group_size(MeshAxis.EP)
    prefix = f"{EXPERTS_PATH}.experts."
    experts_count, hidden, _ = ctx.layout.param(prefix + "gate_up_proj").shape
    intermediate = ctx.layout.param(prefix + "down_proj").shape[1]
    rank = ctx.layout.param(prefix + "gate_proj_lora_B").shape[1]
    parallel_state._PARALLEL_STATE = SimpleNamespace(
        ep_enabled=True, ep_size=ep, ep_group=ctx.group(MeshAxis.EP), ep_fsdp_device_mesh=ctx.mesh,
        fsdp_group=None, tp_enabled=False, tp_group=None,
    )
    experts = MoEExpertsLoRA(
        num_experts=experts_count,
        hidden_dim=hidden,
        intermediate_size=intermediate,
        moe_implementation="native",
        lora_config=MoELoRAConfig(r=rank, lora_alpha=2 * rank, hybrid_shared=setup.hybrid_shared,
                                  target_modules=["gate_proj", "up_proj", "down_proj"]),
        num_local_experts=experts_count // ep,
    ).to(dtype=ctx.case.injection.torch_dtype, device=ctx.device)
    model.get_submodule(EXPERTS_PATH).experts = experts
    plan = importlib.import_module(f"xorl.models.transformers.{setup.plan}.parallelize").get_ep_plan()
    model._fqn2spec_info = plan.apply(model, ctx.mesh, already_local=True)
    fully_shard(experts, mesh=ctx.mesh[MeshAxis.EP_FSDP], shard_placement_fn=lambda _p: Shard(1))
    _build_ep_param_groups(model)


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """xorl.distributed.fsdp2.clip_grad_norm.clip_grad_norm (its EP-aware path)."""
    from xorl.distributed.fsdp2.clip_grad_norm import clip_grad_norm

    return clip_grad_norm(model, max_norm=max_norm, norm_type=norm_type)


TARGETS = (
    Target("xorl", clip, "xorl's clip_grad_norm over its MoEExpertsLoRA, EP plan and parameter groups",
           origin="adapter xorl", scenarios=("xorl_ep_lora",), requires=XORL, dress=dress,
           findings=(
               Finding("*", "togethercomputer/xorl (the motivating seed report)",
                       "per-expert LoRA factors missing from the ep_plan: 1/sqrt(ep)",
                       stock("MoE LoRA training of minimax_m3 with ep_size > 1 (its ep_plan lists no LoRA "
                             "factor)")),)),
)
