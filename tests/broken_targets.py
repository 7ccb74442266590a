"""Deliberately broken clip functions: positive controls for the harness's checks.

Each one is the reference clip with exactly one thing wrong, so each should trip exactly the check
named in its docstring (and the reference itself trips none).
"""

import math
import os

import torch
import torch.distributed as dist

from harness.clipmath import local_tensor, trainable_with_grads
from harness.reference import clip_grad_norm as reference


def norm_off(model, *, max_norm, norm_type=2.0):
    """norm: clips correctly but reports half the norm (a p-th power sum short by three quarters: a count)."""
    return reference(model, max_norm=max_norm, norm_type=norm_type) * 0.5


def norm_through_fp16(model, *, max_norm, norm_type=2.0):
    """arithmetic: counts and clips right, but returns its norm after a round trip through fp16 (a value held
    in a narrower type than the gradients): off by a rounding, by far less than any miscount."""
    return float(torch.tensor(reference(model, max_norm=max_norm, norm_type=norm_type)).half())


def coefficient_in_bf16(model, *, max_norm, norm_type=2.0):
    """coefficient: the right norm, but the coefficient rounded to bf16 before the multiply (on fp32 gradients
    a systematic 0.26% at a bound of 0.3 x the norm; none at 0.5, which bf16 holds exactly)."""
    norm = reference(model, max_norm=math.inf, norm_type=norm_type)
    coefficient = float(torch.tensor(min(1.0, max_norm / (norm + 1e-6))).to(torch.bfloat16))
    for _, p in trainable_with_grads(model):
        local_tensor(p.grad).mul_(coefficient)
    return norm


def total_in_gradient_dtype(model, *, max_norm, norm_type=2.0):
    """arithmetic: counts right, but holds the total norm in the gradients' dtype (agreed over the ranks: one
    that holds none takes its peers'), as torch's clip_grad_norm_ does, and clips with it: a rounding, until
    fp16 gradients whose norms fit one by one have a total past 65504 (inf: the coefficient 0 zeroes every
    gradient)."""
    order = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    held = {local_tensor(p.grad).dtype for _, p in trainable_with_grads(model)}
    code = torch.tensor([min((order.index(d) for d in held), default=len(order))])
    dist.all_reduce(code, op=dist.ReduceOp.MIN)
    dtype = order[int(code)] if int(code) < len(order) else torch.float32
    total = float(torch.tensor(reference(model, max_norm=math.inf, norm_type=norm_type), dtype=torch.float64).to(dtype))
    coefficient = min(1.0, max_norm / (total + 1e-6))
    for _, p in trainable_with_grads(model):
        local_tensor(p.grad).mul_(coefficient)
    return total


def int_norm_type(model, *, max_norm, norm_type=2.0):
    """norm: counts and clips with p taken as int(p) (a 1.5-norm computed as the 1-norm)."""
    return reference(model, max_norm=max_norm, norm_type=norm_type if math.isinf(norm_type) else float(int(norm_type)))


def ranks_disagree(model, *, max_norm, norm_type=2.0):
    """agree: rank 1 reports the norm one ulp higher (well inside the value tolerance)."""
    total = float(reference(model, max_norm=max_norm, norm_type=norm_type))
    return math.nextafter(total, math.inf) if dist.get_rank() == 1 else total


def no_clip(model, *, max_norm, norm_type=2.0):
    """coefficient: reports the right norm, never scales the gradients."""
    saved = {n: local_tensor(p.grad).clone() for n, p in trainable_with_grads(model)}
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    for n, p in trainable_with_grads(model):
        local_tensor(p.grad).copy_(saved[n])
    return total


def replica_drift(model, *, max_norm, norm_type=2.0):
    """replicas: rank 1 nudges one gradient after clipping, so its replicas stop being identical."""
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    if dist.get_rank() == 1:
        _, p = trainable_with_grads(model)[0]
        local_tensor(p.grad).view(-1)[0] *= 1 + 2**-20
    return total


