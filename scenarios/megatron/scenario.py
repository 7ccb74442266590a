"""A Megatron-style transformer layer with MoE under tensor and expert parallelism.

Mesh ``(dp, ep, tp)`` in Megatron's rank order (tp fastest). Dense weights are column- or row-parallel
(sharded over ``tp``); the layernorm and router weights are TP-duplicates (replicated over ``tp``,
counted on TP rank 0 only by Megatron's filter); the experts, stacked per local expert, are sharded
over ``ep`` and over ``tp`` (expert tensor parallelism equal to tp, Megatron's default). Everything is replicated over ``dp`` (a non-distributed optimizer sees
all-reduced, identical data-parallel gradients).

Two expert modules, as a user's model gets them; the marks (``tensor_model_parallel``, ``allreduce``)
come from megatron-core's own code in the adapter's ``dress``, never from this file:

* ``experts TP-linear (SequentialMLP)``: the experts of the local spec without ``--moe-grouped-gemm``
  (``ColumnParallelLinear`` / ``RowParallelLinear`` with ``is_expert=True``);
* ``experts grouped GEMM (TE)`` (tp > 1 only): the experts of ``--moe-grouped-gemm`` on the default
  Transformer Engine stack (``TEGroupedMLP``, ``TEGroupedLinear``). megatron-core before
  Megatron-LM PR #5916 (0.16.1) leaves them unmarked ``tensor_model_parallel``, so its TP-duplicate
  filter keeps only TP rank 0's expert shards; PR #5916 marks them in
  ``_set_expert_parameter_attributes`` (extensions/transformer_engine.py) and filters experts over the
  expert-TP group.

What the adapter must know is which module a variant's experts come from (``MegatronExperts``).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.cases.variant import Variant, declared_from_layout
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, Shard, param
from harness.cases.scenario import Scenario, ScenarioOptions, ep_sizes_for

NUM_EXPERTS = 4
PREFIX = "decoder.layers.0."


def megatron_layout(world_size: int, ep: int, tp: int) -> Layout:
    hidden, ffn = 4 * tp, 2 * tp
    return Layout(MeshSpec.of(dp=world_size // (ep * tp), ep=ep, tp=tp), (
        param(PREFIX + "self_attention.linear_qkv.weight", (2 * hidden, hidden), tp=Shard(0)),
        param(PREFIX + "self_attention.linear_proj.weight", (hidden, hidden), tp=Shard(1)),
        param(PREFIX + "input_layernorm.weight", (hidden,)),
        param(PREFIX + "mlp.router.weight", (NUM_EXPERTS, hidden)),
        param(PREFIX + "mlp.experts.linear_fc1.weight", (NUM_EXPERTS, hidden, ffn), ep=Shard(0), tp=Shard(2)),
        param(PREFIX + "mlp.experts.linear_fc2.weight", (NUM_EXPERTS, ffn, hidden), ep=Shard(0), tp=Shard(1)),
    ))


@dataclass(frozen=True)
class MegatronExperts:
    """Which megatron-core module the variant's experts come from: ``"sequential"`` (TP linear layers,
    ``SequentialMLP``) or ``"te-grouped"`` (``TEGroupedMLP``, ``--moe-grouped-gemm``)."""

    module: str


class MegatronMoETP(Scenario):
    name = "megatron_moe_tp"
    summary = "Megatron-style TP + EP layer: TP-parallel, TP-duplicate and expert weights with Megatron's marks"
    uses_ep = True
    default_targets = ("megatron", "reference")

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        injection = Injection(seed=options.seed, dtype=options.dtype)
        out = []
        for ep in ep_sizes_for(self.name, world_size, NUM_EXPERTS, options.ep_sizes):
            for tp in (k for k in range(1, world_size // ep + 1) if (world_size // ep) % k == 0):
                layout = megatron_layout(world_size, ep, tp)
                for module in ("sequential", "te-grouped") if tp > 1 else ("sequential",):
                    kind = "experts TP-linear (SequentialMLP)" if module == "sequential" else "experts grouped GEMM (TE)"
                    out.append(Variant(
                        label=f"{layout.describe()} {kind}",
                        layout=layout,
                        injection=injection,
                        declared=declared_from_layout(layout),
                        invariance_key=f"megatron-tp{tp}",
                        ep_size=ep,
                        info=MegatronExperts(module),
                    ))
        return out
