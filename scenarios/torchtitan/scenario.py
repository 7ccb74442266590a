"""A torchtitan MoE block as torchtitan 0.3.0 lays it out: dense parameters FSDP-sharded over every
rank, routed experts sharded over ``ep`` and FSDP-sharded over ``efsdp``, all DTensors.

Names follow torchtitan's module tree (``layers.<i>.moe.routed_experts.inner_experts.w1_EFD``), so
the adapter can hand the model to torchtitan's own ``apply_fsdp_to_decoder``; what that function
decides, the layouts follow: every parameter of ``inner_experts`` goes to the expert mesh, sharded on
dim 1 when ``efsdp * ep`` (the world here) exceeds the number of experts and on dim 0 otherwise
(``_StridedShard(0)`` under EP's ``Shard(0)``: each EP rank's experts cut again over ``efsdp``).

torchtitan's EP clip (``clip_grad_norm_(..., ep_enabled=True)``) splits parameters by whether their
DTensor mesh has an ``ep`` axis and lets DTensor placements do every reduction: exact when the
placements are honest, and only then. Layouts:

* ``honest``: every DTensor placement is the truth (the control). ``shared_lora_A``, a factor
  ``Replicate`` over ``ep`` inside the experts module, is not in any torchtitan model (its LoRA wraps
  ``Linear`` layers only): it is there for the next layout, and checks that a replicated sparse
  DTensor is counted once.
* ``placement lies`` (ep > 1, synthetic): ``shared_lora_A`` is declared ``Replicate`` on ``ep`` but its
  gradients differ from EP rank to EP rank (never synchronized); DTensor trusts the declaration and
  each rank counts only its own copy. No torchtitan configuration builds it (see ``LIES``).
* ``experts without ep dim`` (ep > 1): the experts are EP-local plain tensors FSDP-wrapped on the
  ``efsdp`` mesh alone, as VeOmni and xorl wrap them; torchtitan's own parallelize always puts them
  on ``(efsdp, ep)``. Only a user who hands torchtitan's clip a model parallelized that way meets it.

Where each parameter lives is recorded in ``Variant.info`` (a ``DTensorMeshes``: ``DENSE``, FSDP over
every rank; ``SPARSE``, distributed over ``ep`` and FSDP over ``efsdp``; ``efsdp``, FSDP over
``efsdp`` alone); the adapter builds the model from that and the declared placements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from harness.cases.axes import MeshAxis
from harness.cases.variant import Variant, declared_from_layout
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, Replicate, Shard, param
from harness.cases.scenario import Scenario, ScenarioOptions, ep_sizes_for

NUM_EXPERTS, DIM, RANK = 8, 16, 32
PREFIX = "layers.0."
EXPERTS = PREFIX + "moe.routed_experts.inner_experts."
SHARED = EXPERTS + "shared_lora_A"

DENSE, SPARSE = "dense", "sparse"
"""A DTensor mesh that is not one axis of the case mesh: torchtitan's flat FSDP mesh over all ranks,
or the case's own (efsdp, ep) mesh."""

LIES = ("no torchtitan configuration declares a placement its gradients contradict: its parallelize "
        "functions place every parameter from its sharding configs (EP: Shard(0) on ep; FSDP: Shard on "
        "efsdp or the dense mesh), and every replica's gradient comes from DTensor autograd or FSDP's "
        "reduce-scatter; its models have no factor replicated over ep inside the experts (LoRA wraps "
        "Linear layers only)")
"""Why ``placement lies`` is synthetic for torchtitan."""


@dataclass(frozen=True)
class DTensorMeshes:
    """Per parameter: the mesh its DTensor lives on (``DENSE``, ``SPARSE`` or an axis name)."""

    of: Mapping[str, str]


def expert_shard_dim(world_size: int) -> int:
    """The dim torchtitan's ``apply_fsdp_to_decoder`` shards routed experts on over ``efsdp``: 1 when
    ``efsdp * ep`` exceeds the number of experts, else 0."""
    return 1 if world_size > NUM_EXPERTS else 0


def _layout(world_size: int, ep: int, lying: bool) -> Layout:
    mesh = MeshSpec.of(efsdp=world_size // ep, ep=ep)
    everywhere: dict[str, Any] = {MeshAxis.EFSDP: Shard(0), MeshAxis.EP: Shard(0)}  # FSDP over all ranks: nested dim-0 sharding
    dense_rows = 2 * world_size
    fsdp = Shard(expert_shard_dim(world_size))
    return Layout(mesh, (
        param(PREFIX + "attention.wq.weight", (dense_rows, DIM), **everywhere),
        param(PREFIX + "attention_norm.weight", (dense_rows,), **everywhere),
        param(PREFIX + "moe.router.gate.weight", (dense_rows, DIM), **everywhere),
        param(EXPERTS + "w1_EFD", (NUM_EXPERTS, 2 * world_size, DIM), ep=Shard(0), efsdp=fsdp),
        param(EXPERTS + "w2_EDF", (NUM_EXPERTS, DIM, 2 * world_size), ep=Shard(0), efsdp=fsdp),
        # the shared factor: one [d, r] tensor, replicated over ep; "lying" makes it differ per EP rank
        param(SHARED, ((ep if lying else 1) * 2 * world_size, RANK),
              ep=Shard(0) if lying else Replicate(), efsdp=fsdp),
    ))


class TorchtitanEP(Scenario):
    name = "torchtitan_ep"
    summary = "torchtitan MoE block: dense FSDP over all ranks, routed experts on (efsdp, ep)"
    uses_ep = True
    default_targets = ("torchtitan", "reference")
    default_norm_types = (2.0, float("inf"))

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        injection = Injection(seed=options.seed, dtype=options.dtype)
        out = []
        for ep in ep_sizes_for(self.name, world_size, NUM_EXPERTS, options.ep_sizes):
            kinds = ["honest"] + (["placement lies", "experts without ep dim"] if ep > 1 else [])
            for kind in kinds:
                layout = _layout(world_size, ep, lying=kind == "placement lies")
                declared = declared_from_layout(layout)
                meshes = {spec.name: SPARSE if spec.name.startswith(EXPERTS) else DENSE for spec in layout}
                if kind == "placement lies":
                    declared[SHARED][MeshAxis.EP] = Replicate()
                if kind == "experts without ep dim":
                    for spec in layout:
                        if spec.name.startswith(EXPERTS) and spec.name != SHARED:
                            meshes[spec.name] = MeshAxis.EFSDP
                            declared[spec.name] = {MeshAxis.EFSDP: declared[spec.name][MeshAxis.EFSDP]}
                out.append(Variant(
                    label=f"{layout.describe()} {kind}",
                    layout=layout,
                    injection=injection,
                    declared=declared,
                    invariance_key=None if kind == "placement lies" else "titan",
                    ep_size=ep,
                    info=DTensorMeshes(meshes),
                    synthetic=LIES if kind == "placement lies" else None,
                ))
        return out