def raise_on_rank1(model, *, max_norm, norm_type=2.0):
    """raised: rank 1 raises while rank 0 is already inside the all-reduce."""
    if dist.get_rank() == 1:
        raise ValueError("broken on purpose")
    return reference(model, max_norm=max_norm, norm_type=norm_type)


def skip_collective_on_rank1(model, *, max_norm, norm_type=2.0):
    """raised (by timeout): rank 1 skips the all-reduce that rank 0 waits in; nobody raises."""
    if dist.get_rank() == 1:
        return torch.tensor(1.0)
    return reference(model, max_norm=max_norm, norm_type=norm_type)


def exit_on_rank1(model, *, max_norm, norm_type=2.0):
    """A dead rank: the process of rank 1 vanishes mid-case."""
    if dist.get_rank() == 1:
        os._exit(7)
    return reference(model, max_norm=max_norm, norm_type=norm_type)


# -- faults the harness must catch, blame on the right case, and survive (issue: never PASS when broken) ----
def overwrite_params(model, *, max_norm, norm_type=2.0):
    """params: clips right, then scales the parameters themselves."""
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    for p in model.parameters():
        local_tensor(p).data.mul_(0.5)
    return total


def returns_none(model, *, max_norm, norm_type=2.0):
    """contract: clips right, returns nothing."""
    reference(model, max_norm=max_norm, norm_type=norm_type)


def raise_everywhere(model, *, max_norm, norm_type=2.0):
    """raised: every rank raises an exception that says nothing about non-finite gradients."""
    raise ValueError("broken on purpose")


def delete_grads(model, *, max_norm, norm_type=2.0):
    """contract: reports the right norm, then deletes every gradient (zero_grad(set_to_none=True))."""
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    model.zero_grad(set_to_none=True)
    return total


def destroy_default_group(model, *, max_norm, norm_type=2.0):
    """contract: clips right, then destroys the default process group (on every rank)."""
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    dist.destroy_process_group()
    return total


def reshape_grad(model, *, max_norm, norm_type=2.0):
    """contract: clips right, then flattens one gradient in place (resize_)."""
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    _, p = trainable_with_grads(model)[0]
    grad = local_tensor(p.grad)
    grad.resize_(grad.numel())
    return total


def hang_on_rank1(model, *, max_norm, norm_type=2.0):
    """hang: rank 1 sleeps (in Python) far past every deadline; rank 0 goes on."""
    if dist.get_rank() == 1:
        import time

        time.sleep(3600)
    return reference(model, max_norm=max_norm, norm_type=norm_type)


def stray_collective_of_another_size(model, *, max_norm, norm_type=2.0):
    """crash: a stray all-reduce whose size differs between ranks (gloo aborts the process)."""
    x = torch.ones(1000 if dist.get_rank() == 0 else 10)
    dist.all_reduce(x)
    return reference(model, max_norm=max_norm, norm_type=norm_type)


def new_group_on_rank1(model, *, max_norm, norm_type=2.0):
    """raised (by timeout): rank 1 alone creates a process group, which needs every rank."""
    if dist.get_rank() == 1:
        dist.new_group()
    return reference(model, max_norm=max_norm, norm_type=norm_type)


def unwaited_collective_on_rank0(model, *, max_norm, norm_type=2.0):
    """hang: rank 0 leaves an all-reduce in flight (async_op=True, never waited) that rank 1 never
    joins. On nccl the call returns at once and the kernel waits forever on the GPU: the harness's
    device settle inside the guard is where it must be caught (GPU only: tests/test_gpu.py)."""
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1, device=local_tensor(trainable_with_grads(model)[0][1].grad).device),
                        async_op=True)
    return total


# -- faults beyond the gradients' values: gradients created, replaced or left behind, state the clip changed ---
def zero_fills_missing_grads(model, *, max_norm, norm_type=2.0):
    """created: clips right, then gives every parameter without a gradient (frozen, or an expert that got
    no tokens) a zero one, as a framework that zero-fills before its optimizer step would."""
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return total


