"""VeOmni: ``veomni.distributed.clip_grad_norm.veomni_clip_grad_norm`` (the trainers' entry point, which
calls ``veomni.distributed.fsdp2.clip_grad_norm.clip_grad_norm``), on a model parallelized by VeOmni
itself, on the ``veomni_ep`` scenario's layouts.

Setup per case (``dress``), the sequence VeOmni's trainer runs, with VeOmni's functions:

* ``init_parallel_state(dp_size, dp_replicate_size, dp_shard_size, extra_parallel_sizes=(ep,))`` builds
  VeOmni's own device meshes (``init_device_mesh`` on the world's device type: gloo groups on CPU) and
  ``set_parallel_state`` makes it current. VeOmni caches states by topology; the cache is cleared when
  the harness starts a new generation of process groups, so no state outlives its groups.
* a Qwen3-MoE-shaped decoder layer (attention ``q_proj``, ``input_layernorm``, router ``gate`` and a
  v5 fused experts module: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) replaces the harness's
  synthetic module tree, at *global* shapes; with ``shared_lora`` the experts are wrapped by VeOmni's
  ``apply_shared_moe_lora`` (``LoraSharedExperts``; dense weights stay trainable);
* VeOmni's real Qwen3-MoE EP plan (``veomni.models.transformers.qwen3_moe.parallel_plan``) is the
  model's ``get_parallel_plan``, and ``parallelize_model_fsdp2`` does the rest: the runtime plan
  rewrite for the LoRA wrapper, ``ParallelPlan.apply`` (EP slicing), ``fully_shard`` of the experts on
  the ``ep_fsdp`` (HSDP: ``(ep_replicate, ep_fsdp)``) mesh with ``Shard(1)``, of the decoder layer and the
  root on the dense FSDP mesh, the ``to_empty`` materialization and the model's ``init_weights``;
* ``build_optimizer`` builds VeOmni's optimizer, and with it ``_extra_parallel_param_groups`` and the
  ``_ep_replicated_lora_param_ids`` sidecar (the MRO class-name scan) that the clip reads.

Mixed precision is off (the harness injects gradients in the case's dtype) and there is no backward:
the harness injects the gradients (as DTensors with FSDP's placements) after the setup. The one
harness-side touch on VeOmni's objects: its process groups get the case timeout, as the harness's own
target groups do, so a hung collective ends the case instead of the run. Nothing in VeOmni hard-codes
CUDA on these paths (``get_device_type()`` answers ``cpu`` without an accelerator), so there is no shim.
"""

from __future__ import annotations

import datetime
import importlib
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.spec.context import CaseContext
from harness.spec.model import parameter_values
from harness.targets.target import Finding, Target, synthetic, torch_max_drops_nan

from .framework import FRAMEWORK as VEOMNI
from .scenario import BASE, EXPERTS, HIDDEN, INTERMEDIATE, LORA_RANK, NUM_EXPERTS, Q_OUT, VeomniSetup

_SEEN_WORLD: list[Any] = [None]  # the default process group VeOmni's cached states were built in


