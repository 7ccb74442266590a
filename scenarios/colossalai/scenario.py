"""Dense + MoE experts under ColossalAI's MoE hybrid-parallel plugin with ZeRO-1.

ColossalAI's ``MoeHybridParallelPlugin`` lays the ranks out as ``(moe_dp, pp, ep, tp, sp)`` (ep faster
than moe_dp); with tp = pp = sp = 1 that is the mesh ``edp x ep`` here (``edp`` is ColossalAI's
``moe_dp``, the ranks holding the same experts). Its ZeRO optimizer
(``MoeHybridParallelZeroOptimizer``) keeps two gradient stores: the dense parameters partitioned over
the whole data-parallel group (``moe_dp x ep``), the experts (``is_moe_tensor``: an ``ep_group``
attribute) over ``moe_dp`` only. ``LowLevelZeroOptimizer.step`` computes one norm per store and adds
them (``norm_group += self._compute_grad_norm(...)``), and the expert store's norm is reduced over
``moe_dp`` only, never over ``ep`` (§6 rows 32, 33).

Layouts (4 experts, one module each, as ColossalAI's EP MoE blocks hold ``experts[start:end]``):

* ``dp=W dense-zero``: no experts, ``HybridParallelPlugin`` with ZeRO-1 over all ranks: one store,
  the control.
* ``edp=W/k ep=k moe-zero`` for every k: expert i on the ranks whose ep coordinate owns it; at
  ``ep=1`` ColossalAI's two groups are one and the same object, so the optimizer keeps one store
  (correct); at ``ep>1`` the two stores' norms are added and the experts' one misses the other EP
  ranks. All of them hold the same unique gradients (a metamorphic group).
* ``... moe-zero frozen-dense``: the dense parameters are frozen, so the dense store is empty and only
  the missing EP reduction is left (ColossalAI #2192's symptom: a rank-dependent norm).

``dense.bias`` has 15 elements, so ZeRO pads it to split over the group.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.cases.axes import MeshAxis
from harness.cases.variant import Variant, declared_from_layout
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, ParamSpec, param
from harness.cases.scenario import Scenario, ScenarioOptions, ep_sizes_for

NUM_EXPERTS, WIDTH = 4, 16
EXPERT_PREFIX = "moe.experts."


@dataclass(frozen=True)
class ColossalAISetup:
    """Which ColossalAI plugin sets the case up: ``MoeHybridParallelPlugin`` (experts, ``ep_size``)
    or ``HybridParallelPlugin`` (dense only; the MoE optimizer refuses a model without experts)."""

    moe: bool
    ep_size: int = 1


def expert_name(i: int) -> str:
    return f"{EXPERT_PREFIX}{i}.weight"


def _dense(trainable: bool) -> list[ParamSpec]:
    return [
        param("dense.weight", (WIDTH, WIDTH), trainable=trainable),
        param("dense.bias", (WIDTH - 1,), trainable=trainable),
        param("moe.gate.weight", (NUM_EXPERTS, WIDTH), trainable=trainable),
    ]


def moe_layout(world_size: int, ep: int, dense_trainable: bool = True) -> Layout:
    mesh = MeshSpec.of(**{MeshAxis.EDP: world_size // ep, MeshAxis.EP: ep})
    per_rank = NUM_EXPERTS // ep
    specs = _dense(dense_trainable)
    for i in range(NUM_EXPERTS):
        owners = mesh.ranks_where(**{MeshAxis.EP: i // per_rank})
        specs.append(param(expert_name(i), (WIDTH, WIDTH), present_ranks=owners))
    return Layout(mesh, tuple(specs))


def dense_layout(world_size: int) -> Layout:
    return Layout(MeshSpec.of(**{MeshAxis.DP: world_size}), tuple(_dense(True)))


class ColossalAIMoE(Scenario):
    name = "colossalai_moe"
    summary = ("dense + experts under ColossalAI's MoE hybrid plugin, ZeRO-1: per-store norms added, "
               "experts not reduced over EP")
    uses_ep = True
    default_targets = ("colossalai", "reference")
    default_norm_types = (2.0, float("inf"))

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        injection = Injection(seed=options.seed, dtype=options.dtype)
        dense = dense_layout(world_size)
        out = [self._variant(f"{dense.describe()} dense-zero", dense, injection, None, ColossalAISetup(moe=False))]
        for ep in ep_sizes_for(self.name, world_size, NUM_EXPERTS, options.ep_sizes):
            layout = moe_layout(world_size, ep)
            out.append(self._variant(f"{layout.describe()} moe-zero", layout, injection, "cai-moe",
                                     ColossalAISetup(moe=True, ep_size=ep)))
            frozen = moe_layout(world_size, ep, dense_trainable=False)
            out.append(self._variant(f"{frozen.describe()} moe-zero frozen-dense", frozen, injection, "cai-frozen",
                                     ColossalAISetup(moe=True, ep_size=ep)))
        return out

    def _variant(self, label: str, layout: Layout, injection: Injection, key: str | None,
                 setup: ColossalAISetup) -> Variant:
        return Variant(label=label, layout=layout, injection=injection, declared=declared_from_layout(layout),
                       invariance_key=key, ep_size=setup.ep_size, info=setup)
