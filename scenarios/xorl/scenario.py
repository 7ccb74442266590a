"""Per-expert MoE LoRA under expert parallelism, clipped the way xorl's plan-driven clip does it.

The story (seed report ``xorl-ep-lora-undercount``): the EP plan lists parameter patterns that are
sharded over ``ep``; every parameter it does not list gets a fallback ``Replicate()`` placement, and
the clip reads that placement as proof of EP replication. Such parameters go to an ``ep_replicated``
bucket whose p-th power sum is SUMmed over ``ep`` and divided by ``ep_world`` (a mean, right only for
true replicas). When the plan omits the per-expert LoRA factors, every rank holds *different*
gradients for them, and the norm comes out 1/sqrt(ep_size) too small.

Modelled here, in our own code (nothing of xorl's is used):

* the adapter at EP-local shapes: gate/up ``lora_A [E, H, r]``, ``lora_B [E, r, I]``, down
  ``lora_A [E, I, r]``, ``lora_B [E, r, H]``; with ``hybrid_shared`` the gate/up ``lora_A`` and down
  ``lora_B`` are one shared factor with leading dim 1, truly replicated over ``ep``. Frozen base
  weights ``gate_up_proj`` / ``down_proj`` sit beside them, as in the real module.
* mesh ``(ep, ep_fsdp)``; experts shard dim 0 over ``ep`` and FSDP shards dim 1 over ``ep_fsdp``.
* the plan application: a listed pattern is ``Shard(0)`` unless the parameter's local size on that
  dim is 1 (then ``Replicate``, the shared-factor rule); an unlisted parameter gets ``Replicate``.
* two plans: ``qwen3_moe`` lists the base weights and all six LoRA factors (the control);
  ``minimax_m3`` lists only the base weights.
* two clips: ``xorl-style`` (Replicate => ep_replicated) and ``xorl-style-fixed`` (the seed's fix:
  Replicate *and* a local leading dim of 1).

What real xorl builds (its trainer: the model at global shapes on meta, LoRA injected at global shape,
then ``ParallelPlan.apply`` slices the *listed* patterns to EP-local shape): under ``minimax_m3``'s
plan the per-expert factors are never sliced, so each EP rank holds a full ``[E, ...]`` copy whose
gradient is its own (its own experts' tokens; nothing sums them over EP). The ``minimax_m3
hybrid_shared=False`` layouts at ep > 1 are built that way (logical ``[ep * E, ...]``, ``Shard(0)`` on
``ep``): the seed's 1/sqrt(ep) is the same. The ``minimax_m3 hybrid_shared=True`` layouts keep the
seed's construction (per-expert factors at EP-local shape, shared factors identical over ``ep``), a
layout real xorl never builds (there its shared factors get the fallback ``Replicate`` without an EP
sum, so their gradients differ per EP rank too): the ``xorl`` target refuses them.

A further variant builds the adapter with one local expert per rank (``num_experts == ep_size``):
the per-expert factors then have local leading dim 1, so even the complete plan declares them
Replicate, and the seed's fix, which keys on the same leading dim, cannot tell them from shared ones.
That is the seed's construction order (the adapter built at EP-local shape); real xorl builds the
factors at global shape (leading dim ``ep_size``), its plan slices them (``Shard``), and its clip is
exact on that variant.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Iterable, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.cases.axes import MeshAxis
from harness.cases.variant import Variant
from harness.clipmath import (
    clip_coefficient,
    combine,
    is_inf_norm,
    local_tensor,
    pow_sum,
    reduce_op,
    root,
    scale_grads_,
    trainable_with_grads,
)
from harness.cases.context import context
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, Placement, Replicate, Shard, param
from harness.cases.scenario import Scenario, ScenarioOptions, ep_sizes_for
from harness.cases.target import Target

NUM_EXPERTS, HIDDEN, INTERMEDIATE, RANK = 8, 64, 128, 8
PREFIX = "model.layers.0.mlp.experts."
LORA_FACTORS = (
    "gate_proj_lora_A", "gate_proj_lora_B",
    "up_proj_lora_A", "up_proj_lora_B",
    "down_proj_lora_A", "down_proj_lora_B",
)
SHARED_WHEN_HYBRID = ("gate_proj_lora_A", "up_proj_lora_A", "down_proj_lora_B")
BASE_WEIGHTS = ("gate_up_proj", "down_proj")

EP_PLANS: dict[str, tuple[str, ...]] = {
    "qwen3_moe": tuple(f"*.mlp.experts.{n}" for n in BASE_WEIGHTS + LORA_FACTORS),
    "minimax_m3": tuple(f"*.mlp.experts.{n}" for n in BASE_WEIGHTS),
}


@dataclass(frozen=True)
class XorlSetup:
    """What the xorl adapter builds for a variant: the model folder whose ``get_ep_plan()`` it applies
    (a key of ``EP_PLANS``), whether the LoRA factors are hybrid-shared, and the expert count."""

    plan: str
    hybrid_shared: bool
    experts: int


def _factor_shape(name: str, experts: int, hybrid_shared: bool) -> tuple[int, int, int]:
    lead = 1 if hybrid_shared and name in SHARED_WHEN_HYBRID else experts
    inner = {
        "gate_proj_lora_A": (HIDDEN, RANK), "gate_proj_lora_B": (RANK, INTERMEDIATE),
        "up_proj_lora_A": (HIDDEN, RANK), "up_proj_lora_B": (RANK, INTERMEDIATE),
        "down_proj_lora_A": (INTERMEDIATE, RANK), "down_proj_lora_B": (RANK, HIDDEN),
    }[name]
    return (lead, *inner)


def adapter_layout(ep_size: int, ep_fsdp: int, experts: int, hybrid_shared: bool,
                   unsliced_factors: bool = False) -> Layout:
    """The true layout: per-expert tensors Shard(0) on ep, shared ones Replicate; FSDP Shard(1).

    ``unsliced_factors``: the LoRA factors stay at global shape on every EP rank, each rank's gradient
    its own (xorl under a plan that does not list them): logical ``[ep * lead, ...]``, Shard(0) on ep."""
    mesh = MeshSpec.of(ep=ep_size, ep_fsdp=ep_fsdp)
    specs = [
        param(PREFIX + "gate_up_proj", (experts, HIDDEN, 2 * INTERMEDIATE), trainable=False,
              ep=Shard(0), ep_fsdp=Shard(1)),
        param(PREFIX + "down_proj", (experts, INTERMEDIATE, HIDDEN), trainable=False,
              ep=Shard(0), ep_fsdp=Shard(1)),
    ]
    for name in LORA_FACTORS:
        shape = _factor_shape(name, experts, hybrid_shared)
        if unsliced_factors:
            shape = (ep_size * shape[0], *shape[1:])
        on_ep = Replicate() if shape[0] == 1 else Shard(0)
        specs.append(param(PREFIX + name, shape, ep=on_ep, ep_fsdp=Shard(1)))
    return Layout(mesh, tuple(specs))


def plan_leaves_factors_unsliced(plan: str, hybrid_shared: bool, ep_size: int) -> bool:
    """Whether the variant's LoRA factors are the global-shape copies real xorl builds under ``plan``:
    its plan slices only the patterns it lists, and ``minimax_m3``'s lists no LoRA factor (the hybrid
    layouts keep the seed's construction, see the module docstring)."""
    lists_factors = all(any(fnmatch.fnmatchcase(PREFIX + n, p) for p in EP_PLANS[plan]) for n in LORA_FACTORS)
    return ep_size > 1 and not hybrid_shared and not lists_factors


