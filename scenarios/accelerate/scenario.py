"""A small decoder layer laid out the ways accelerate 1.15/1.16 lays a model out (``ParallelismConfig``
with its canonical mesh ``(dp_replicate, dp_shard, tp)``), for ``Accelerator.clip_grad_norm_``.

accelerate's clip (``Accelerator._clip_grad_norm_dtensor_aware``, the fix of accelerate PR #4219 for
the foreach crash on mixed plain/DTensor gradients) groups the gradients by DTensor mesh, plus one
group of plain tensors; each DTensor group's norm is reduced over its own mesh (``full_tensor``), the
plain group's norm is taken as it is on the rank (it assumes plain gradients are replicated), and the
group norms are combined. One group only: stock ``torch.nn.utils.clip_grad_norm_``. Layouts:

* FSDP2 (target ``accelerate``: FSDP plugin ``fsdp_version=2``, ``accelerator.prepare``'s
  ``fully_shard`` on the ``dp_shard_cp`` mesh):
  * ``fsdp2``: every parameter sharded on dim 0 over all ranks: one mesh, stock torch (the control);
  * ``hsdp``: ``dp_replicate=2``, FSDP on the 2-D ``(dp_replicate, dp_shard_cp)`` mesh (world 4);
  * ``fsdp2+tp``: row-parallel weights TP-sharded (``Shard(1)`` on ``tp``) before FSDP, so FSDP makes
    them 2-D ``(dp_shard_cp, tp)`` DTensors while norms and the embedding are 1-D ``dp_shard_cp`` ones:
    two meshes, accelerate's grouped path (world 4).
* TP without FSDP (target ``accelerate-tp``; the model "tensor-parallelized before accelerate", as
  transformers' ``tp_plan`` does it, ``model.tp_size`` set, DTensors on accelerate's ``tp`` mesh):
  * ``tp mixed plain/DTensor``: column/row-parallel weights are DTensors, norms and the embedding are
    plain replicated tensors: the layout of accelerate PR #4219 (and torchtune #2420, transformers
    #36132) where a foreach norm over both kinds raised;
  * ``tp all DTensor``: norms and embedding ``Replicate`` DTensors on the tp mesh: one mesh, stock torch;
  * ``tp experts plain``: as ``mixed``, plus MoE experts split over the tp ranks (each rank its own
    experts) and kept as *plain* local tensors. Which stack produces it: transformers **4.x** only
    (4.57.6 checked), whose ``use_dtensor=False`` styles keep TP shards plain: ``grouped_gemm``
    (``GroupedGemmParallel``: gpt-oss's ``base_model_tp_plan``, q/k/v colwise, o_proj rowwise,
    experts ``grouped_gemm``, norms unplanned: exactly this layout) and ``local_colwise`` /
    ``local_rowwise`` (dots.llm1's experts: each rank a column/row slice of every expert, plain too).
    transformers 5 (the pinned 5.18.0) rewrote its TP on DTensors: ``grouped_gemm`` is
    ``MoEParamShard`` (a ``Shard(0)`` DTensor), experts under TP ``packed_colwise`` / ``rowwise``
    DTensors, so with the pinned stack no user reaches this layout; users of transformers 4.x do
    (stock: ``from_pretrained(tp_plan="auto")``, then accelerate; see
    ``repro_tp_plain_experts.py``). The plain group is then not replicated, and accelerate's
    rank-local plain norm misses the other ranks' experts: each rank clips with its own, too small,
    norm.
  * ``tp all plain``: every TP-sharded parameter a plain local shard (column-parallel dim 0,
    row-parallel dim 1), norms and embedding plain replicas, no DTensor at all: what
    ``from_pretrained(tp_plan="auto")`` leaves with transformers **5.3 to 5.14** (5.3.0, 5.5.4, 5.10.4 and
    5.14.1 checked; 5.16.1, 5.17.0 and the pinned 5.18.0 make DTensors again, 4.x makes DTensors of
    colwise/rowwise) for any model with a TP plan. accelerate then has one (plain) group and calls
    ``torch.nn.utils.clip_grad_norm_`` on rank-local gradients: each rank clips by its own shards.
* ``... nan``: one NaN on the last rank only (its FSDP shard; a row-parallel DTensor; its plain experts),
  to see whether every rank learns of it.

A clip of the user's is handed what accelerate's prepared model holds (``handed``): DTensors where FSDP2 or a
DTensor TP style made them, plain tensors elsewhere.

``Variant.info`` (an ``AccelerateSetup``) gives the parallelism sizes, whether FSDP2 wraps the model,
and each tensor-parallel parameter's style.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from harness.cases.axes import MeshAxis
from harness.cases.variant import Variant, declared_from_layout
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, ParamSpec, Placement, Replicate, Shard, param
from harness.cases.scenario import Scenario, ScenarioOptions

ROWS_PER_RANK, COLS, EXPERTS_PER_RANK, EXPERT_ROWS = 4, 16, 2, 8

COLWISE, ROWWISE, REPLICATE, LOCAL, LOCAL_ROWWISE = "colwise", "rowwise", "replicate", "local", "local_rowwise"
"""Tensor-parallel styles: a DTensor ``Shard(0)`` / ``Shard(1)`` / ``Replicate()`` on the tp mesh, or
a plain tensor holding this rank's shard of dim 0 / dim 1 (``use_dtensor=False``)."""

