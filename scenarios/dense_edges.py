"""The dense FSDP model at the edges a correct clip must still get right.

The same logical gradients as ``dense_dp``'s FSDP layout (three layers of weights and biases sharded
on dim 0 over ``dp``), laid out or scaled where a clip that is right in the common case goes wrong:

* ``dtensor weights, plain replicated biases``: DTensor weights and plain, replicated biases at once,
  as a TP plan that leaves some modules unplanned does (transformers' ``tp_plan``, accelerate's TP
  path): a clip that takes only the DTensor group when any gradient is a DTensor misses the biases;
* ``plain sharded weights, replicated dtensor biases``: the other way round: FSDP-sharded plain weights
  (a framework's own sharding, DeepSpeed-style) beside Replicate DTensor biases: a clip that assumes a
  plain gradient is DP-replicated whenever a DTensor is about counts the weights once instead of
  summing their shards, and one that "unwraps" a Replicate DTensor gradient into a plain tensor of the
  same shape changes the gradient's kind (an optimizer built for the DTensors refuses the mix);
* ``loss-scaled x64``: the gradients of a loss-scaled fp16 run: every per-tensor norm and the total
  stay well inside fp16 (65504) while their squares overflow it, so a clip that accumulates squares
  in fp16 reports inf;
* ``tiny x2^-14``: gradients around fp16's smallest normal number: their squares underflow fp16, so a
  clip that accumulates squares in the gradient dtype reports far too small a norm (bf16 loses the
  precision instead).

Every layout runs with L2 and inf, in every dtype of the matrix.
"""

from __future__ import annotations

from typing import Any

from harness.cases.axes import MeshAxis
from harness.cases.variant import Variant, declared_from_layout
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, Shard, param
from harness.cases.scenario import Scenario, ScenarioOptions

from .dense_dp import LAYERS, dense_width

LOSS_SCALE = 64.0
TINY_SCALE = 2.0**-14


class DenseEdges(Scenario):
    name = "dense_edges"
    summary = "the dense FSDP model with DTensor and plain parameters at once, and loss-scaled / tiny gradients"
    default_targets = ("reference", "torch", "torch-dtensor")
    default_norm_types = (2.0, float("inf"))

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        width = dense_width(world_size)
        mesh = MeshSpec.of(dp=world_size)
        fsdp: dict[str, Any] = {MeshAxis.DP: Shard(0)}
        biases = frozenset(f"layers.{i}.bias" for i in range(LAYERS))
        out = []
        weights = frozenset(f"layers.{i}.weight" for i in range(LAYERS))
        # (label, gradient scale, DTensor parameters, the plain ones among them)
        for label, scale, mixed, plain in (
                ("dtensor weights, plain replicated biases", 1.0, True, biases),
                ("plain sharded weights, replicated dtensor biases", 1.0, True, weights),
                ("loss-scaled x64", LOSS_SCALE, False, frozenset()), ("tiny x2^-14", TINY_SCALE, False, frozenset())):
            specs = []
            for i in range(LAYERS):
                specs.append(param(f"layers.{i}.weight", (width, width), **fsdp))
                specs.append(param(f"layers.{i}.bias", (width,), **({} if mixed else fsdp)))
            layout = Layout(mesh, tuple(specs))
            out.append(Variant(
                label=f"dp={world_size} {label}",
                layout=layout,
                injection=Injection(seed=options.seed, dtype=options.dtype, scale=scale),
                declared=declared_from_layout(layout),
                invariance_key=f"dense-{width}-x{scale:g}",
                dtensor=mixed,
                plain=plain,
            ))
        return out


SCENARIO = DenseEdges
TARGETS = ()  # torch's own clips are built-in targets
FRAMEWORK = None
