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
  the ``ep_fsdp`` (HSDP: ``(ep_replicate, ep_fsdp)``) mesh with ``Shard(1)`` and a gradient divide
  factor of the world size, of the decoder layer and the root on the dense FSDP mesh, the ``to_empty``
  materialization and the model's ``init_weights``;
* ``build_optimizer`` builds VeOmni's optimizer, and with it ``_extra_parallel_param_groups`` and the
  ``_ep_replicated_lora_param_ids`` sidecar (the MRO class-name scan) that the clip reads.

**VeOmni acts on gradients between the backward and the clip**: FSDP2's reduce-scatter (sum over the
shard group, an all-reduce over an HSDP replicate axis, then its divide factor: the FSDP mesh size for
the dense units, the world size VeOmni sets on the experts) and, with a shared MoE LoRA, the
post-accumulate-grad hook ``LoraSharedExperts`` installs at its first forward
(``_ensure_ep_grad_sync_hooks``), which SUMs each shared factor's gradient over the EP group. So the
gradients are not written into ``.grad``: the ``backward`` step produces them through that path. Each
module of the parallelized model gets a forward linear in its own parameters
(``harness.targets.gradient_path``), the experts wrapper's forward first running
``_ensure_ep_grad_sync_hooks`` as its real forward does (the rest of that forward, the MoE compute,
makes activations only; under EP its eager path refuses to run on CPU), and one forward/backward
through the root runs FSDP2's hooks (unshard, reduce-scatter, divide) and VeOmni's EP SUM hook. Each
parameter's direction is this rank's target gradient times the divide factor of its FSDP unit, in this
rank's own shard, on the first replica only, and, for a shared LoRA factor, on EP rank 0 only (the SUM
hook then copies it to every EP rank): what arrives is bit for bit the layout's gradient, which the
runner checks. The layout whose gradients that hook would never leave as they are (``shared-lora
differing``) is synthetic (the scenario says why) and gets its gradients injected after the setup.

Mixed precision is off (the gradients are in the case's dtype). Two harness-side touches on VeOmni's
objects: its process groups get the case timeout, as the harness's own target groups do, so a hung
collective ends the case instead of the run; and on gloo, which has no ``PREMUL_SUM`` (FSDP2's
reduce-scatter op for a divide factor other than the group's size: VeOmni's experts on an ``ep_fsdp``
group of 2 or more), those FSDP units reduce with a plain SUM and divide afterwards (FSDP2's own
``set_force_sum_reduction_for_comms``, what it always does on MTIA): the same gradients, as the runner's
bit-for-bit check confirms. Nothing in VeOmni hard-codes CUDA on these paths
(``get_device_type()`` answers ``cpu`` without an accelerator), so there is no shim.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Mapping, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from harness.cases.context import CaseContext
from harness.cases.model import parameter_values
from harness.targets.gradient_path import (fsdp_divide_factors, install_linear_forwards, reduced_to,
                                           sum_then_divide_on_gloo)
from harness.cases.target import Finding, Target, synthetic
from harness.targets.target import torch_max_drops_nan

from .framework import FRAMEWORK as VEOMNI
from .scenario import BASE, EXPERTS, HIDDEN, INTERMEDIATE, LORA_RANK, NUM_EXPERTS, Q_OUT, VeomniSetup


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
    """VeOmni's parallel state for this topology, built by VeOmni once per generation of process groups
    and made current; VeOmni's own cache of states is cleared when the generation ends (it holds their
    meshes, and so their groups)."""
    parallel_state = _veomni("distributed.parallel_state")

    def build() -> Any:
        state = parallel_state.init_parallel_state(
            dp_size=setup.dp_replicate * setup.dp_shard, dp_replicate_size=setup.dp_replicate,
            dp_shard_size=setup.dp_shard, extra_parallel_sizes=(setup.ep,), dp_mode="fsdp2",
            device_type=ctx.device.type, name=None,
        )
        ctx.give_case_timeout(state.device_mesh, *state.extra_parallel_fsdp_device_mesh.values())
        return state

    ctx.at_generation_end(parallel_state.clear_parallel_state)
    state = ctx.per_generation(("veomni-parallel-state", setup.dp_replicate, setup.dp_shard, setup.ep), build)
    parallel_state.set_parallel_state(state)
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


def backward(model: nn.Module, ctx: CaseContext, grads: Mapping[str, torch.Tensor | None]) -> None:
    """One forward/backward through the model VeOmni parallelized: FSDP2's reduce-scatter and divide
    factor, and the EP SUM hook of ``LoraSharedExperts`` (installed by its forward), deliver ``grads``."""
    state = _veomni("distributed.parallel_state").get_parallel_state()
    is_shared = _veomni("lora.moe_layers").is_lora_shared_experts
    ep_rank = dist.get_rank(state.ep_group) if state.ep_enabled else 0
    named, factors = dict(model.named_parameters()), fsdp_divide_factors(model)
    summed_over_ep = {f"{path}.{name}" for path, module in model.named_modules() if is_shared(module)
                      for name, p in module.named_parameters() if p.requires_grad}
    directions = {}
    for name, target in grads.items():
        if target is None:
            raise RuntimeError(f"{name}: VeOmni's backward gives every trainable parameter a gradient on every "
                               "rank; this layout has none here")
        param = cast(DTensor, named[name])  # every parameter is in an FSDP2 unit
        direction = reduced_to(param, target, factors[id(param)])
        directions[name] = direction if name not in summed_over_ep or ep_rank == 0 else torch.zeros_like(direction)
    sum_then_divide_on_gloo(model)  # no PREMUL_SUM on gloo: FSDP2 sums, then divides
    install_linear_forwards(model, directions)
    for module in model.modules():
        if is_shared(module):  # its real forward's first step: the EP SUM hooks on the shared factors
            setattr(module, "forward", _hooks_then(module, module.forward))
    model().backward()


def _hooks_then(experts: nn.Module, linear: Any) -> Any:
    """The experts wrapper's forward: what ``LoraSharedExperts.forward`` runs first (the EP SUM hooks),
    then the linear loss in place of its MoE compute."""
    def forward() -> torch.Tensor:
        getattr(experts, "_ensure_ep_grad_sync_hooks")()
        return linear()
    return forward


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> float:
    """veomni.distributed.clip_grad_norm.veomni_clip_grad_norm (fsdp2: its EP-aware path when EP is on)."""
    return float(_veomni("distributed.clip_grad_norm").veomni_clip_grad_norm(model, max_norm, norm_type))


TARGETS = (
    Target("veomni", clip,
           "VeOmni's veomni_clip_grad_norm on a model VeOmni parallelized (EP, FSDP2/HSDP, MoE LoRA)",
           origin="adapter veomni", scenarios=("veomni_ep",), requires=VEOMNI, dress=dress, backward=backward,
           findings=(
               Finding("*shared-lora differing*", None,
                       "VeOmni's clip skips the EP reduction for its LoraSharedExperts bucket, which is right "
                       "because its post-accumulate-grad hook has made those gradients identical on every EP rank; "
                       "gradients that differ per EP rank (written into .grad after the backward, no hook) make each "
                       "EP rank clip by its own norm",
                       synthetic("VeOmni's post-accumulate-grad hook (LoraSharedExperts._ensure_ep_grad_sync_hooks, "
                                 "installed at the wrapper's first forward) SUMs the shared factors' gradients over EP "
                                 "in every backward, so no training path hands the clip differing ones")),
               torch_max_drops_nan("*experts nan*"),)),
)
