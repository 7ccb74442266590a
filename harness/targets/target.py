"""Clip functions under test: the built-in ones, how a name on the command line becomes one, and what a
target's return value says. The contract they follow is ``harness.cases.target``."""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import harness.reference as reference
from harness.clipmath import local_tensor, trainable_with_grads
from harness.cases.context import context
from harness.cases.loading import LoadError, is_import_path, load_object, unknown_name
from harness.cases.target import Finding, Target, direct_call
from harness.cases.model import torch_placements

def _local_views(model: nn.Module) -> list[nn.Parameter]:
    """Plain parameters whose storage and gradient are views of each rank-local shard."""
    views = []
    for _, p in trainable_with_grads(model):
        if isinstance(p, DTensor):
            view = nn.Parameter(local_tensor(p).detach())
            assert p.grad is not None  # trainable_with_grads
            view.grad_dtype = p.grad.dtype  # gradients may be wider than their parameters (bf16 with fp32 grads)
            view.grad = local_tensor(p.grad)
            p = view
        views.append(p)
    return views


def torch_local(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ on each rank's local gradients: the naive, un-reduced baseline."""
    return torch.nn.utils.clip_grad_norm_(_local_views(model), max_norm, norm_type)


def torch_dtensor(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ on DTensor gradients placed as the *declared* plan says.

    DTensor parameters are used as they are; plain ones are wrapped (sharing storage) on the case's
    mesh with their declared placements, which is what a framework building DTensors from its plan
    would hand to torch. The result is exact when the plan tells the truth.
    """
    ctx = context(model)
    params = []
    for name, p in trainable_with_grads(model):
        if not isinstance(p, DTensor):
            placements = torch_placements(ctx.declared.get(name, {}), ctx.mesh_spec)
            wrapped = nn.Parameter(DTensor.from_local(p.detach(), ctx.mesh, placements, run_check=False))
            assert p.grad is not None  # trainable_with_grads
            wrapped.grad_dtype = p.grad.dtype  # gradients may be wider than their parameters
            wrapped.grad = DTensor.from_local(p.grad, ctx.mesh, placements, run_check=False)
            p = wrapped
        params.append(p)
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    return total.full_tensor() if isinstance(total, DTensor) else total


TORCH_MAX_DROPS_NAN = (
    "torch reduces the inf norm of sharded DTensor gradients (a Partial(max) DTensor) with a bare float "
    "all_reduce(MAX), which drops a NaN: gloo keeps it only where rank 0 holds it (measured on CPU), NCCL's "
    "float MAX is fmaxf, which drops it wherever it is, rank 0 included (NCCL's source, not measured here); "
    "every rank reports the same finite norm and the NaN stays in the gradients")
"""The mechanism, in torch: every clip that takes the inf norm of sharded DTensor gradients inherits it."""


def torch_max_drops_nan(layouts: str) -> Finding:
    """The one torch finding the frameworks that call ``clip_grad_norm_`` on DTensors inherit, filed
    under torch (``owner``) rather than once per framework."""
    return Finding(layouts, None, TORCH_MAX_DROPS_NAN,
                   direct_call("torch.nn.utils.clip_grad_norm_(..., norm_type=inf), or a framework's clip that "
                               "calls it, on sharded DTensor gradients (FSDP2, DTensor TP) holding a NaN on a rank "
                               "other than 0 (gloo; any rank on NCCL)"),
                   norms=("Linf",), owner="pytorch/pytorch", repro="scenarios/fsdp2/repro_inf_norm_drops_nan.py")


def torch_inf_norm_of_empty(layouts: str) -> Finding:
    """torch's foreach inf norm refuses an empty tensor: a zero-size parameter (or an empty local shard)."""
    return Finding(layouts, None, "torch._foreach_norm raises 'cannot compute infinity norm on empty tensor': "
                   "clip_grad_norm_(norm_type=inf) fails on every rank whose gradients include an empty one (a "
                   "zero-size parameter, an empty FSDP shard), where the inf norm of nothing is 0",
                   direct_call("torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=inf) with a zero-size "
                               "parameter's gradient among params (observed on torch 2.13, CPU)"),
                   norms=("Linf",), owner="pytorch/pytorch")


TORCH_NORM_PARTIAL_DTYPE = (
    "torch's DTensor norm reduction (_NormPartial) raises each shard's norm to the power p in the gradient "
    "dtype before summing: with fp16 gradients a shard norm above sqrt(65504) = 256 squares to inf (a finite "
    "norm reported as inf, every gradient scaled by 0), one near 1e-3 to a subnormal (the norm off by ~1%); "
    "the same at L1 (the sum of the shards' norms above 65504) and L3 (cubes overflow, or underflow to a norm "
    "of 0), and with bf16 gradients the cubes lose precision (L3 off by ~2%)")


def torch_norm_partial_fp16(layouts: str) -> Finding:
    """torch's fp16 overflow/underflow in the sharded-DTensor norm, on the layouts at those magnitudes."""
    return Finding(layouts, None, TORCH_NORM_PARTIAL_DTYPE,
                   direct_call("clip_grad_norm_ / get_total_norm on sharded fp16 DTensor gradients (a model "
                               "fully_shard-ed with fp16 parameters, no fp32 gradient dtype)"),
                   norms=("L1", "L2", "L3"), owner="pytorch/pytorch",
                   repro="scenarios/fsdp2/repro_fp16_norm_partial.py")


BUILTIN_TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("reference", reference.clip_grad_norm,
               "layout-aware reference: sum |g|^p / replica count, one all-reduce, one root"),
        Target("torch", torch_local,
               "torch.nn.utils.clip_grad_norm_ on rank-local grads (no cross-rank reduction)",
               findings=(Finding("*", "by design, not a torch bug", "clip_grad_norm_ on plain tensors is rank-local: "
                                 "the naive control every sharded layout fails",
                                 direct_call("a loop calling torch.nn.utils.clip_grad_norm_ on the rank-local "
                                             "(plain) gradients of a sharded model, or reading the local part of "
                                             "a DTensor norm (pytorch/pytorch #170862, modelscope/ms-swift PR "
                                             "#8341)")),)),
        Target("torch-dtensor", torch_dtensor,
               "torch.nn.utils.clip_grad_norm_ on DTensor grads placed by the declared plan", dtensor_only=True,
               findings=(torch_max_drops_nan("*nan on last rank*"), torch_norm_partial_fp16("*loss-scaled*"),
                         torch_norm_partial_fp16("*tiny*"), torch_inf_norm_of_empty("*empty parameter*"))),
    )
}