def restores_from_a_thread(model, *, max_norm, norm_type=2.0):
    """late: clips right, then a thread it leaves behind puts the unscaled gradients back 50 ms later."""
    import threading
    import time

    saved = [(local_tensor(p.grad), local_tensor(p.grad).clone()) for _, p in trainable_with_grads(model)]
    total = reference(model, max_norm=max_norm, norm_type=norm_type)

    def restore():
        time.sleep(0.05)
        for grad, before in saved:
            grad.copy_(before)

    threading.Thread(target=restore, name="restores-gradients").start()
    return total


def freezes_params(model, *, max_norm, norm_type=2.0):
    """params: clips right, then sets requires_grad=False on every parameter (training silently stops)."""
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    for p in model.parameters():
        p.requires_grad_(False)
    return total


def swaps_dtensor_grad_data(model, *, max_norm, norm_type=2.0):
    """contract: clips right, then swaps each DTensor gradient's ``.data`` for a float64 tensor of another
    shape: the wrapper now says float64 and (19,), the local shard is what it was."""
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    for p in model.parameters():
        if p.grad is not None and hasattr(p.grad, "to_local"):
            p.grad.data = torch.zeros(19, dtype=torch.float64)
    return total


_PREVIOUS_NORM: list[float] = []


def reports_the_previous_norm(model, *, max_norm, norm_type=2.0):
    """flaky: clips right, but reports the norm of its previous call (a cached value): right on its first
    call, wrong on most later ones, and right again when the same case is replayed right after itself."""
    total = float(reference(model, max_norm=max_norm, norm_type=norm_type))
    reported = _PREVIOUS_NORM[-1] if _PREVIOUS_NORM else total
    _PREVIOUS_NORM.append(total)
    return reported


def drops_later_stages(model, *, max_norm, norm_type=2.0):
    """norm: counts only what pipeline stage 0 holds (each rank adds its share only on pp coordinate 0),
    so every later stage is left out; linear in the groups, not a MAX of stage norms."""
    import harness
    from harness.clipmath import reduce_root_and_clip, weighted_partial
    from harness.cases.axes import MeshAxis

    ctx = harness.context(model)
    params = trainable_with_grads(model)
    local = weighted_partial(params, norm_type, lambda name, _: ctx.true_replica_count(name))
    mesh = ctx.mesh_spec
    if mesh.has(MeshAxis.PP) and mesh.coordinate(ctx.rank)[mesh.index(MeshAxis.PP)] != 0:
        local = 0.0
    return torch.tensor(reduce_root_and_clip(local, (p for _, p in params), max_norm=max_norm, norm_type=norm_type),
                        dtype=torch.float64)


# -- escapes an adversarial review (a red team) found: faults the judge did not see --------------------------
def _norm_then(model, max_norm, norm_type, scale):
    """The reference's norm (gradients restored), then the gradients scaled by ``scale(grad, coefficient)``."""
    saved = [(local_tensor(p.grad), local_tensor(p.grad).clone()) for _, p in trainable_with_grads(model)]
    total = float(reference(model, max_norm=max_norm, norm_type=norm_type))
    for grad, before in saved:
        grad.copy_(before)
    if math.isfinite(total):
        coefficient = min(1.0, max_norm / (total + 1e-6))
        if coefficient < 1.0:
            for grad, _ in saved:
                scale(grad, coefficient, total)
    return total


def overflows_in_the_gradient_dtype(model, *, max_norm, norm_type=2.0):
    """contract: scales in two steps in the gradient dtype, g.mul_(max_norm).div_(total + eps): in fp16,
    a loss-scaled gradient times the bound overflows to inf before the division (the norm is finite)."""
    return _norm_then(model, max_norm, norm_type, lambda g, c, total: g.mul_(max_norm).div_(total + 1e-6))


def poisons_a_finite_case(model, *, max_norm, norm_type=2.0):
    """contract: reports the right norm, then fills every gradient with NaN although the norm is finite."""
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    for _, p in trainable_with_grads(model):
        local_tensor(p.grad).fill_(math.nan)
    return total


