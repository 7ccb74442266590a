"""A NeMo Automodel MoE block as its MoE parallelizer lays it out: dense parameters FSDP2-sharded over
``dp_shard_cp`` (every rank here), experts on Automodel's ``moe_mesh`` = ``(ep_shard, ep)``.

Automodel's ``scale_grads_and_clip_grad_norm`` groups parameters by (DTensor mesh, placements),
reduces each group over its mesh's sharded dims, and, since 0.7.0 (the fix of NVIDIA-NeMo/Automodel
#3816, PR #3817), reduces the parameters of modules stamped ``_nemo_ep_local_expert_params`` (what
``GroupedExpertsTE.__init__`` stamps) over the EP axis as well. The block's ``mlp`` is Automodel's own
``MoE`` (its ``Gate`` and the experts class its ``BackendConfig`` picks), so the parameter names and
shapes are Automodel's. Layouts (``Variant.info`` is an ``AutomodelSetup``):

* ``dense fsdp`` (ep=1, no ``moe_mesh``, as Automodel builds none for ep_size 1): every parameter,
  the torch experts included, sharded on dim 0 by FSDP2 over ``dp_shard_cp``. The control.
* ``torch experts`` (ep > 1): ``GroupedExperts`` (``experts="torch"``, the default backend):
  ``gate_and_up_projs`` / ``down_projs`` parallelized by Automodel's ``ExpertParallel`` (a DTensor
  ``Shard(0)`` on ``ep``), then FSDP2 on ``ep_shard`` (dim 1) when ep_shard > 1: the mesh carries
  the EP axis, so the per-dim reductions alone are right.
* ``te experts`` (ep > 1): ``GroupedExpertsTE`` (``experts="te", dispatcher="deepep"``): one
  parameter per local expert (``gate_up_linear.weight{j}``, ``down_linear.weight{j}``, TE's
  ``GroupedLinear`` layout), plain tensors (ep_shard 1) or DTensors on the ``ep_shard`` sub-mesh alone,
  sharded on dim 1 (ep_shard > 1): no mesh dim of theirs says that they differ per EP rank; the
  module's marker does. This is the #3816 layout: 0.7.0 must get it right, 0.6.0 (no marker, no EP
  reduction) reports ``sqrt(dense^2 + own experts^2)`` per EP coordinate.
* ``te experts unmarked`` (ep > 1, **synthetic**): the same module with the marker taken off after
  Automodel stamped it: what the clip saw before #3817. No configuration of 0.7.0 builds it (every
  ``GroupedExpertsTE`` stamps the marker in ``__init__``, and every other experts class goes through
  ``ExpertParallel``); kept as the regression layout of #3816.

Expert ``j`` of EP rank ``r`` is expert ``r * E/ep + j``: the layout names ``weight{j}`` as one
tensor of ``ep`` rows of blocks sharded over ``ep`` on dim 0, which gives every rank its own.
The harness mesh mirrors Automodel's ``moe_mesh``: ``(ep_fsdp, ep)`` in that order (Automodel's
``ep_shard`` is named ``ep_fsdp`` here, the harness's name for FSDP inside an EP group), ranks
row-major as ``_create_moe_mesh`` unflattens them; dense parameters sharded on dim 0 over both axes
nested are exactly FSDP2 over the flat ``dp_shard_cp`` mesh (rank r holds chunk r).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.cases.axes import MeshAxis
from harness.cases.variant import Variant, declared_from_layout
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, Shard, param
from harness.cases.scenario import Scenario, ScenarioOptions, ep_sizes_for

NUM_EXPERTS, DIM, HIDDEN = 8, 16, 8
"""Automodel's ``MoEConfig``: ``n_routed_experts``, ``dim``, ``moe_inter_dim`` (gated: 2 * HIDDEN)."""
PREFIX = "layers.0."
MLP = PREFIX + "mlp"
EXPERTS = MLP + ".experts"
"""The experts module: ``gate_and_up_projs`` / ``down_projs`` (torch), ``gate_up_linear.weight{j}`` /
``down_linear.weight{j}`` (TE)."""