EMBED = "embed_tokens.weight"
Q_PROJ = "layers.0.self_attn.q_proj.weight"
O_PROJ = "layers.0.self_attn.o_proj.weight"
DOWN_PROJ = "layers.0.mlp.down_proj.weight"
INPUT_NORM = "layers.0.input_layernorm.weight"
FINAL_NORM = "norm.weight"
EXPERTS = "layers.0.mlp.experts.gate_up_proj"


@dataclass(frozen=True)
class AccelerateSetup:
    """How accelerate holds the model: ``ParallelismConfig`` sizes, whether the FSDP2 plugin wraps it,
    and the tensor-parallel style of each parameter (parameters not named stay plain tensors)."""

    fsdp: bool
    dp_replicate: int
    dp_shard: int
    tp: int
    tp_styles: Mapping[str, str] = field(default_factory=dict)


def _dense(world_size: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    rows = ROWS_PER_RANK * world_size
    return ((EMBED, (rows, COLS)), (Q_PROJ, (rows, COLS)), (O_PROJ, (rows, COLS)), (DOWN_PROJ, (rows, COLS)),
            (INPUT_NORM, (rows,)), (FINAL_NORM, (rows,)))


def _tp_placement(style: str | None) -> Placement:
    if style == COLWISE or style == LOCAL:
        return Shard(0)
    if style == ROWWISE or style == LOCAL_ROWWISE:
        return Shard(1)
    return Replicate()


DTENSOR_STYLES = (COLWISE, ROWWISE, REPLICATE)


def handed(setup: AccelerateSetup, layout: Layout) -> dict[str, Any]:
    """What accelerate's prepared model hands a clip, as ``Variant`` arguments: under FSDP2 every parameter a
    DTensor (``fully_shard``), on the whole mesh where a TP style made it a DTensor too, on the FSDP axes alone
    where none did; without FSDP a DTensor on the tp mesh where its TP style makes one, a plain tensor elsewhere."""
    names = [s.name for s in layout.trainable]
    tp_dtensors = {n for n in names if setup.tp_styles.get(n) in DTENSOR_STYLES}
    if setup.fsdp:
        fsdp_dims = tuple((a,) for a in layout.mesh.names if a != MeshAxis.TP)
        sub = {n: fsdp_dims for n in names if n not in tp_dtensors} if layout.mesh.has(MeshAxis.TP) else {}
        return {"dtensor": True, "dtensor_axes": sub, "dress_from_plain": True}
    if not tp_dtensors:
        return {}
    return {"dtensor": True, "plain": frozenset(n for n in names if n not in tp_dtensors), "dress_from_plain": True}


class AccelerateParallelism(Scenario):
    name = "accelerate_fsdp2"
    summary = "accelerate ParallelismConfig layouts: FSDP2, HSDP, FSDP2+TP, TP with plain and DTensor parameters"
    default_targets = ("accelerate", "accelerate-tp", "reference")
    default_norm_types = (2.0, float("inf"))

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        injection = Injection(seed=options.seed, dtype=options.dtype)
        out: list[Variant] = []

        def add(label: str, mesh: MeshSpec, setup: AccelerateSetup, key: str | None, experts: bool = False,
                nan_at: tuple[str, int] | None = None) -> None:
            specs: list[ParamSpec] = []
            shapes = _dense(world_size) + (((EXPERTS, (EXPERTS_PER_RANK * world_size, EXPERT_ROWS, COLS)),)
                                           if experts else ())
            for name, shape in shapes:
                placements: dict[str, Any] = {}  # param()'s keyword placements
                if mesh.has(MeshAxis.DP_REPLICATE):
                    placements[MeshAxis.DP_REPLICATE] = Replicate()
                if mesh.has(MeshAxis.DP_SHARD):
                    placements[MeshAxis.DP_SHARD] = Shard(0)
                if mesh.has(MeshAxis.TP):
                    placements[MeshAxis.TP] = _tp_placement(setup.tp_styles.get(name))
                specs.append(param(name, shape, **placements))
            layout = Layout(mesh, tuple(specs))
            injected = injection if nan_at is None else Injection(seed=options.seed, dtype=options.dtype,
                                                                  nonfinite=((*nan_at, "nan"),))
            out.append(Variant(label=f"{layout.describe()} {label}", layout=layout, injection=injected,
                               declared=declared_from_layout(layout), invariance_key=key, info=setup,
                               **handed(setup, layout)))

        n = world_size
        rowwise_only = {O_PROJ: ROWWISE, DOWN_PROJ: ROWWISE, Q_PROJ: ROWWISE}
        tp_plan = {Q_PROJ: COLWISE, O_PROJ: ROWWISE, DOWN_PROJ: ROWWISE}
        rows = ROWS_PER_RANK * n
        if n > 1:
            add("fsdp2", MeshSpec.of(dp_shard=n), AccelerateSetup(True, 1, n, 1), "accelerate-dense")
            # a NaN in the last rank's FSDP shard only
            add("fsdp2 nan", MeshSpec.of(dp_shard=n), AccelerateSetup(True, 1, n, 1), None,
                nan_at=(DOWN_PROJ, rows * COLS - 3))
        if n >= 4 and n % 2 == 0:
            add("hsdp", MeshSpec.of(dp_replicate=2, dp_shard=n // 2),
                AccelerateSetup(True, 2, n // 2, 1), "accelerate-dense")
            # FSDP shards dim 0, so the TP weights are row-parallel (Shard(1)): no strided dim-0 sharding
            add("fsdp2+tp", MeshSpec.of(dp_shard=n // 2, tp=2),
                AccelerateSetup(True, 1, n // 2, 2, rowwise_only), "accelerate-dense")
        if n > 1 and COLS % n == 0:  # row-parallel weights split their COLS columns over every rank
            tp = MeshSpec.of(tp=n)
            add("tp mixed plain/DTensor", tp, AccelerateSetup(False, 1, 1, n, tp_plan), "accelerate-dense")
            replicated = {**tp_plan, EMBED: REPLICATE, INPUT_NORM: REPLICATE, FINAL_NORM: REPLICATE}
            add("tp all DTensor", tp, AccelerateSetup(False, 1, 1, n, replicated), "accelerate-dense")
            add("tp experts plain", tp, AccelerateSetup(False, 1, 1, n, {**tp_plan, EXPERTS: LOCAL}),
                "accelerate-experts", experts=True)
            # every TP shard plain (transformers 5.3-5.14); no invariance key: its clip is known to differ
            add("tp all plain", tp, AccelerateSetup(False, 1, 1, n, {Q_PROJ: LOCAL, O_PROJ: LOCAL_ROWWISE,
                                                                        DOWN_PROJ: LOCAL_ROWWISE}), None)
            # a NaN on the last tp rank only: in a row-parallel DTensor (last column), or in its plain experts
            add("tp mixed plain/DTensor nan", tp, AccelerateSetup(False, 1, 1, n, tp_plan), None,
                nan_at=(DOWN_PROJ, COLS - 1))
            add("tp experts plain nan", tp, AccelerateSetup(False, 1, 1, n, {**tp_plan, EXPERTS: LOCAL}), None,
                experts=True, nan_at=(EXPERTS, EXPERTS_PER_RANK * n * EXPERT_ROWS * COLS - 3))
        return out