def scales_then_raises(model, *, max_norm, norm_type=2.0):
    """nonfinite: torch's order with error_if_nonfinite: scales every gradient by the (NaN or zero) coefficient
    first, then raises the documented non-finite error on every rank: the step's gradients are already gone."""
    total = float(reference(model, max_norm=max_norm, norm_type=norm_type))  # leaves a non-finite case alone
    if not math.isfinite(total):
        for _, p in trainable_with_grads(model):
            local_tensor(p.grad).mul_(math.nan if math.isnan(total) else 0.0)  # torch's max_norm / (inf + eps)
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients is non-finite, so it "
                           "cannot be clipped")
    return total


def unwraps_dtensor_grads(model, *, max_norm, norm_type=2.0):
    """contract: clips right, then replaces each Replicate DTensor gradient by its local tensor, a plain one of
    the same shape ('it needs no communication'): the values are right, but an optimizer built for DTensors
    refuses the mix."""
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    for _, p in trainable_with_grads(model):
        if hasattr(p.grad, "to_local") and all(pl.is_replicate() for pl in p.grad.placements):
            p.grad = p.grad.to_local()
    return total


def wraps_plain_grads_as_dtensors(model, *, max_norm, norm_type=2.0):
    """contract: clips right, then wraps each plain gradient as a Replicate DTensor on the case's mesh (the
    'replicate the unplanned modules' fix), sharing its storage: same values, another kind of gradient."""
    import harness
    from torch.distributed.tensor import DTensor, Replicate

    ctx = harness.context(model)
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    for _, p in trainable_with_grads(model):
        if not isinstance(p.grad, DTensor):
            p.grad = DTensor.from_local(p.grad, ctx.mesh, [Replicate()] * ctx.mesh.ndim, run_check=False)
    return total


def scales_into_a_new_tensor(model, *, max_norm, norm_type=2.0):
    """contract: p.grad = p.grad * coefficient: the right values in a new tensor, not in place, so whatever
    aliased the old gradient (a bucket, main_grad, an optimizer's view) keeps the unscaled one."""
    saved = {n: local_tensor(p.grad).clone() for n, p in trainable_with_grads(model)}
    total = float(reference(model, max_norm=max_norm, norm_type=norm_type))
    for n, p in trainable_with_grads(model):
        scaled = local_tensor(p.grad).clone()
        local_tensor(p.grad).copy_(saved[n])
        if hasattr(p.grad, "to_local"):
            from torch.distributed.tensor import DTensor

            p.grad = DTensor.from_local(scaled, p.grad.device_mesh, p.grad.placements, run_check=False,
                                        shape=p.grad.shape, stride=p.grad.stride())
        else:
            p.grad = scaled
    return total


def sparse_gradients(model, *, max_norm, norm_type=2.0):
    """contract: clips right, then replaces each plain gradient by its sparse COO version (same shape, dtype
    and device): the harness's own reads must not crash on it."""
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    for _, p in trainable_with_grads(model):
        if not hasattr(p.grad, "to_local"):
            p.grad = p.grad.to_sparse()
    return total


def returns_a_huge_int(model, *, max_norm, norm_type=2.0):
    """contract: clips right, returns the int 10**400 (float() raises OverflowError, not TypeError)."""
    reference(model, max_norm=max_norm, norm_type=norm_type)
    return 10**400


def zero_grads_for_frozen_params(model, *, max_norm, norm_type=2.0):
    """created: clips right, then materializes zero gradients for the FROZEN parameters (requires_grad
    False) only, so a fused optimizer sees one flat list: weight decay and moments now move them."""
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    for p in model.parameters():
        if not p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    return total


def rescales_five_seconds_later(model, *, max_norm, norm_type=2.0):
    """contract: clips right, and a callback it registers scales the gradients once more 5 s later (an
    end-of-step hook on a slow worker): right when it returns, scaled by the coefficient squared after."""
    import threading

    total = float(reference(model, max_norm=max_norm, norm_type=norm_type))
    if math.isfinite(total) and max_norm / (total + 1e-6) < 1.0:
        grads = [local_tensor(p.grad) for _, p in trainable_with_grads(model)]
        coefficient = max_norm / (total + 1e-6)
        threading.Timer(5.0, lambda: [g.mul_(coefficient) for g in grads]).start()
    return total


