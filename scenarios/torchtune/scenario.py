"""A torchtune Llama-3 decoder under the distributed full-finetune recipe of torchtune 0.6.1:
FSDP2 over the ``dp`` axis of its ``(dp, tp)`` mesh, tensor parallelism over ``tp``.

The recipe (``recipes/full_finetune_distributed.py``) builds the mesh ``(dp, tp)``, applies its
``tensor_parallel_plan`` with ``parallelize_module`` when ``tp > 1``, shards with
``training.shard_model`` over ``dp`` when ``dp > 1``, and clips with stock
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` (L2: it passes no norm type).
Layouts:

* ``fsdp``: ``dp = world``, ``tp = 1``; every parameter a DTensor on the ``dp`` mesh (the control).
* ``tp base plan`` (``dp = 1``): torchtune 0.6.1's ``base_llama_tp_plan`` covers the embeddings,
  the projections and the output, not the RMSNorm scales, and no FSDP runs when ``dp = 1``: the
  norms stay plain tensors next to DTensor projections, and torch's foreach norm refuses the mix
  (torchtune issue #2420, still open).
* ``tp+fsdp base plan`` (``dp, tp > 1``): the same plan, then FSDP2 over ``dp``: the projections
  become 2-D DTensors on ``(dp, tp)``, the norms 1-D DTensors on ``dp``, and torch cannot stack
  norms from two meshes (torch issue #180346; the layout of torchtune #2420 with FSDP).
* ``tp sp-norms`` / ``tp+fsdp sp-norms``: a user plan that adds ``SequenceParallel`` for the norms
  (as torchtune's plan does after 0.6.1, PR #2503): every parameter is a DTensor on one mesh and
  the stock clip is exact.

Placements, per parameter: column-wise projections and the row-wise embedding ``Shard(0)`` on
``tp``, row-wise projections ``Shard(1)``, norms ``Replicate``; FSDP2 ``Shard(0)`` on ``dp``. Where
``tp`` and ``dp`` both shard dim 0, FSDP2 splits each TP shard again (a strided shard) while the
layout nests ``dp`` outside ``tp``: each rank still holds one distinct block of the same size, so
the norm, the coefficient and the replica checks are the same.

Order: on each mesh the crashing ``base plan`` runs before the exact ``sp-norms`` layout, so that a
correct layout is judged right after a case raised and the harness rebuilt its process groups (this
order once failed ``dp=2 tp=2 tp+fsdp sp-norms`` with "Could not resolve the process group
registered under the name N": DTensor's sharding-propagation cache kept the old generation's mesh,
now emptied with every generation by ``harness.run.world.dist_world.forget_dtensor_caches``).

``Variant.info`` (a ``TorchtuneParallel``) tells the adapter the two sizes and whether the plan
covers the norms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.cases.axes import MeshAxis
from harness.cases.variant import Variant, declared_from_layout
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, ParamSpec, Placement, Replicate, Shard, param
from harness.cases.scenario import Scenario, ScenarioOptions

VOCAB, EMBED, HEADS, KV_HEADS, HIDDEN, LAYERS = 32, 16, 4, 4, 32, 2
HEAD_DIM = EMBED // HEADS


@dataclass(frozen=True)
class TorchtuneParallel:
    """The recipe's ``data_parallel_dim`` / ``tensor_parallel_dim`` and the TP plan it is given."""

    dp: int
    tp: int
    sp_norms: bool  # the plan adds SequenceParallel for the RMSNorm scales


COLWISE = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.w1", "mlp.w3")
ROWWISE = ("attn.output_proj", "mlp.w2")


def _p(name: str, shape: tuple[int, ...], tp: Placement) -> ParamSpec:
    placements: dict[str, Any] = {MeshAxis.DP: Shard(0), MeshAxis.TP: tp}  # FSDP2 always shards dim 0
    return param(name, shape, **placements)


def llama_layout(dp: int, tp: int) -> Layout:
    """torchtune's ``llama3(...)`` parameters, placed as the recipe places them."""
    kv = KV_HEADS * HEAD_DIM
    shapes = {"attn.q_proj": (HEADS * HEAD_DIM, EMBED), "attn.k_proj": (kv, EMBED), "attn.v_proj": (kv, EMBED),
              "attn.output_proj": (EMBED, HEADS * HEAD_DIM), "mlp.w1": (HIDDEN, EMBED), "mlp.w2": (EMBED, HIDDEN),
              "mlp.w3": (HIDDEN, EMBED)}
    specs = [_p("tok_embeddings.weight", (VOCAB, EMBED), Shard(0))]
    for i in range(LAYERS):
        layer = f"layers.{i}."
        specs.append(_p(layer + "sa_norm.scale", (EMBED,), Replicate()))
        for module in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.output_proj"):
            specs.append(_p(layer + module + ".weight", shapes[module], Shard(0) if module in COLWISE else Shard(1)))
        specs.append(_p(layer + "mlp_norm.scale", (EMBED,), Replicate()))
        for module in ("mlp.w1", "mlp.w2", "mlp.w3"):
            specs.append(_p(layer + module + ".weight", shapes[module], Shard(0) if module in COLWISE else Shard(1)))
    specs.append(_p("norm.scale", (EMBED,), Replicate()))
    specs.append(_p("output.weight", (VOCAB, EMBED), Shard(0)))
    return Layout(MeshSpec.of(**{MeshAxis.DP: dp, MeshAxis.TP: tp}), tuple(specs))


class TorchtuneTP(Scenario):
    name = "torchtune_tp"
    summary = "torchtune 0.6.1 full-finetune recipe: llama3 under FSDP2 (shard_model) and its TP plan"
    default_targets = ("torchtune", "reference")
    default_norm_types = (2.0,)

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        injection = Injection(seed=options.seed, dtype=options.dtype)
        out = []

        def add(dp: int, tp: int, sp_norms: bool) -> None:
            layout = llama_layout(dp, tp)
            kind = "fsdp" if tp == 1 else ("tp" if dp == 1 else "tp+fsdp")
            plan = "" if tp == 1 else (" sp-norms" if sp_norms else " base plan")
            out.append(Variant(label=f"{layout.describe()} {kind}{plan}", layout=layout, injection=injection,
                               declared=declared_from_layout(layout), invariance_key="torchtune-llama3",
                               info=TorchtuneParallel(dp, tp, sp_norms)))

        add(world_size, 1, False)
        for tp in (t for t in range(2, world_size + 1) if world_size % t == 0 and HEADS % t == 0):
            for sp_norms in (False, True):  # the crashing layout first: see the module docstring
                add(world_size // tp, tp, sp_norms)
        return out
