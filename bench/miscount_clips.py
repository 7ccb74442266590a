"""Clip functions that miscount exactly one small group of parameters.

Written from the public contract only (docs/writing-a-target.md, docs/python-api.md):

    fn(model, *, max_norm, norm_type) -> total_norm

``correct`` counts every logical gradient exactly once across the world (the true layout's replica
count de-duplicates replicas; shards are summed by one all-reduce over the default process group),
returns the same value on every rank and scales the gradients in place by
``min(1, max_norm / (total + 1e-6))``.

Every other clip is ``correct`` with ONE miscount of ONE group of parameters, picked by name
(``GROUP_OF[fn_name](param_name) -> bool``). Where a layout has no parameter of a clip's group, that
clip is correct there. ``MISCOUNTS`` describes each clip's group and mistake.

Use as ``--target bench/miscount_clips.py:NAME``.
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist

import harness


# --------------------------------------------------------------------------------------------------
# the shared arithmetic
# --------------------------------------------------------------------------------------------------

def _local_grad(param):
    grad = param.grad
    if grad is None:
        return None
    if hasattr(grad, "to_local"):          # DTensor gradient: this rank's piece
        grad = grad.to_local()
    return grad


def _clip(model, max_norm, norm_type, adjust=None):
    """The clip; ``adjust(ctx, model, name, weight) -> weight`` may change how much of this rank's
    copy of ``name`` is counted (``weight`` is the correct share, 1 / true replica count; for the
    inf norm only ``weight > 0`` matters: a counted gradient takes part in the MAX)."""
    ctx = harness.context(model)
    p = float(norm_type)
    is_inf = math.isinf(p)
    device = ctx.device
    acc = torch.zeros((), dtype=torch.float64, device=device)
    for name, param in model.named_parameters():
        grad = _local_grad(param)
        if grad is None or grad.numel() == 0:
            continue
        weight = 1.0 / ctx.true_replica_count(name)
        if adjust is not None:
            weight = adjust(ctx, model, name, weight)
        if weight == 0:
            continue
        g = grad.detach().to(device=device, dtype=torch.float64).abs()
        if is_inf:
            acc = torch.maximum(acc, g.max())              # NaN propagates
        else:
            acc = acc + g.pow(p).sum() * weight
    if is_inf:
        # MAX of the local maxima, and a NaN flag (a MAX reduction need not propagate NaN)
        packed = torch.stack([torch.where(torch.isnan(acc), torch.zeros_like(acc), acc),
                              torch.isnan(acc).to(torch.float64)])
        dist.all_reduce(packed, op=dist.ReduceOp.MAX)
        total_t = packed[0] if float(packed[1]) == 0.0 else torch.tensor(float("nan"), dtype=torch.float64)
    else:
        dist.all_reduce(acc, op=dist.ReduceOp.SUM)
        total_t = acc.pow(1.0 / p)
    total = float(total_t)
    coef = max_norm / (total + 1e-6)
    if not math.isnan(coef):
        coef = min(1.0, coef)
    for param in model.parameters():
        if param.grad is not None:
            param.grad.mul_(coef)                          # DTensor grads scale in place too
    return total


def correct(model, *, max_norm, norm_type=2.0):
    """Correct: every logical gradient counted exactly once (true replica count), p-norm or inf."""
    return _clip(model, max_norm, norm_type)


# --------------------------------------------------------------------------------------------------
# the groups (predicates on parameter names, as `clipcheck layouts` shows them)
# --------------------------------------------------------------------------------------------------

def _components(name):
    return name.split(".")


def is_bias(name):
    return name.endswith(".bias") or name == "bias"


def is_norm(name):
    """LayerNorm / RMSNorm weights: a module whose name contains 'norm' (input_layernorm,
    attention_norm, sa_norm, mlp_norm, the final norm, layers.N.norm)."""
    return any("norm" in part for part in _components(name)[:-1])


def is_router(name):
    """The MoE router / gate (a module named exactly 'gate' or 'router'; not gate_proj, gate_up)."""
    return any(part in ("gate", "router") for part in _components(name)[:-1])


def is_embed_tokens(name):
    return "embed_tokens" in name


def is_output_head(name):
    return name in ("output.weight", "lm_head.weight") or name.endswith(".lm_head.weight") \
        or name.startswith("output.") or name.startswith("lm_head.")


def is_lora_a(name):
    return "lora_A" in name


def is_lora_b(name):
    return "lora_B" in name


def is_shared(name):
    """Shared-expert / shared-adapter weights (e.g. routed_experts.inner_experts.shared_lora_A)."""
    return "shared" in name


def is_q_proj(name):
    return bool(re.search(r"(^|\.)(q_proj|wq|linear_qkv)(\.|$)", name))


def is_tok_embeddings(name):
    return "tok_embeddings" in name


def is_any_embedding(name):
    return "tok_embeddings" in name or "embed_tokens" in name


def is_numbered_expert(name):
    """DeepSpeed / ColossalAI style expert modules: moe.experts.<i>.*"""
    return bool(re.search(r"(^|\.)experts\.\d+\.", name))


def is_row_parallel_proj(name):
    """Attention output projections (row-parallel under TP): o_proj, output_proj, linear_proj."""
    return bool(re.search(r"(^|\.)(o_proj|output_proj|linear_proj)(\.|$)", name))


_EXPERT_DOWN = re.compile(r"\.\w*experts\.(.*\.)?(down_proj|down_projs|w2_EDF|w2|linear_fc2|down_linear)(\.|$|\d)")
_EXPERT_UP = re.compile(r"\.\w*experts\.(.*\.)?(gate_up_proj|gate_and_up_projs|w1_EFD|w1|linear_fc1|gate_up_linear)(\.|$|\d)")


def is_expert_down(name):
    """Fused routed-expert down projections (not their LoRA factors)."""
    return "lora" not in name and bool(_EXPERT_DOWN.search("." + name))


def is_expert_up(name):
    """Fused routed-expert gate/up (fc1) projections (not their LoRA factors)."""
    return "lora" not in name and bool(_EXPERT_UP.search("." + name))


def is_gate_proj_lora(name):
    return "gate_proj" in name and "lora" in name


def is_up_proj(name):
    """MLP up projections: a module or factor named up_proj* (not gate_up_proj, gate_and_up_projs)
    and torchtune's mlp.w3."""
    return bool(re.search(r"(^|\.)up_proj", name)) or bool(re.search(r"(^|\.)mlp\.w3\.", name))


