"""Dense + MoE experts under DeepSpeed-style expert parallelism, clipped the DeepSpeed fp32 way.

The story (seed report ``deepspeed-autoep-fp32-clipping``): the fp32 clip takes each rank's local
norm (a root), then averages those norms over the data-parallel group. That is right only when every
rank holds the same parameters. With experts owned by different ranks, the mean of local norms is not
the norm of the unique gradients, so the same four expert gradients give a different clip
coefficient depending on how they are laid out.

Layouts (``edp`` x ``ep`` mesh; experts are separate parameters, one module each, as in DeepSpeed):

* ``ep=k`` for every valid k: expert i lives on the ranks whose ep coordinate owns it; ``ep=1`` is
  the fully replicated layout. All of them hold the same unique gradients (a metamorphic group).
* ``expert-no-grad``: one expert got no tokens, so its gradient is None on every rank holding it.
* ``gate-no-grad``: the router's gradient is None, ahead of the experts, whose replica count differs
  from its own: a clip that builds per-parameter weights for every parameter and zips them with the
  gradients that exist gives each expert its predecessor's weight.
* ``frozen-dense idle-rank``: the dense parameters are frozen (no gradient anywhere) and the experts of
  the last ep rank got no tokens, so the ranks of that ep coordinate hold no gradient at all (every
  rank still owns ``num_experts / ep`` experts, as DeepSpeed places them).
* ``nan in an expert``: a NaN in the expert of the last ep rank (not rank 0), for L2 and inf.
* ``no-expert-rank`` and ``no-expert-rank frozen-dense`` (synthetic, ``SYNTHETIC_NO_EXPERT_RANK``):
  every expert lives on ep coordinate 0 and the other ep ranks own none. DeepSpeed never places experts
  that way; kept as regression layouts for the harness's own clips, run for the adapters only with
  ``--synthetic``.

Parameters are dressed as DeepSpeed dresses them: experts get ``allreduce = False`` and
``group_name = "ep_size_<k>"``; dense parameters carry no mark.

Two clips, in our own code: ``deepspeed-style`` (local root, then the mean over the world; the same
function as the ``mutant-local-root-mean`` positive control) and ``deepspeed-style-repaired``
(sum |g|^p / replica count from the marks, one reduction, one root).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.cases.variant import Variant, declared_from_layout
from harness.clipmath import reduce_root_and_clip, trainable_with_grads, weighted_partial
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, param
from harness.targets.mutants import local_root_mean
from harness.cases.scenario import Scenario, ScenarioOptions, ep_sizes_for
from harness.cases.target import Target

NUM_EXPERTS, WIDTH = 4, 16

SYNTHETIC_NO_EXPERT_RANK = (
    "DeepSpeed gives every EP rank num_experts / ep_size experts: AutoEPMoELayer (num_local_experts = "
    "num_experts // ep_size, a uniform placement descriptor) and deepspeed.moe.layer.MoE (num_local_experts = "
    "num_experts // ep_size) alike; a rank without experts exists only as a pipeline stage without MoE layers, "
    "whose dense layers differ too and whose clip sums over the pipeline (mpu) before the average, not this layout")


def expert_name(i: int) -> str:
    return f"moe.experts.{i}.weight"


def autoep_layout(world_size: int, ep_size: int, owner_of: list[int]) -> Layout:
    """Dense params everywhere; expert i on the ranks whose ep coordinate is ``owner_of[i]``."""
    mesh = MeshSpec.of(edp=world_size // ep_size, ep=ep_size)
    specs = [
        param("dense.weight", (WIDTH, WIDTH)),
        param("moe.gate.weight", (NUM_EXPERTS, WIDTH)),
    ]
    for i, owner in enumerate(owner_of):
        specs.append(param(expert_name(i), (WIDTH, WIDTH), present_ranks=mesh.ranks_where(ep=owner)))
    return Layout(mesh, tuple(specs))


class DeepSpeedAutoEP(Scenario):
    name = "deepspeed_autoep"
    summary = "dense + per-module experts under EP with a DeepSpeed-style fp32 clip (local root, then mean)"
    uses_ep = True
    default_targets = ("deepspeed-style", "deepspeed-style-repaired", "deepspeed", "deepspeed-engine", "reference")
    default_norm_types = (2.0, float("inf"))

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        base = Injection(seed=options.seed, dtype=options.dtype)
        out = []
        sizes = ep_sizes_for(self.name, world_size, NUM_EXPERTS, options.ep_sizes)
        for ep in sizes:
            per_rank = NUM_EXPERTS // ep
            layout = autoep_layout(world_size, ep, [i // per_rank for i in range(NUM_EXPERTS)])
            sharing = "owner-sharded" if ep > 1 else "replicated"
            out.append(self._variant(sharing, layout, base, ep, "autoep"))
            # the last expert got no tokens: None on every rank that holds it
            last = expert_name(NUM_EXPERTS - 1)
            no_grad = Injection(seed=options.seed, dtype=options.dtype,
                                none_on=((last, layout.param(last).present_ranks or frozenset()),))
            out.append(self._variant(f"{sharing} expert-no-grad", layout, no_grad, ep, "autoep-nograd"))
            gate = Injection(seed=options.seed, dtype=options.dtype,
                             none_on=(("moe.gate.weight", frozenset(range(world_size))),))
            out.append(self._variant(f"{sharing} gate-no-grad", layout, gate, ep, "autoep-nogate"))
        uneven = [ep for ep in sizes if ep > 1]
        if uneven:
            ep = min(uneven)
            frozen_dense = tuple((name, frozenset(range(world_size))) for name in ("dense.weight", "moe.gate.weight"))
            per_rank = NUM_EXPERTS // ep
            layout = autoep_layout(world_size, ep, [i // per_rank for i in range(NUM_EXPERTS)])
            idle = Injection(seed=options.seed, dtype=options.dtype, none_on=frozen_dense + tuple(
                (expert_name(i), layout.param(expert_name(i)).present_ranks or frozenset())
                for i in range(NUM_EXPERTS - per_rank, NUM_EXPERTS)))
            out.append(self._variant("owner-sharded frozen-dense idle-rank", layout, idle, ep, None))
            layout = autoep_layout(world_size, ep, [0] * NUM_EXPERTS)
            out.append(self._variant("no-expert-rank", layout, base, ep, "autoep",
                                     synthetic=SYNTHETIC_NO_EXPERT_RANK))
            frozen = Injection(seed=options.seed, dtype=options.dtype, none_on=frozen_dense)
            out.append(self._variant("no-expert-rank frozen-dense", layout, frozen, ep, "autoep-frozen-dense",
                                     synthetic=SYNTHETIC_NO_EXPERT_RANK))
            ep = max(sizes)
            layout = autoep_layout(world_size, ep, [i // (NUM_EXPERTS // ep) for i in range(NUM_EXPERTS)])
            nan = Injection(seed=options.seed, dtype=options.dtype,
                            nonfinite=((expert_name(NUM_EXPERTS - 1), WIDTH * WIDTH - 3, "nan"),))
            out.append(self._variant("owner-sharded nan in an expert", layout, nan, ep, None))
        return out

    def _variant(self, kind: str, layout: Layout, injection: Injection, ep: int, key: str | None,
                 synthetic: str | None = None) -> Variant:
        return Variant(
            label=f"{layout.describe()} {kind}",
            layout=layout,
            injection=injection,
            declared=declared_from_layout(layout),
            invariance_key=key,
            ep_size=ep,
            synthetic=synthetic,
        )

    def dress(self, model: nn.Module, variant: Variant) -> None:
        for name, p in model.named_parameters():
            if name.startswith("moe.experts."):
                p.allreduce = False  # type: ignore[attr-defined]  # DeepSpeed's marks on the Parameter
                p.group_name = f"ep_size_{variant.ep_size}"  # type: ignore[attr-defined]


# -- the clips under test: DeepSpeed's fp32 arithmetic (a shared mutant) and its repair -------------------
def _replica_count(p: nn.Parameter, world: int) -> int:
    """From the DeepSpeed marks: experts live on world / ep_size ranks, dense ones on all."""
    if getattr(p, "allreduce", True) is False:
        ep_size = int(str(getattr(p, "group_name", "ep_size_1")).rsplit("_", 1)[1])
        return world // ep_size
    return world


def deepspeed_style_repaired_clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """The repair: sum |g|^p / replica count (from the marks), one all-reduce, one root."""
    params = trainable_with_grads(model)
    world = dist.get_world_size()
    local = weighted_partial(params, norm_type, lambda _, p: _replica_count(p, world))
    norm = reduce_root_and_clip(local, (p for _, p in params), max_norm=max_norm, norm_type=norm_type)
    return torch.tensor(norm, dtype=torch.float64)


DeepSpeedAutoEP.targets = {
    t.name: t
    for t in (
        Target("deepspeed-style", local_root_mean.clip,
               "DeepSpeed-style fp32 clip: rank-local root, then the mean of local norms over the world.",
               origin="scenario deepspeed_autoep", scenarios=("deepspeed_autoep",)),
        Target("deepspeed-style-repaired", deepspeed_style_repaired_clip,
               cast(str, deepspeed_style_repaired_clip.__doc__).strip(), origin="scenario deepspeed_autoep",
               scenarios=("deepspeed_autoep",)),
    )
}