def apply_ep_plan(layout: Layout, patterns: Iterable[str]) -> dict[str, dict[str, Placement]]:
    """Our model of a plan application with a fallback: what the framework *declares*.

    A parameter matching a pattern is Shard(0) on ep, except when its local size on dim 0 is 1 (read
    as a shared factor: Replicate); a parameter matching nothing gets the fallback Replicate.
    """
    patterns = tuple(patterns)
    declared: dict[str, dict[str, Placement]] = {}
    for spec in layout:
        if any(fnmatch.fnmatchcase(spec.name, pat) for pat in patterns):
            on_ep: Placement = Replicate() if layout.local_shape(spec)[0] == 1 else Shard(0)
        else:
            on_ep = Replicate()
        declared[spec.name] = {MeshAxis.EP: on_ep, MeshAxis.EP_FSDP: Shard(1)}
    return declared


class XorlEPLoRA(Scenario):
    name = "xorl_ep_lora"
    summary = "per-expert MoE LoRA at EP-local shapes with an xorl-style plan-driven clip"
    uses_ep = True
    default_targets = ("xorl-style", "xorl-style-fixed", "xorl", "reference")

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        injection = Injection(seed=options.seed, dtype=options.dtype)
        out = []
        for ep in ep_sizes_for(self.name, world_size, NUM_EXPERTS, options.ep_sizes):
            for plan in EP_PLANS:
                for hybrid in (False, True):
                    out.append(self._variant(ep, world_size, NUM_EXPERTS, plan, hybrid, injection))
        one_local = [ep for ep in ep_sizes_for(self.name, world_size, NUM_EXPERTS, options.ep_sizes) if ep > 1]
        if one_local and max(one_local) != NUM_EXPERTS:
            out.append(self._variant(max(one_local), world_size, max(one_local), "qwen3_moe", False, injection))
        return out

    def _variant(self, ep: int, world: int, experts: int, plan: str, hybrid: bool, injection: Injection) -> Variant:
        unsliced = plan_leaves_factors_unsliced(plan, hybrid, ep)
        layout = adapter_layout(ep, world // ep, experts, hybrid, unsliced_factors=unsliced)
        label = f"{layout.describe()} plan={plan} hybrid_shared={hybrid}"
        if experts != NUM_EXPERTS:
            label += f" experts={experts} (1 per ep rank)"
        return Variant(
            label=label,
            layout=layout,
            injection=injection,
            declared=apply_ep_plan(layout, EP_PLANS[plan]),
            # unsliced factors are another logical model at each ep (ep copies of the experts' factors)
            invariance_key=None if unsliced else f"xorl-lora-E{experts}-hybrid{hybrid}",
            ep_size=ep,
            info=XorlSetup(plan, hybrid, experts),
        )


# -- the clip under test: our model of xorl's EP-aware clip ----------------------------------------------
def _is_ep_replicated(placement: Placement, local: torch.Tensor, require_leading_one: bool) -> bool:
    replicated = isinstance(placement, Replicate)
    return replicated and (not require_leading_one or local.shape[0] == 1)


def _xorl_style(model: nn.Module, max_norm: float, norm_type: float, require_leading_one: bool) -> torch.Tensor:
    ctx = context(model)
    params = trainable_with_grads(model)
    sharded, replicated = 0.0, 0.0
    for name, p in params:
        assert p.grad is not None  # trainable_with_grads
        part = pow_sum(p.grad, norm_type)
        if _is_ep_replicated(ctx.declared_placement(name, MeshAxis.EP), local_tensor(p), require_leading_one):
            replicated = combine(replicated, part, norm_type)
        else:
            sharded = combine(sharded, part, norm_type)
    buckets = torch.tensor([sharded, replicated], dtype=torch.float64, device=ctx.device)
    for axis in (MeshAxis.EP_FSDP, MeshAxis.EP):
        dist.all_reduce(buckets, op=reduce_op(norm_type), group=ctx.group(axis))
    if not is_inf_norm(norm_type):
        buckets[1] /= ctx.group_size(MeshAxis.EP)  # the "replicated" bucket: summed over ep, then averaged
    total = root(combine(float(buckets[0]), float(buckets[1]), norm_type), norm_type)
    scale_grads_((p for _, p in params), clip_coefficient(max_norm, total))
    return torch.tensor(total, dtype=torch.float64)


def xorl_style_clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """xorl-style: a declared Replicate on ep puts the param in the ep_replicated bucket (÷ ep_world)."""
    return _xorl_style(model, max_norm, norm_type, require_leading_one=False)


def xorl_style_fixed_clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """The seed's fix: ep_replicated needs a declared Replicate *and* a local leading dim of 1."""
    return _xorl_style(model, max_norm, norm_type, require_leading_one=True)


XorlEPLoRA.targets = {
    t.name: t
    for t in (
        Target("xorl-style", xorl_style_clip, cast(str, xorl_style_clip.__doc__).strip(),
               origin="scenario xorl_ep_lora", scenarios=("xorl_ep_lora",)),
        Target("xorl-style-fixed", xorl_style_fixed_clip, cast(str, xorl_style_fixed_clip.__doc__).strip(),
               origin="scenario xorl_ep_lora", scenarios=("xorl_ep_lora",)),
    )
}

__all__ = ["XorlEPLoRA", "adapter_layout", "apply_ep_plan", "plan_leaves_factors_unsliced", "xorl_style_clip",
           "xorl_style_fixed_clip"]
