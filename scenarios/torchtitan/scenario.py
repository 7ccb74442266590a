"""A torchtitan-style MoE block: dense parameters FSDP-sharded over every rank, experts on a sparse
``(efsdp, ep)`` mesh, all as DTensors.

torchtitan's EP clip (``clip_grad_norm_(..., ep_enabled=True)``) splits parameters by whether their
DTensor mesh has an ``ep`` axis and lets DTensor placements do every reduction. It is exact when the
placements are honest, and only then. Layouts:

* ``honest``: every DTensor placement is the truth (the control).
* ``placement lies`` (ep > 1): the shared LoRA factor is declared ``Replicate`` on ``ep``, but its
  gradients differ from EP rank to EP rank (it was never synchronized); DTensor trusts the
  declaration and each rank counts only its own copy.
* ``experts without ep dim`` (ep > 1): the experts sit on the ``efsdp`` mesh alone, as FSDP-wrapped
  expert modules do in xorl/VeOmni; DTensor cannot know about the EP dimension, so each EP rank sees
  only its own experts.

Where each parameter's DTensor lives is recorded in ``Variant.info`` (a ``DTensorMeshes``: ``DENSE``,
a 1-D mesh over all ranks; ``SPARSE``, the case mesh; or one axis of it, ``efsdp``); the torchtitan
adapter builds the DTensors from that and the declared placements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from harness.spec.axes import MeshAxis
from harness.spec.case import Variant, declared_from_layout
from harness.spec.injection import Injection
from harness.spec.layout import Layout, MeshSpec, Replicate, Shard, param
from harness.spec.scenario import Scenario, ScenarioOptions, ep_sizes_for

NUM_EXPERTS, DIM, HIDDEN, RANK = 8, 16, 8, 32
PREFIX = "layers.0."

DENSE, SPARSE = "dense", "sparse"
"""A DTensor mesh that is not one axis of the case mesh: torchtitan's flat FSDP mesh over all ranks,
or the case's own (efsdp, ep) mesh."""


@dataclass(frozen=True)
class DTensorMeshes:
    """Per parameter: the mesh its DTensor lives on (``DENSE``, ``SPARSE`` or an axis name)."""

    of: Mapping[str, str]


def _layout(world_size: int, ep: int, lying: bool) -> Layout:
    mesh = MeshSpec.of(efsdp=world_size // ep, ep=ep)
    everywhere: dict[str, Any] = {MeshAxis.EFSDP: Shard(0), MeshAxis.EP: Shard(0)}  # FSDP over all ranks: nested dim-0 sharding
    dense_rows = 2 * world_size
    shared_lead = ep if lying else 1
    return Layout(mesh, (
        param(PREFIX + "attention.wq.weight", (dense_rows, DIM), **everywhere),
        param(PREFIX + "attention_norm.weight", (dense_rows,), **everywhere),
        param(PREFIX + "moe.router.gate.weight", (dense_rows, DIM), **everywhere),
        param(PREFIX + "moe.experts.w1", (NUM_EXPERTS, 2 * world_size, HIDDEN), ep=Shard(0), efsdp=Shard(1)),
        param(PREFIX + "moe.experts.w2", (NUM_EXPERTS, 2 * world_size, DIM), ep=Shard(0), efsdp=Shard(1)),
        # the shared factor: one [1, d, r] tensor, replicated over ep; "lying" makes it differ per EP rank
        param(PREFIX + "moe.shared_lora_A", (shared_lead, 2 * world_size, RANK),
              ep=Shard(0) if lying else Replicate(), efsdp=Shard(1)),
    ))


class TorchtitanEP(Scenario):
    name = "torchtitan_ep"
    summary = "torchtitan-style DTensor MoE: dense on an all-rank mesh, experts on (efsdp, ep)"
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
                meshes = {}
                for spec in layout:
                    meshes[spec.name] = SPARSE if ".moe.experts." in spec.name or "shared" in spec.name else DENSE
                if kind == "placement lies":
                    declared[PREFIX + "moe.shared_lora_A"][MeshAxis.EP] = Replicate()
                if kind == "experts without ep dim":
                    for spec in layout:
                        if ".moe.experts." in spec.name:
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
                ))
        return out
