"""A Megatron-style transformer layer with MoE under tensor and expert parallelism.

Mesh ``(dp, ep, tp)`` in Megatron's rank order (tp fastest). Dense weights are column- or row-parallel
(sharded over ``tp`` and marked ``tensor_model_parallel``); the layernorm and router weights are
TP-duplicates (replicated over ``tp``, unmarked, counted on TP rank 0 only by Megatron's filter); the
grouped experts are sharded over ``ep`` and over ``tp`` (expert tensor parallelism) and marked
``allreduce = False``. Everything is replicated over ``dp`` (a non-distributed optimizer sees
all-reduced, identical data-parallel gradients).

Two markings of the experts: ``experts marked TP`` (the control) and, with tp > 1, ``experts unmarked
(grouped GEMM)``: the grouped-GEMM expert weights that megatron-core 0.16.1 did not mark
``tensor_model_parallel``, so its TP-duplicate filter keeps only TP rank 0's expert shards (fixed by
Megatron-LM PR #5916). The marks each parameter gets are in ``Variant.info`` (``MegatronMarks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from harness.spec.axes import MeshAxis
from harness.spec.case import Variant, declared_from_layout
from harness.spec.injection import Injection
from harness.spec.layout import Layout, MeshSpec, Shard, param
from harness.spec.scenario import Scenario, ScenarioOptions, ep_sizes_for

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
class ParamMarks:
    """The attributes Megatron reads off a parameter: ``partition_dim`` set means marked
    ``tensor_model_parallel`` (with stride 1); ``expert`` means ``allreduce = False``."""

    partition_dim: int | None = None
    expert: bool = False

    def attributes(self) -> dict[str, object]:
        """What Megatron's own layers would have set on the parameter, and nothing else."""
        out: dict[str, object] = {}
        if self.partition_dim is not None:
            out.update(tensor_model_parallel=True, partition_dim=self.partition_dim, partition_stride=1)
        if self.expert:
            out["allreduce"] = False
        return out


@dataclass(frozen=True)
class MegatronMarks:
    of: Mapping[str, ParamMarks]


def megatron_marks(layout: Layout, experts_marked: bool) -> MegatronMarks:
    marks: dict[str, ParamMarks] = {}
    for spec in layout:
        tp = spec.placement(MeshAxis.TP)
        expert = ".experts." in spec.name
        marked = isinstance(tp, Shard) and (experts_marked or not expert)
        marks[spec.name] = ParamMarks(tp.dim - (1 if expert else 0) if marked and isinstance(tp, Shard) else None,
                                      expert)
    return MegatronMarks(marks)


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
                for marked in (True, False) if tp > 1 else (True,):
                    kind = "experts marked TP" if marked else "experts unmarked (grouped GEMM)"
                    out.append(Variant(
                        label=f"{layout.describe()} {kind}",
                        layout=layout,
                        injection=injection,
                        declared=declared_from_layout(layout),
                        invariance_key=f"megatron-tp{tp}",
                        ep_size=ep,
                        info=megatron_marks(layout, marked),
                    ))
        return out
