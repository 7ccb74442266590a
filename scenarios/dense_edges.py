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

* ``bf16 parameters, wider gradients`` (fp32 and fp64 runs only): the parameters in bf16, their gradients
  in the run's dtype (``grad_dtype``, as mixed-precision FSDP2 and Megatron's main grads keep them), small
  enough that eps moves the coefficient off a short binary fraction: a clip that rounds its coefficient
  to the parameter's dtype scales by a bf16 number;
* ``tied head, empty parameter``: one Parameter registered under two names (a head tied to an embedding on
  the same rank: ``named_parameters()`` yields it once, ``remove_duplicate=False`` twice) and a parameter
  with no elements, sharded into empty local gradients on every rank: a clip that walks every name counts
  the tied gradient twice, one that takes ``max()`` of every local gradient raises on the empty ones.

Every layout runs with L1, L2, L3 and inf, in every dtype of the matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from harness.cases.axes import MeshAxis
from harness.cases.variant import Variant, declared_from_layout
from harness.cases.injection import DTYPES, Injection
from harness.cases.model import install_parameter
from harness.cases.layout import Layout, MeshSpec, Shard, param
from harness.cases.scenario import Scenario, ScenarioOptions

from .dense_dp import LAYERS, dense_width

@dataclass(frozen=True)
class EdgeInfo:
    """How a dense_edges model differs from the layout's plain build."""

    param_dtype: str | None = None
    """The parameters' dtype when narrower than their gradients' (the run's dtype)."""
    aliases: tuple[tuple[str, str], ...] = ()
    """(alias, name): the Parameter ``name`` registered once more under ``alias`` (tied weights)."""


TIED_HEAD = "lm_head.weight"
EMPTY = "empty.weight"

LOSS_SCALE = 64.0
TINY_SCALE = 2.0**-14


class DenseEdges(Scenario):
    name = "dense_edges"
    summary = "the dense FSDP model with DTensor and plain parameters at once, and loss-scaled / tiny gradients"
    default_targets = ("reference", "torch", "torch-dtensor")
    default_norm_types = (1.0, 2.0, 3.0, float("inf"))

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
        out += self._edge_params(world_size, options, width, mesh, fsdp)
        return out

    def _edge_params(self, world_size: int, options: ScenarioOptions, width: int, mesh: MeshSpec,
                     fsdp: dict[str, Any]) -> list[Variant]:
        specs = []
        for i in range(LAYERS):
            specs.append(param(f"layers.{i}.weight", (width, width), **fsdp))
            specs.append(param(f"layers.{i}.bias", (width,), **fsdp))
        out = []
        if options.dtype in ("fp32", "fp64"):
            layout = Layout(mesh, tuple(specs))
            # tiny gradients: eps is then no longer negligible beside the norm, so the coefficient of a x0.5
            # bound is not 0.5 (which bf16 holds exactly) but a number a bf16 rounding moves
            out.append(Variant(label=f"dp={world_size} bf16 parameters, {options.dtype} gradients x2^-14",
                               layout=layout, injection=Injection(seed=options.seed, dtype=options.dtype,
                                                                  scale=TINY_SCALE),
                               declared=declared_from_layout(layout), invariance_key=f"dense-{width}-x{TINY_SCALE:g}",
                               info=EdgeInfo(param_dtype="bf16")))
        layout = Layout(mesh, (*specs, param(EMPTY, (0, width), **fsdp)))
        out.append(Variant(label=f"dp={world_size} tied head, empty parameter", layout=layout,
                           injection=Injection(seed=options.seed, dtype=options.dtype),
                           declared=declared_from_layout(layout), invariance_key=f"dense-{width}-x1",
                           info=EdgeInfo(aliases=((TIED_HEAD, "layers.0.weight"),))))
        return out

    def build_model(self, variant: Variant, rank: int, device: torch.device, mesh: DeviceMesh) -> nn.Module:
        model = super().build_model(variant, rank, device, mesh)
        info = variant.info if isinstance(variant.info, EdgeInfo) else EdgeInfo()
        params = dict(model.named_parameters())
        if info.param_dtype is not None:
            for p in params.values():
                p.grad_dtype = p.dtype  # the gradients stay in the run's dtype
                p.data = p.data.to(DTYPES[info.param_dtype])
        for alias, name in info.aliases:
            if name in params:
                install_parameter(model, alias, params[name])
        return model


SCENARIO = DenseEdges
TARGETS = ()  # torch's own clips are built-in targets
FRAMEWORK = None