def is_k_v_proj(name):
    return bool(re.search(r"(^|\.)(k_proj|v_proj|wk|wv)(\.|$)", name))


def is_final_norm(name):
    """The final norm before the head (top-level norm.*)."""
    return name.startswith("norm.")


def is_input_layernorm(name):
    return "input_layernorm" in name


# --------------------------------------------------------------------------------------------------
# the adjustments (one kind of miscount each)
# --------------------------------------------------------------------------------------------------

def _twice(pred):
    return lambda ctx, model, name, w: 2.0 * w if pred(name) else w


def _left_out(pred):
    return lambda ctx, model, name, w: 0.0 if pred(name) else w


def _replicas_summed(pred):
    """Every rank's copy counted in full: replicas not de-duplicated."""
    return lambda ctx, model, name, w: 1.0 if pred(name) else w


def _replica_leader_after_dedup(pred):
    """Divided by the replica count AND counted only on the first rank holding that slice: 1/k."""
    def adjust(ctx, model, name, w):
        if not pred(name):
            return w
        layout = ctx.layout
        spec = ctx.param_spec(name)
        holders = layout.holders(spec, layout.local_box(spec, ctx.rank))
        return w if ctx.rank == min(holders) else 0.0
    return adjust


def _only_rank0_as_if_replicated(pred):
    """Treated as replicated over the whole world: rank 0's copy counted in full, other ranks' not."""
    return lambda ctx, model, name, w: (1.0 if ctx.rank == 0 else 0.0) if pred(name) else w


def _divided_by_axis(pred, axis):
    """Treated as duplicated over `axis` too: divided by its size once more."""
    return lambda ctx, model, name, w: w / ctx.group_size(axis) if pred(name) else w


def _only_first_on_axis(pred, axis):
    """Counted only on the ranks whose coordinate on `axis` is 0 (the others' shards dropped)."""
    def adjust(ctx, model, name, w):
        if not pred(name) or not ctx.mesh_spec.has(axis) or ctx.group_size(axis) == 1:
            return w
        coord = ctx.mesh.get_coordinate()
        index = list(ctx.mesh.mesh_dim_names).index(str(getattr(axis, "value", axis)))
        return w if coord[index] == 0 else 0.0
    return adjust


def _tied_counted_again_as_head(pred):
    """Where this rank's model has no output head, the embedding is taken as tied and counted again
    for the head: counted twice."""
    def adjust(ctx, model, name, w):
        if not pred(name):
            return w
        has_head = any(is_output_head(n) for n, _ in model.named_parameters())
        return w if has_head else 2.0 * w
    return adjust