DENSE, TE, TE_UNMARKED, TORCH = "dense fsdp", "te experts", "te experts unmarked", "torch experts"
KINDS = (TE, TE_UNMARKED, TORCH)
UNMARKED_SYNTHETIC = ("nemo-automodel 0.7.0 stamps _nemo_ep_local_expert_params in GroupedExpertsTE.__init__ "
                      "(PR #3817) and builds every other experts class through ExpertParallel: no 0.7.0 "
                      "configuration leaves EP-local experts unmarked (on 0.6.0 the 'te experts' layouts are "
                      "this state, reached by its stock TE experts)")


@dataclass(frozen=True)
class AutomodelSetup:
    """How Automodel builds this layout: its EP size and the experts backend (``DENSE`` for ep 1,
    else one of ``KINDS``)."""

    ep: int
    experts: str

    @property
    def te(self) -> bool:
        """``GroupedExpertsTE`` (``BackendConfig(experts="te", dispatcher="deepep")``)."""
        return self.experts in (TE, TE_UNMARKED)

    @property
    def unmarked(self) -> bool:
        """The synthetic layout: Automodel's marker taken off the TE experts after construction."""
        return self.experts == TE_UNMARKED


def _layout(world_size: int, ep: int, kind: str) -> Layout:
    rows = 2 * world_size
    if ep == 1:
        mesh = MeshSpec.of(**{MeshAxis.DP_SHARD_CP: world_size})
        flat: dict[str, Any] = {MeshAxis.DP_SHARD_CP: Shard(0)}
        experts: dict[str, Any] = flat
    else:
        mesh = MeshSpec.of(**{MeshAxis.EP_FSDP: world_size // ep, MeshAxis.EP: ep})
        flat = {MeshAxis.EP_FSDP: Shard(0), MeshAxis.EP: Shard(0)}  # dp_shard_cp: every rank, dim 0
        experts = {MeshAxis.EP: Shard(0), MeshAxis.EP_FSDP: Shard(1)}  # experts split, FSDP on dim 1
    specs = [
        param(PREFIX + "self_attn.q_proj.weight", (rows, DIM), **flat),
        param(PREFIX + "input_layernorm.weight", (rows,), **flat),
        param(MLP + ".gate.weight", (NUM_EXPERTS, DIM), **flat),
    ]
    if kind in (TE, TE_UNMARKED):  # TE GroupedLinear: weight{j} is (out_features, in_features), expert r*E/ep+j
        for j in range(NUM_EXPERTS // ep):
            specs.append(param(f"{EXPERTS}.gate_up_linear.weight{j}", (ep * 2 * HIDDEN, DIM), **experts))
        for j in range(NUM_EXPERTS // ep):
            specs.append(param(f"{EXPERTS}.down_linear.weight{j}", (ep * DIM, HIDDEN), **experts))
    else:
        specs.append(param(EXPERTS + ".gate_and_up_projs", (NUM_EXPERTS, DIM, 2 * HIDDEN), **experts))
        specs.append(param(EXPERTS + ".down_projs", (NUM_EXPERTS, HIDDEN, DIM), **experts))
    return Layout(mesh, tuple(specs))


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
            for kind in (DENSE,) if ep == 1 else KINDS:
                layout = _layout(world_size, ep, kind)
                out.append(Variant(
                    label=f"{layout.describe()} {kind}",
                    layout=layout,
                    injection=injection,
                    declared=declared_from_layout(layout),
                    # torch experts and the control hold the same tensors at every ep: same unique gradients
                    invariance_key="automodel-torch" if kind in (DENSE, TORCH) else None,
                    ep_size=ep,
                    info=AutomodelSetup(ep, kind),
                    synthetic=UNMARKED_SYNTHETIC if kind == TE_UNMARKED else None,
                ))
        return out
