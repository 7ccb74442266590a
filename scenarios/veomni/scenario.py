"""VeOmni's MoE layouts: experts on its ``(ep_fsdp, ep)`` mesh, the rest FSDP2/HSDP on ``(dp_replicate,
dp_shard)``, optionally a shared MoE LoRA (``LoraSharedExperts``, VeOmni's "Mode 2") on the experts.

VeOmni's clip (``veomni/distributed/fsdp2/clip_grad_norm.py``, ``extra_parallel_fsdp2_clip_grad_norm``)
keeps three buckets: the dense ("non extra parallel") one, all-reduced over the FSDP shard group only
(``_fsdp_grad_norm_reduce_groups``: under HSDP the replicate side is skipped, the fix of VeOmni #184 /
PRs #185, #862); the EP one (``_extra_parallel_param_groups["ep"]``, parameters whose DTensor mesh has
``ep_fsdp``), all-reduced over ``ep_fsdp`` then ``ep``; and the "replicated" one, the ``LoraSharedExperts``
factors found by an MRO class-name scan (``veomni/optim/optimizer.py``, the fix of the PR #758 review
finding that they were summed over EP), all-reduced over ``ep_fsdp`` only: the EP reduction is *skipped*,
which is right only while the factors' gradients really are identical on every EP rank (VeOmni keeps
them so with a post-accumulate-grad SUM hook over EP installed at the first forward).

Layouts (every one at HSDP ``dp_replicate=2`` too, where the world allows a shard side of 2 or more):

* ``experts``: trainable dense weights and experts (the control; right at every ep, HSDP included).
* ``shared-lora``: the experts' base weights frozen, a shared LoRA on them, its gradients identical
  on every EP rank (what VeOmni's SUM hook produces). Right at every ep.
* ``shared-lora differing`` (ep > 1), **synthetic**: the same, but the shared factors' gradients differ
  from EP rank to EP rank. VeOmni's post-accumulate-grad hook SUMs them over EP in every backward, so no
  training path reaches this; it runs only with ``--synthetic`` (gradients written into ``.grad`` after
  the setup, the hook never runs), a regression layout for the clip's assumption: it skips the EP
  reduction for that bucket, so every EP rank would report its *own* norm and the ranks would clip by
  different coefficients (VeOmni's ``veomni/distributed/fsdp2/clip_grad_norm.py``, its replicated bucket;
  xorl's mean-over-EP instead gives one wrong value on every rank).
* ``experts nan``: a NaN in an expert gradient on the last EP rank. The L2 path reports NaN on every
  rank; the inf path takes the per-bucket maxima through a MAX all-reduce, and gloo's MAX keeps a NaN
  only when it arrives first (rank 0), so every rank reports a finite norm without that rank's experts.

Mesh axes are ``(dp_replicate, ep_fsdp, ep)``, outermost first, which is VeOmni's own rank order: its
dense mesh is ``(dp_replicate, dp_shard)`` and its expert mesh ``(ep_replicate, ep_fsdp, ep)`` with ``ep``
innermost, so a dense FSDP shard index is ``ep_fsdp * ep_size + ep`` (dim 0 sharded by ``ep_fsdp`` then
``ep``, nested). With ep = 1 VeOmni does not build EP at all: the experts are FSDP-sharded on dim 0 with
the rest of their decoder layer, and the clip is ``torch.nn.utils.clip_grad_norm_`` on one mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.cases.axes import MeshAxis
from harness.cases.variant import Variant, declared_from_layout
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, ParamSpec, Replicate, Shard, param
from harness.cases.scenario import Scenario, ScenarioOptions, ep_sizes_for

NUM_EXPERTS, HIDDEN, INTERMEDIATE, Q_OUT, LORA_RANK = 8, 16, 8, 16, 8
LAYER = "model.layers.0."
EXPERTS = LAYER + "mlp.experts."
ADAPTER = "default"
DENSE = (
    (LAYER + "self_attn.q_proj.weight", (Q_OUT, HIDDEN)),
    (LAYER + "input_layernorm.weight", (HIDDEN,)),
    (LAYER + "mlp.gate.weight", (NUM_EXPERTS, HIDDEN)),
)
BASE = {"gate_up_proj": (NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN), "down_proj": (NUM_EXPERTS, HIDDEN, INTERMEDIATE)}
# LoraSharedExperts' 2-D factors: A [r, in], B [out, r]; gate/up: in H, out I; down: in I, out H
LORA = {
    "gate_proj": ((LORA_RANK, HIDDEN), (INTERMEDIATE, LORA_RANK)),
    "up_proj": ((LORA_RANK, HIDDEN), (INTERMEDIATE, LORA_RANK)),
    "down_proj": ((LORA_RANK, INTERMEDIATE), (HIDDEN, LORA_RANK)),
}
DIFFERING_SYNTHETIC = (
    "LoraSharedExperts installs a post-accumulate-grad hook at its first forward that SUMs each shared factor's "
    "gradient over the EP group in every backward, so VeOmni's clip never sees shared-factor gradients that differ "
    "between EP ranks")
EXPERTS_KIND, LORA_KIND, DIFFERING_KIND, NAN_KIND = "experts", "shared-lora", "shared-lora differing", "experts nan"


@dataclass(frozen=True)
class VeomniSetup:
    """What the VeOmni adapter builds: ``init_parallel_state`` sizes and whether the experts carry a
    shared LoRA (``apply_shared_moe_lora``)."""

    dp_replicate: int
    dp_shard: int
    ep: int
    shared_lora: bool


def lora_names() -> list[tuple[str, tuple[int, int]]]:
    out = []
    for spec, (a_shape, b_shape) in LORA.items():
        out.append((f"{EXPERTS}{spec}.lora_A.{ADAPTER}.weight", a_shape))
        out.append((f"{EXPERTS}{spec}.lora_B.{ADAPTER}.weight", b_shape))
    return out


def veomni_layout(replicate: int, shard: int, ep: int, shared_lora: bool, differing: bool) -> Layout:
    mesh = MeshSpec.of(dp_replicate=replicate, ep_fsdp=shard // ep, ep=ep)
    over_shard: dict[str, Any] = {MeshAxis.EP_FSDP: Shard(0), MeshAxis.EP: Shard(0)}  # VeOmni's dp_shard, nested
    specs: list[ParamSpec] = [param(name, shape, dp_replicate=Replicate(), **over_shard) for name, shape in DENSE]
    # ep > 1: ParallelPlan.apply slices dim 0 over ep, fully_shard(experts, ep_fsdp mesh) shards dim 1;
    # ep = 1: the experts are FSDP-sharded on dim 0 with their decoder layer
    expert_place: dict[str, Any] = ({MeshAxis.EP: Shard(0), MeshAxis.EP_FSDP: Shard(1)} if ep > 1 else over_shard)
    for base, shape in BASE.items():
        name = f"{EXPERTS}{base}.base_layer.weight" if shared_lora else EXPERTS + base
        specs.append(param(name, shape, trainable=not shared_lora, dp_replicate=Replicate(), **expert_place))
    if shared_lora:
        for name, factor in lora_names():
            if ep == 1:
                specs.append(param(name, factor, dp_replicate=Replicate(), **over_shard))
            elif differing:  # each EP rank holds its own gradient: a distinct slice of a taller logical tensor
                specs.append(param(name, (ep * factor[0], factor[1]), dp_replicate=Replicate(),
                                   ep=Shard(0), ep_fsdp=Shard(1)))
            else:
                specs.append(param(name, factor, dp_replicate=Replicate(), ep=Replicate(), ep_fsdp=Shard(1)))
    return Layout(mesh, tuple(specs))


class VeomniEP(Scenario):
    name = "veomni_ep"
    summary = "VeOmni MoE: experts on (ep_fsdp, ep), dense FSDP2/HSDP, optional shared MoE LoRA"
    uses_ep = True
    default_targets = ("veomni", "reference")
    default_norm_types = (2.0, float("inf"))

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        injection = Injection(seed=options.seed, dtype=options.dtype)
        eps = ep_sizes_for(self.name, world_size, NUM_EXPERTS, options.ep_sizes)
        out = []
        for replicate in (1, 2):
            if world_size % replicate or (replicate > 1 and world_size // replicate < 2):
                continue
            shard = world_size // replicate
            for ep in (k for k in eps if shard % k == 0):
                kinds = [EXPERTS_KIND, LORA_KIND] + ([DIFFERING_KIND] if ep > 1 else [])
                for kind in kinds:
                    out.append(self._variant(replicate, shard, ep, kind, injection))
        largest = max((k for k in eps), default=1)
        nan_layout = veomni_layout(1, world_size, largest, False, False)
        last_expert = next(s for s in nan_layout if s.name == EXPERTS + "down_proj")
        nan = Injection(seed=options.seed, dtype=options.dtype,
                        nonfinite=((last_expert.name, last_expert.numel - 3, "nan"),))
        out.append(self._variant(1, world_size, largest, NAN_KIND, nan))
        return out

    def _variant(self, replicate: int, shard: int, ep: int, kind: str, injection: Injection) -> Variant:
        lora = kind in (LORA_KIND, DIFFERING_KIND)
        differing = kind == DIFFERING_KIND
        layout = veomni_layout(replicate, shard, ep, lora, differing)
        declared = declared_from_layout(layout)
        if differing:  # VeOmni's belief: LoraSharedExperts factors are replicated over ep
            for name, _ in lora_names():
                declared[name][MeshAxis.EP] = Replicate()
        key = None if kind in (DIFFERING_KIND, NAN_KIND) else f"veomni-{kind}"
        return Variant(
            label=f"{layout.describe()} {kind}",
            layout=layout,
            injection=injection,
            declared=declared,
            invariance_key=key,
            ep_size=ep,
            info=VeomniSetup(replicate, shard, ep, lora),
            synthetic=DIFFERING_SYNTHETIC if differing else None,
        )