# --------------------------------------------------------------------------------------------------
# the twenty miscounting clips
# --------------------------------------------------------------------------------------------------

def biases_counted_twice(model, *, max_norm, norm_type=2.0):
    """Biases (*.bias) counted twice (a second pass over 'no weight decay' params adds them again)."""
    return _clip(model, max_norm, norm_type, _twice(is_bias))


def norm_weights_left_out(model, *, max_norm, norm_type=2.0):
    """LayerNorm/RMSNorm weights left out of the norm (filtered like weight-decay exclusions)."""
    return _clip(model, max_norm, norm_type, _left_out(is_norm))


def router_gate_counted_twice(model, *, max_norm, norm_type=2.0):
    """The MoE router/gate counted twice (once as a dense param, once in the MoE group)."""
    return _clip(model, max_norm, norm_type, _twice(is_router))


def embed_tokens_replicas_summed(model, *, max_norm, norm_type=2.0):
    """embed_tokens counted once per replica (e.g. per TP rank) instead of once."""
    return _clip(model, max_norm, norm_type, _replicas_summed(is_embed_tokens))


def output_head_counted_twice(model, *, max_norm, norm_type=2.0):
    """The output head (output.weight / lm_head) counted twice."""
    return _clip(model, max_norm, norm_type, _twice(is_output_head))


def lora_A_counted_on_one_replica_after_dedup(model, *, max_norm, norm_type=2.0):
    """LoRA A factors divided by their replica count AND counted only on the first holder: 1/k."""
    return _clip(model, max_norm, norm_type, _replica_leader_after_dedup(is_lora_a))


def shared_params_left_out(model, *, max_norm, norm_type=2.0):
    """Shared-expert / shared-adapter weights (*shared*) left out of the norm."""
    return _clip(model, max_norm, norm_type, _left_out(is_shared))


def q_proj_counted_only_on_rank0(model, *, max_norm, norm_type=2.0):
    """Query projections taken as replicated: only rank 0's shard counted (in full)."""
    return _clip(model, max_norm, norm_type, _only_rank0_as_if_replicated(is_q_proj))


def tied_embedding_counted_on_both_stages(model, *, max_norm, norm_type=2.0):
    """tok_embeddings counted on every holder (both pipeline stages of a tied embedding), not once."""
    return _clip(model, max_norm, norm_type, _replicas_summed(is_tok_embeddings))


def tied_embedding_counted_again_as_head(model, *, max_norm, norm_type=2.0):
    """The embedding counted twice wherever the rank's model has no separate output head."""
    return _clip(model, max_norm, norm_type, _tied_counted_again_as_head(is_any_embedding))


def numbered_experts_replicas_summed(model, *, max_norm, norm_type=2.0):
    """Expert modules experts.<i>.* counted on every expert-data-parallel replica, not once."""
    return _clip(model, max_norm, norm_type, _replicas_summed(is_numbered_expert))


def lora_B_left_out(model, *, max_norm, norm_type=2.0):
    """LoRA B factors left out of the norm (only lora_A matched the adapter filter)."""
    return _clip(model, max_norm, norm_type, _left_out(is_lora_b))


def row_parallel_proj_divided_by_tp(model, *, max_norm, norm_type=2.0):
    """Attention output projections (o_proj/output_proj/linear_proj) divided by the TP size once more."""
    return _clip(model, max_norm, norm_type, _divided_by_axis(is_row_parallel_proj, "tp"))


def expert_down_proj_only_first_ep_rank(model, *, max_norm, norm_type=2.0):
    """Routed-expert down projections counted only on EP rank 0 (other EP ranks' experts dropped)."""
    return _clip(model, max_norm, norm_type, _only_first_on_axis(is_expert_down, "ep"))


def gate_proj_lora_replicas_summed(model, *, max_norm, norm_type=2.0):
    """gate_proj LoRA factors counted once per replica (e.g. per EP rank when shared) instead of once."""
    return _clip(model, max_norm, norm_type, _replicas_summed(is_gate_proj_lora))


def up_proj_counted_twice(model, *, max_norm, norm_type=2.0):
    """MLP up projections (up_proj, its LoRA factors, mlp.w3) counted twice."""
    return _clip(model, max_norm, norm_type, _twice(is_up_proj))


def k_v_proj_left_out(model, *, max_norm, norm_type=2.0):
    """Key/value projections (k_proj, v_proj) left out of the norm."""
    return _clip(model, max_norm, norm_type, _left_out(is_k_v_proj))


