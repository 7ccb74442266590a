"""Pipeline parallelism: stages hold disjoint parameters, and the norm must still be global.

Mesh ``(pp, dp)`` or ``(pp, ep)``, ``pp`` outermost as torchtitan and Megatron order it. Every layer
lives on one stage (``present_ranks``: the ranks of that ``pp`` coordinate), so a stage-local norm
misses every other stage's gradients; the norm needs one more reduction, over ``pp``.

* ``tied embedding``: the token embedding is tied to the output head, so the first and the last stage
  hold the same logical gradient (all-reduced between them, bit-identical): it counts once, not once
  per stage (Megatron-LM PR #7228, DeepSpeed PR #1252). With ``pp=1`` it is the single-stage control;
  every ``pp`` split holds the same logical gradients, so every correct clip gives them one norm.
* ``untied``: the same stages with a separate output head on the last stage (what torchtitan builds
  under PP, where it refuses weight tying): every parameter on exactly one stage.
* ``moe stages``: with ``ep > 1``, stage 0 is dense only (embedding and the first layers), the later
  stages hold experts sharded over ``ep``: the ranks of a dense-only stage have no expert gradient at
  all and must still join every reduction (torchtitan PRs #1541 and #2270: ``get_total_norm([])``).
"""

from __future__ import annotations

from typing import Any

from harness.cases.axes import MeshAxis
from harness.cases.variant import Variant, declared_from_layout
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, ParamSpec, Shard, param
from harness.cases.scenario import Scenario, ScenarioOptions, ep_sizes_for

WIDTH, VOCAB, NUM_EXPERTS = 16, 32, 8
DENSE_LAYERS = 8
MOE_LAYERS = 4  # layers 0-1 dense, 2-3 MoE: stage 0 never holds an expert


def _stage(layer: int, layers: int, pp: int) -> int:
    return layer * pp // layers


def _dense_layout(world_size: int, pp: int, tied: bool = True) -> Layout:
    mesh = MeshSpec.of(pp=pp, dp=world_size // pp)
    fsdp: dict[str, Any] = {MeshAxis.DP: Shard(0)}
    last = pp - 1
    specs = [param("tok_embeddings.weight", (VOCAB, WIDTH),
                   present_ranks=mesh.ranks_on(MeshAxis.PP, (0, last) if tied else (0,)), **fsdp)]
    for i in range(DENSE_LAYERS):
        on_stage = mesh.ranks_on(MeshAxis.PP, (_stage(i, DENSE_LAYERS, pp),))
        specs.append(param(f"layers.{i}.attention.weight", (WIDTH, WIDTH), present_ranks=on_stage, **fsdp))
        specs.append(param(f"layers.{i}.attention_norm.weight", (WIDTH,), present_ranks=on_stage))
    specs.append(param("norm.weight", (WIDTH,), present_ranks=mesh.ranks_on(MeshAxis.PP, (last,))))
    if not tied:
        specs.append(param("output.weight", (VOCAB, WIDTH), present_ranks=mesh.ranks_on(MeshAxis.PP, (last,)), **fsdp))
    return Layout(mesh, tuple(specs))


def _moe_layout(pp: int, ep: int) -> Layout:
    mesh = MeshSpec.of(pp=pp, ep=ep)
    last = pp - 1
    specs: list[ParamSpec] = [
        param("tok_embeddings.weight", (VOCAB, WIDTH), present_ranks=mesh.ranks_on(MeshAxis.PP, (0, last)))]
    for i in range(MOE_LAYERS):
        on_stage = mesh.ranks_on(MeshAxis.PP, (_stage(i, MOE_LAYERS, pp),))
        specs.append(param(f"layers.{i}.attention.weight", (WIDTH, WIDTH), present_ranks=on_stage))
        if i >= 2:
            specs.append(param(f"layers.{i}.moe.router.weight", (NUM_EXPERTS, WIDTH), present_ranks=on_stage))
            specs.append(param(f"layers.{i}.moe.experts.w1", (NUM_EXPERTS, WIDTH, WIDTH), present_ranks=on_stage,
                               ep=Shard(0)))
    return Layout(mesh, tuple(specs))


class PipelineStages(Scenario):
    name = "pipeline_stages"
    summary = "pp stages with disjoint params, an embedding tied across first and last, dense-only stages"
    uses_ep = True
    default_targets = ("reference", "torch", "torchtitan-pp")
    default_norm_types = (2.0, float("inf"))

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        injection = Injection(seed=options.seed, dtype=options.dtype)
        eps = ep_sizes_for(self.name, world_size, NUM_EXPERTS, options.ep_sizes)
        out = []

        def add(layout: Layout, label: str, key: str, ep: int | None) -> None:
            out.append(Variant(label=f"{layout.mesh.describe()} {label}", layout=layout, injection=injection,
                               declared=declared_from_layout(layout), invariance_key=key, ep_size=ep))

        if 1 in eps:
            for pp in (k for k in range(1, world_size + 1) if world_size % k == 0 and WIDTH % (world_size // k) == 0):
                add(_dense_layout(world_size, pp), "tied embedding", "pp-dense", None)
                add(_dense_layout(world_size, pp, tied=False), "untied", "pp-dense-untied", None)
        for ep in (k for k in eps if k > 1 and world_size // k >= 2):
            add(_moe_layout(world_size // ep, ep), "moe stages", "pp-moe", ep)
        return out


SCENARIO = PipelineStages
TARGETS = ()
FRAMEWORK = None