def resolve_target(name: str, registered: Mapping[str, Target]) -> Target:
    """A registered name, or ``module:function`` / ``path/to/file.py:function``."""
    if name in registered:
        return registered[name]
    if is_import_path(name):
        try:
            fn = load_object(name)
        except LoadError as exc:
            raise LoadError(f"unknown target {name!r}: {exc}") from None
        if not callable(fn):
            raise LoadError(f"target {name!r} is not callable")
        return Target(name, fn, (fn.__doc__ or "").strip().split("\n")[0], origin="user")
    raise unknown_name("target", name, registered, "function")


def reported_value(value: Any) -> float:
    """What a target returned, as a float; a DTensor is materialized first (a collective)."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"the clip function returned a tensor of shape {tuple(value.shape)}, expected one value")
        return float(value.detach().reshape(()).to(torch.float64).cpu())
    if isinstance(value, float):
        return float(value)
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:  # an int past float's range (10**400): a wrong return, not a harness crash
            raise TypeError(f"the clip function returned an int of {value.bit_length()} bits, too large for a "
                            "float") from None
    raise TypeError(f"the clip function returned {type(value).__name__}, expected a number or a tensor")


_PRECISIONS = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def reported_precision(value: Any) -> str | None:
    """The precision a returned norm was rounded to: a tensor's dtype ("fp32" for a float32 tensor), "fp64"
    for a Python number, None for anything else. A norm computed exactly and returned as a float32 tensor
    is one float32 rounding from the truth, which the norm check then allows (``checks.judge_norm``)."""
    if isinstance(value, torch.Tensor):
        return _PRECISIONS.get(value.dtype)
    return "fp64" if isinstance(value, (int, float)) else None