def final_norm_replicas_summed(model, *, max_norm, norm_type=2.0):
    """The final norm (norm.*) counted once per replica instead of once."""
    return _clip(model, max_norm, norm_type, _replicas_summed(is_final_norm))


def input_layernorm_tp_duplicates_summed(model, *, max_norm, norm_type=2.0):
    """input_layernorm weights counted on every rank holding a copy (TP/DP duplicates not skipped)."""
    return _clip(model, max_norm, norm_type, _replicas_summed(is_input_layernorm))


def expert_up_proj_divided_by_ep(model, *, max_norm, norm_type=2.0):
    """Routed-expert gate/up (fc1) projections divided by the EP size (taken as EP-replicated)."""
    return _clip(model, max_norm, norm_type, _divided_by_axis(is_expert_up, "ep"))


# --------------------------------------------------------------------------------------------------
# the catalogue
# --------------------------------------------------------------------------------------------------

MISCOUNTS = {
    "biases_counted_twice": "*.bias: counted twice",
    "norm_weights_left_out": "norm weights (a module name containing 'norm'): left out",
    "router_gate_counted_twice": "MoE router/gate (a module named 'gate' or 'router'): counted twice",
    "embed_tokens_replicas_summed": "embed_tokens: every replica counted (not de-duplicated)",
    "output_head_counted_twice": "output.weight / lm_head: counted twice",
    "lora_A_counted_on_one_replica_after_dedup": "*lora_A*: divided by the replica count and counted only on the first holder (1/k)",
    "shared_params_left_out": "*shared* (shared experts / shared adapters): left out",
    "q_proj_counted_only_on_rank0": "q_proj / wq / linear_qkv: only rank 0's local copy counted, in full (taken as replicated)",
    "tied_embedding_counted_on_both_stages": "tok_embeddings: every holder counted (tied copies on both stages not de-duplicated)",
    "tied_embedding_counted_again_as_head": "tok_embeddings / embed_tokens: counted twice where the rank's model has no output head",
    "numbered_experts_replicas_summed": "experts.<i>.*: every expert-data-parallel replica counted (not de-duplicated)",
    "lora_B_left_out": "*lora_B*: left out",
    "row_parallel_proj_divided_by_tp": "o_proj / output_proj / linear_proj: divided by the tp size once more",
    "expert_down_proj_only_first_ep_rank": "fused expert down projections under a *experts module (down_proj, down_projs, w2_EDF, linear_fc2, down_linear; not LoRA): counted only on ep coordinate 0",
    "gate_proj_lora_replicas_summed": "gate_proj LoRA factors: every replica counted (not de-duplicated)",
    "up_proj_counted_twice": "a module/factor named up_proj* (not gate_up_proj, gate_and_up_projs) and mlp.w3: counted twice",
    "k_v_proj_left_out": "k_proj / v_proj / wk / wv: left out",
    "final_norm_replicas_summed": "norm.* (final norm): every replica counted (not de-duplicated)",
    "input_layernorm_tp_duplicates_summed": "*input_layernorm*: every replica counted (not de-duplicated)",
    "expert_up_proj_divided_by_ep": "fused expert gate/up projections under a *experts module (gate_up_proj, gate_and_up_projs, w1_EFD, w1, linear_fc1, gate_up_linear; not LoRA): divided by the ep size",
}

GROUP_OF = {
    "biases_counted_twice": is_bias,
    "norm_weights_left_out": is_norm,
    "router_gate_counted_twice": is_router,
    "embed_tokens_replicas_summed": is_embed_tokens,
    "output_head_counted_twice": is_output_head,
    "lora_A_counted_on_one_replica_after_dedup": is_lora_a,
    "shared_params_left_out": is_shared,
    "q_proj_counted_only_on_rank0": is_q_proj,
    "tied_embedding_counted_on_both_stages": is_tok_embeddings,
    "tied_embedding_counted_again_as_head": is_any_embedding,
    "numbered_experts_replicas_summed": is_numbered_expert,
    "lora_B_left_out": is_lora_b,
    "row_parallel_proj_divided_by_tp": is_row_parallel_proj,
    "expert_down_proj_only_first_ep_rank": is_expert_down,
    "gate_proj_lora_replicas_summed": is_gate_proj_lora,
    "up_proj_counted_twice": is_up_proj,
    "k_v_proj_left_out": is_k_v_proj,
    "final_norm_replicas_summed": is_final_norm,
    "input_layernorm_tp_duplicates_summed": is_input_layernorm,
    "expert_up_proj_divided_by_ep": is_expert_up,
}

assert set(MISCOUNTS) == set(GROUP_OF) and len(MISCOUNTS) == 20
