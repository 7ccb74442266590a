"""The names a drawn parameter gets: the ones real models give theirs.

Clip functions pick parameter groups by name (``bias`` and ``norm`` left out of weight decay or
counted apart, the router's ``gate``, tied ``embed`` and ``lm_head``/``output``, ``lora_A``/``lora_B``
factors, ``shared_experts``), so a clip can miscount exactly the parameters of one name. A fuzzer that
names everything ``dense0`` or ``experts0`` never meets such a clip's mistake; these names make every
one of those groups a drawn case.

Each kind of drawn parameter has the names that kind carries in real models (a dense matrix: attention
and MLP weights and biases, norms, the router, embeddings, the output head, LoRA factors, shared
experts; stacked experts; a LoRA factor shared by the experts; a per-expert module owned by one EP
rank). The name is drawn like everything else (hypothesis shrinks it towards the first, plainest
name of its kind), so a seeded search's examples moved when names came in: the catalogue's recorded
fuzz bounds were measured again.
"""

from __future__ import annotations

NAMES: dict[str, tuple[tuple[str, ...], ...]] = {
    "dense": (
        ("layer{i}.mlp.down_proj.weight", "layer{i}.self_attn.q_proj.weight", "layer{i}.self_attn.o_proj.weight",
         "layer{i}.self_attn.k_proj.weight", "layer{i}.mlp.up_proj.weight"),
        ("layer{i}.self_attn.q_proj.bias", "layer{i}.mlp.down_proj.bias"),
        ("layer{i}.input_layernorm.weight", "layer{i}.final_norm.weight", "layer{i}.attention_norm.bias", "norm.weight"),
        ("layer{i}.mlp.router.gate.weight", "layer{i}.mlp.gate.weight"),
        ("layer{i}.embed_tokens.weight", "layer{i}.tok_embeddings.weight"),
        ("layer{i}.lm_head.weight", "layer{i}.output.weight"),
        ("layer{i}.self_attn.q_proj.lora_A.weight", "layer{i}.self_attn.v_proj.lora_B.weight"),
        ("layer{i}.mlp.shared_experts.up_proj.weight",),
    ),
    "experts": (
        ("layer{i}.mlp.experts.gate_up_proj", "layer{i}.moe.routed_experts.w1"),
        ("layer{i}.mlp.experts.down_proj_lora_B",),
    ),
    "shared_lora": (
        ("layer{i}.mlp.experts.gate_proj_lora_A", "layer{i}.mlp.experts.down_proj_lora_B"),
        ("layer{i}.mlp.shared_experts.lora_A",),
    ),
    "expert_module": (
        ("layer{i}.mlp.experts.{e}.w1.weight", "layer{i}.mlp.local_experts.{e}.linear_fc1.weight"),
        ("layer{i}.mlp.experts.{e}.down_proj.bias",),
    ),
}
"""Per kind of drawn parameter, its names in groups a clip may pick by name (plain weights first, then
biases, norms, the router, embeddings, the output head, LoRA factors, shared experts): a group is
drawn first, so each comes up as often as the others, then one of its spellings (attention's q/k/o and the
MLP's up and down projections; a layer's norm or the model's final ``norm.weight``). ``{i}``: the
parameter's index in the layout, which keeps names unique, and is written ``layer0`` rather than
``layers.0`` so that blame (which groups ``layers.*`` as one group, as real models' layers share
placements) keeps each drawn parameter, placed on its own, a group of its own; ``{e}``: the EP rank
owning an expert module."""


def real_name(kind: str, index: int, group: int, spelling: int, owner: int = 0) -> str:
    """Name ``spelling`` of group ``group`` of ``kind``, for the layout's ``index``-th parameter (an
    expert module's owned by EP rank ``owner``). A spelling without ``{i}`` (a model's one top-level
    ``norm.weight``) is the first parameter's only: a later one takes its group's first spelling, so that
    names stay unique."""
    template = NAMES[kind][group][spelling]
    if "{i}" not in template and index != 0:
        template = NAMES[kind][group][0]
    return template.format(i=index, e=owner)