class VeomniToyExperts(nn.Module):
    """The v5 fused MoE experts layout ``LoraSharedExperts`` wraps (Qwen3-MoE on transformers >= 5)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = NUM_EXPERTS, HIDDEN, INTERMEDIATE
        self.act_fn = nn.SiLU()
        for name, shape in BASE.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))


class VeomniToyMoE(nn.Module):
    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, NUM_EXPERTS, bias=False, dtype=dtype, device=device)
        self.experts = VeomniToyExperts(dtype, device)


class VeomniToyNorm(nn.Module):
    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(HIDDEN, dtype=dtype, device=device))


class VeomniToyAttention(nn.Module):
    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, Q_OUT, bias=False, dtype=dtype, device=device)


class VeomniToyDecoderLayer(nn.Module):
    """The unit VeOmni FSDP-wraps (the model's ``_no_split_modules``)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.self_attn = VeomniToyAttention(dtype, device)
        self.input_layernorm = VeomniToyNorm(dtype, device)
        self.mlp = VeomniToyMoE(dtype, device)


class VeomniToyBody(nn.Module):
    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.layers = nn.ModuleList([VeomniToyDecoderLayer(dtype, device)])


def _veomni(module: str) -> Any:
    """A VeOmni module, imported at run time (VeOmni ships no type information)."""
    return importlib.import_module(f"veomni.{module}")


def _quiet() -> None:
    """VeOmni logs every step of its setup at INFO on every case (and warns that a parallel state
    exists, which the adapter replaces on purpose): errors only, unless the user set a level."""
    os.environ.setdefault("VEOMNI_VERBOSITY", "ERROR")


def _parallel_state(ctx: CaseContext, setup: VeomniSetup) -> Any:
    parallel_state = _veomni("distributed.parallel_state")
    if _SEEN_WORLD[0] is not dist.group.WORLD:  # a new generation of groups: VeOmni's cached meshes are dead
        parallel_state.clear_parallel_state()
        _SEEN_WORLD[0] = dist.group.WORLD
    state = parallel_state.init_parallel_state(
        dp_size=setup.dp_replicate * setup.dp_shard, dp_replicate_size=setup.dp_replicate,
        dp_shard_size=setup.dp_shard, extra_parallel_sizes=(setup.ep,), dp_mode="fsdp2",
        device_type=ctx.device.type, name=None,
    )
    parallel_state.set_parallel_state(state)
    if ctx.world is not None:
        timeout = datetime.timedelta(seconds=ctx.world.timeout_s)
        meshes = [state.device_mesh] + [m for m in state.extra_parallel_fsdp_device_mesh.values() if m is not None]
        for mesh in meshes:
            for group in mesh.get_all_groups():
                dist.distributed_c10d._set_pg_timeout(timeout, group)
    return state


def dress(model: nn.Module, ctx: CaseContext) -> None:
    _quiet()
    setup = ctx.case.variant.info_as(VeomniSetup)
    _parallel_state(ctx, setup)
    dtype = ctx.case.injection.torch_dtype
    model.add_module("model", VeomniToyBody(dtype, ctx.device))  # the harness's synthetic tree, replaced
    if setup.shared_lora:
        # VeOmni's Mode-2 MoE LoRA; the wrapper freezes its own base experts, the dense weights stay trainable
        _veomni("lora.moe_layers").apply_shared_moe_lora(
            model, [EXPERTS + name for name in BASE], r=LORA_RANK, lora_alpha=2 * LORA_RANK, freeze_base_model=False)
    # what VeOmni reads from a transformers model: its FSDP units and its parallel plan (Qwen3-MoE's)
    setattr(model, "_no_split_modules", [VeomniToyDecoderLayer.__name__])
    setattr(model, "get_parallel_plan", _veomni("models.transformers.qwen3_moe.parallel_plan").get_parallel_plan)

    def init_weights() -> None:  # called by VeOmni after to_empty(): the harness's parameter values
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_(parameter_values(tuple(local.shape), local.dtype, local.device))

    setattr(model, "init_weights", init_weights)
    no_mixed_precision = _veomni("arguments").MixedPrecisionConfig(enable=False)
    _veomni("distributed.torch_parallelize").parallelize_model_fsdp2(
        model, mixed_precision=no_mixed_precision, init_device="meta")
    ctx.extras["optimizer"] = _veomni("optim.optimizer").build_optimizer(model, lr=1e-3, weight_decay=0.0)


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> float:
    """veomni.distributed.clip_grad_norm.veomni_clip_grad_norm (fsdp2: its EP-aware path when EP is on)."""
    return float(_veomni("distributed.clip_grad_norm").veomni_clip_grad_norm(model, max_norm, norm_type))


TARGETS = (
    Target("veomni", clip,
           "VeOmni's veomni_clip_grad_norm on a model VeOmni parallelized (EP, FSDP2/HSDP, MoE LoRA)",
           origin="adapter veomni", scenarios=("veomni_ep",), requires=VEOMNI, dress=dress,
           findings=(
               Finding("*shared-lora differing*", None,
                       "VeOmni skips the EP reduction for its LoraSharedExperts bucket, right only while its post-accumulate hook has made those gradients identical on every EP rank; otherwise each EP rank clips by its own norm: report to ByteDance-Seed/VeOmni (check or reduce instead of assuming) with: clipcheck run --nproc 2 --scenario veomni_ep --target veomni --variant 'shared-lora differing' --norm-type 2",
                       synthetic("VeOmni's post-accumulate-grad hook sums the LoraSharedExperts gradients over EP "
                                 "in every real backward, so they are identical on every EP rank")),
               torch_max_drops_nan("*experts nan*"),)),
)