def leaves_grad_mode_off(model, *, max_norm, norm_type=2.0):
    """contract: torch.set_grad_enabled(False) as a statement instead of ``with torch.no_grad()``, never
    restored: the next forward builds no graph (and the next target of these ranks runs without one)."""
    torch.set_grad_enabled(False)
    return reference(model, max_norm=max_norm, norm_type=norm_type)


def leaves_default_dtype_fp64(model, *, max_norm, norm_type=2.0):
    """contract: torch.set_default_dtype(torch.float64) 'for exact accumulation', never restored: every
    tensor the training creates afterwards is float64, and a later target's float32 slip is hidden."""
    torch.set_default_dtype(torch.float64)
    return reference(model, max_norm=max_norm, norm_type=norm_type)


def coefficient_in_default_dtype(model, *, max_norm, norm_type=2.0):
    """coefficient: the coefficient computed as a default-dtype tensor, torch.tensor(max_norm) / (total + eps):
    float32, so fp64 gradients are scaled by a coefficient rounded to float32 (exact only if the default
    dtype is float64)."""
    saved = [(local_tensor(p.grad), local_tensor(p.grad).clone()) for _, p in trainable_with_grads(model)]
    total = float(reference(model, max_norm=max_norm, norm_type=norm_type))
    coefficient = torch.tensor(max_norm) / (total + 1e-6)
    for grad, before in saved:
        grad.copy_(before)
        if math.isfinite(total) and float(coefficient) < 1.0:
            grad.mul_(coefficient.to(grad.device))
    return total


def rewrites_the_plan(model, *, max_norm, norm_type=2.0):
    """raised: a correct clip that first 'resolves' the framework plan in place, writing the true placements
    into the plan it was handed (ctx.declared), as plan-applying code mutates its plan dict: the plan is
    read-only (TypeError), so it cannot change how later targets are judged."""
    import harness

    ctx = harness.context(model)
    for spec in ctx.layout.trainable:
        for axis in ctx.mesh_spec.names:
            ctx.declared[spec.name][axis] = spec.placement(axis)  # type: ignore[index]
    return reference(model, max_norm=max_norm, norm_type=norm_type)


def _counted(model, max_norm, norm_type, params, copies):
    """The reference's reduction and clip over ``params`` (name, parameter), each weighted 1/copies(name, p)."""
    from harness.clipmath import reduce_root_and_clip, weighted_partial

    local = weighted_partial(params, norm_type, copies)
    return torch.tensor(reduce_root_and_clip(local, [p for _, p in trainable_with_grads(model)], max_norm=max_norm,
                                             norm_type=norm_type), dtype=torch.float64)


def assumes_plain_grads_replicated(model, *, max_norm, norm_type=2.0):
    """norm: when any gradient is a DTensor, takes every plain gradient for a DP replica (the 'unplanned
    modules are replicated' assumption): sharded plain weights beside DTensor biases are counted once."""
    import harness

    ctx = harness.context(model)
    params = trainable_with_grads(model)
    mixed = any(hasattr(p.grad, "to_local") for _, p in params)
    return _counted(model, max_norm, norm_type, params,
                    lambda n, p: ctx.world_size if mixed and not hasattr(p.grad, "to_local")
                    else ctx.true_replica_count(n))


def counts_tied_weights_twice(model, *, max_norm, norm_type=2.0):
    """norm: walks named_parameters(remove_duplicate=False): a Parameter registered under two names on one
    rank (a head tied to an embedding) is counted twice."""
    import harness

    ctx = harness.context(model)
    names = {id(p): n for n, p in model.named_parameters()}  # the first name: the layout's
    params = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)
              if p.requires_grad and p.grad is not None]
    return _counted(model, max_norm, norm_type, params, lambda n, p: ctx.true_replica_count(names[id(p)]))


