"""A NeMo Automodel MoE block as its FSDP2 recipe lays it out: dense parameters FSDP2-sharded over
``dp_shard_cp`` (every rank here), experts on Automodel's ``moe_mesh`` = ``(ep_shard, ep)``.

Automodel's ``scale_grads_and_clip_grad_norm`` groups parameters by (DTensor mesh, placements),
reduces each group over its mesh's sharded dims, and, since 0.7.0 (the fix of NVIDIA-NeMo/Automodel
#3816, PR #3817), reduces the parameters of modules stamped ``_nemo_ep_local_expert_params`` over the
EP axis as well. Layouts (``Variant.info`` is an ``AutomodelSetup``):

* ``dense fsdp`` (ep=1, no ``moe_mesh``, as Automodel builds none for ep_size 1): every parameter,
  the experts included, sharded on dim 0 by FSDP2 over ``dp_shard_cp``. The control.
* ``te experts`` (ep > 1): TE grouped experts (``GroupedExpertsTE``) hold only this EP rank's
  experts as plain tensors (ep_shard 1), or as DTensors on the ``ep_shard`` sub-mesh alone, sharded on
  dim 1 (ep_shard > 1): no mesh dim of theirs says that they differ per EP rank; the module's marker
  does. This is the #3816 layout; 0.7.0 must get it right.
* ``te experts unmarked`` (ep > 1): the same tensors without the marker, i.e. what the clip saw before
  #3817 (and what any expert backend that builds rank-local parameters without stamping the marker
  still gives it): the expert part is never reduced over ``ep``, every EP group clips with its own
  norm (#3816: rank-dependent norm, replicas of the dense shards clipped differently).
* ``torch experts`` (ep > 1): ``GroupedExperts`` parallelized by Automodel's ``ExpertParallel`` (a
  DTensor ``Shard(0)`` on ``ep``), then FSDP2 on ``ep_shard`` (dim 1) when ep_shard > 1: the mesh
  carries the EP axis, so the per-dim reductions alone are right.

The harness mesh mirrors Automodel's ``moe_mesh``: ``(ep_fsdp, ep)`` in that order (Automodel's
``ep_shard`` is named ``ep_fsdp`` here, the harness's name for FSDP inside an EP group), ranks
row-major as ``_create_moe_mesh`` unflattens them; dense parameters sharded on dim 0 over both axes
nested are exactly FSDP2 over the flat ``dp_shard_cp`` mesh (rank r holds chunk r).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.spec.axes import MeshAxis
from harness.spec.case import Variant, declared_from_layout
from harness.spec.injection import Injection
from harness.spec.layout import Layout, MeshSpec, Shard, param
from harness.spec.scenario import Scenario, ScenarioOptions, ep_sizes_for

NUM_EXPERTS, DIM, HIDDEN = 8, 16, 8
PREFIX = "layers.0."
EXPERTS = PREFIX + "mlp.experts"
"""The experts module (its parameters ``gate_and_up_projs`` and ``down_projs``, Automodel's names)."""

DENSE, TE, TE_UNMARKED, TORCH = "dense fsdp", "te experts", "te experts unmarked", "torch experts"
KINDS = (TE, TE_UNMARKED, TORCH)


@dataclass(frozen=True)
class AutomodelSetup:
    """How Automodel would have built this layout: its EP size and the experts backend
    (``DENSE`` for ep 1, else one of ``KINDS``)."""

    ep: int
    experts: str

    @property
    def marked(self) -> bool:
        """Whether the experts module carries ``_nemo_ep_local_expert_params`` (``GroupedExpertsTE``
        stamps it at construction since 0.7.0)."""
        return self.experts == TE

    @property
    def expert_parallel(self) -> bool:
        """Whether the experts go through Automodel's ``ExpertParallel`` (a DTensor on ``ep``)."""
        return self.experts == TORCH


def _layout(world_size: int, ep: int) -> Layout:
    rows = 2 * world_size
    if ep == 1:
        mesh = MeshSpec.of(**{MeshAxis.DP_SHARD_CP: world_size})
        flat: dict[str, Any] = {MeshAxis.DP_SHARD_CP: Shard(0)}
        experts: dict[str, Any] = flat
    else:
        mesh = MeshSpec.of(**{MeshAxis.EP_FSDP: world_size // ep, MeshAxis.EP: ep})
        flat = {MeshAxis.EP_FSDP: Shard(0), MeshAxis.EP: Shard(0)}  # dp_shard_cp: every rank, dim 0
        experts = {MeshAxis.EP: Shard(0), MeshAxis.EP_FSDP: Shard(1)}  # experts split, FSDP on dim 1
    return Layout(mesh, (
        param(PREFIX + "self_attn.q_proj.weight", (rows, DIM), **flat),
        param(PREFIX + "input_layernorm.weight", (rows,), **flat),
        param(PREFIX + "mlp.gate.weight", (rows, DIM), **flat),
        param(EXPERTS + ".gate_and_up_projs", (NUM_EXPERTS, rows, 2 * HIDDEN), **experts),
        param(EXPERTS + ".down_projs", (NUM_EXPERTS, rows, DIM), **experts),
    ))


class AutomodelEP(Scenario):
    name = "automodel_ep"
    summary = "NeMo Automodel MoE: dense FSDP2 on dp_shard_cp, TE / torch experts on (ep_shard, ep)"
    uses_ep = True
    default_targets = ("automodel", "automodel-torch-clip", "reference")
    default_norm_types = (2.0, float("inf"))

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        injection = Injection(seed=options.seed, dtype=options.dtype)
        out = []
        for ep in ep_sizes_for(self.name, world_size, NUM_EXPERTS, options.ep_sizes):
            if ep == 1 and NUM_EXPERTS % world_size:
                continue  # FSDP2 would pad the experts' dim 0 unevenly; the layout model shards evenly
            layout = _layout(world_size, ep)
            for kind in (DENSE,) if ep == 1 else KINDS:
                label = f"{layout.describe()} {kind}"
                out.append(Variant(
                    label=label,
                    layout=layout,
                    injection=injection,
                    declared=declared_from_layout(layout),
                    invariance_key=None if kind == TE_UNMARKED else "automodel",
                    ep_size=ep,
                    info=AutomodelSetup(ep, kind),
                ))
        return out