def inf_norm_without_empty_guard(model, *, max_norm, norm_type=2.0):
    """raised: the inf norm as max over g.abs().max() of every local gradient, with no guard for an empty
    one (a zero-size parameter, an empty FSDP shard): max() of nothing raises on every rank."""
    if math.isinf(norm_type):
        for _, p in trainable_with_grads(model):
            local_tensor(p.grad).abs().max()
    return reference(model, max_norm=max_norm, norm_type=norm_type)


def coefficient_in_param_dtype(model, *, max_norm, norm_type=2.0):
    """coefficient: scales by the coefficient rounded to the PARAMETER's dtype, g.mul_(c.to(p.dtype)): exact
    while gradients and parameters share a dtype, a bf16-rounded factor on fp32 gradients of bf16 weights."""
    saved = [(p, local_tensor(p.grad).clone()) for _, p in trainable_with_grads(model)]
    total = float(reference(model, max_norm=max_norm, norm_type=norm_type))
    for p, before in saved:
        local_tensor(p.grad).copy_(before)
    if math.isfinite(total) and max_norm / (total + 1e-6) < 1.0:
        for p, _ in saved:
            local_tensor(p.grad).mul_(torch.tensor(max_norm / (total + 1e-6)).to(p.dtype))
    return total


_CALLS: list[int] = []


def clips_on_odd_calls_only(model, *, max_norm, norm_type=2.0):
    """coefficient: counts its calls as micro-steps (gradient accumulation of 2) and clips only on odd calls,
    reporting the right norm every time: the even calls leave gradients that needed clipping unscaled."""
    _CALLS.append(1)
    if len(_CALLS) % 2:
        return reference(model, max_norm=max_norm, norm_type=norm_type)
    return _norm_then(model, max_norm, norm_type, lambda g, c, total: None)


def _counted_twice_where(model, max_norm, norm_type, picked):
    """The reference with every parameter whose name ``picked`` selects counted twice: what a clip that
    handles a group apart by name (biases, norms, the router, embeddings, LoRA factors) and then adds it
    in a second time computes."""
    from harness.cases.context import context
    from harness.clipmath import reduce_root_and_clip, weighted_partial

    ctx = context(model)
    params = trainable_with_grads(model)
    local = weighted_partial(params, norm_type,
                             lambda name, _: ctx.true_replica_count(name) / (2 if picked(name) else 1))
    return torch.tensor(reduce_root_and_clip(local, (p for _, p in params), max_norm=max_norm, norm_type=norm_type),
                        dtype=torch.float64)


NAME_GROUPS = {
    "biases": lambda name: name.endswith("bias"),
    "norms": lambda name: "norm" in name,
    "router": lambda name: "gate" in name and "experts" not in name,
    "embeddings": lambda name: "embed" in name,
    "output_head": lambda name: "lm_head" in name or name.endswith("output.weight"),
    "lora_factors": lambda name: "lora_A" in name or "lora_B" in name,
    "shared_experts": lambda name: "shared_experts" in name,
}
"""Groups clips pick by name, each the only mistake of one target below."""


def _double_counting(group: str):
    def clip(model, *, max_norm, norm_type=2.0):
        return _counted_twice_where(model, max_norm, norm_type, NAME_GROUPS[group])

    clip.__name__ = clip.__qualname__ = f"double_counts_{group}"
    clip.__doc__ = f"norm: counts the {group.replace('_', ' ')} twice (picked by name)."
    return clip


# double_counts_biases, double_counts_norms, ...: module-level names, so ranks import them by name
globals().update({f"double_counts_{group}": _double_counting(group) for group in NAME_GROUPS})


def shared_lora_twice(model, *, max_norm, norm_type=2.0):
    """counting: the reference, but the LoRA factors every EP rank shares (ep=Replicate) counted twice: xorl's
    hybrid_shared factors summed over an EP group of two. They hold under 1% of the norm of a MoE LoRA layer,
    inside bf16's band."""
    shared = {"gate_proj_lora_A", "up_proj_lora_A", "down_proj_lora_B"}
    return _counted_twice_where(model, max_norm, norm_type, lambda name: name.rsplit(".", 1)[-1] in shared)
