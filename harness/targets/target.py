"""Clip functions under test: the built-in ones, and how a name on the command line becomes one.

The contract, the same for every target: ``fn(model, *, max_norm, norm_type) -> total_norm`` called
on every rank, clipping the gradients in place and returning the total norm as a float, a 0-dim (or
1-element) tensor, or a DTensor. The mesh, groups and declared plan come from
``harness.context(model)``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from harness import reference
from harness.clipmath import local_tensor, trainable_with_grads
from harness.cases.context import context
from harness.targets.frameworks import Framework
from harness.targets.loading import LoadError, is_import_path, load_object
from harness.judge.records import FindingRecord
from harness.cases.model import torch_placements

ClipFn = Callable[..., Any]


ReachKind = Literal["stock", "direct-call", "synthetic"]
REACH_KINDS: tuple[ReachKind, ...] = ("stock", "direct-call", "synthetic")


@dataclass(frozen=True)
class Reach:
    """Who meets a finding, which decides whether it is one: a FAIL is a claim about someone else's
    code, and what a framework's users actually run is what makes it worth their time.

    * ``stock``: a documented configuration of the framework's own trainer reaches it (``how`` names
      the configuration);
    * ``direct-call``: only a custom training loop that calls the clip function itself does (``how``
      names the call);
    * ``synthetic``: no known path reaches it (``how`` says what prevents it); the layout is kept as a
      regression layout, runs only when asked for (``--synthetic``) and is never called a finding.
    """

    kind: ReachKind
    how: str

    def __post_init__(self) -> None:
        if self.kind not in REACH_KINDS:
            raise ValueError(f"reach kind must be one of {REACH_KINDS}, got {self.kind!r}")
        if not self.how.strip():
            raise ValueError("a reach says how (the config, the call, or what keeps every path from it)")

    @property
    def reached(self) -> bool:
        """Whether some user meets it (``stock`` or ``direct-call``)."""
        return self.kind != "synthetic"

    def describe(self) -> str:
        return f"{self.kind}: {self.how}"


def stock(how: str) -> Reach:
    return Reach("stock", how)


def direct_call(how: str) -> Reach:
    return Reach("direct-call", how)


def synthetic(how: str) -> Reach:
    return Reach("synthetic", how)


@dataclass(frozen=True)
class Finding:
    """What a real framework's failures on some layouts are, for the reports and the compatibility
    table: a known upstream report, or a new finding with what a user should report upstream, and in
    both cases who reaches it (``reach``). A FAIL that matches no finding of its target is shown as
    unexplained (nobody has looked at it yet)."""

    layouts: str
    """fnmatch pattern on the variant label ("*tp experts plain*")."""
    upstream: str | None
    """The matching report ("meta-pytorch/torchtune #2420"); None for a new finding."""
    note: str
    """The mechanism in a few words; for a new finding, what to report (with the replay command)."""
    reach: Reach
    """Who meets it: the trainer's stock configuration, a direct call, or nobody known (synthetic)."""
    norms: tuple[str, ...] = ()
    """Norm labels it applies to ("L2", "Linf"); empty for every norm."""
    owner: str | None = None
    """Whose code holds the mechanism when it is not the target's framework ("pytorch/pytorch"): a
    finding several frameworks inherit is filed once, under its owner."""
    repro: str | None = None
    """The standalone reproduction (``scenarios/<framework>/repro_<finding>.py``: the framework's own
    API, no clipcheck), so that the finding can be filed upstream as it stands."""

    def matches(self, layout: str, norm: str) -> bool:
        return fnmatch.fnmatchcase(layout, self.layouts) and (not self.norms or norm in self.norms)

    def describe(self) -> str:
        owner = f" (filed under {self.owner})" if self.owner else ""
        if self.upstream:
            return f"{self.upstream}: {self.note}{owner}"
        kind = "new finding" if self.reach.reached else "synthetic regression layout"
        return f"{kind}: {self.note}{owner}"

    def record(self) -> "FindingRecord":
        return {"upstream": self.upstream, "note": self.note, "reach": self.reach.kind, "how": self.reach.how,
                "owner": self.owner, "repro": self.repro, "text": self.describe()}


def finding_for(findings: tuple[Finding, ...], layout: str, norm: str) -> Finding | None:
    """The first of ``findings`` that explains a FAIL on ``layout`` with ``norm``; None if none does."""
    return next((f for f in findings if f.matches(layout, norm)), None)


@dataclass(frozen=True)
class Target:
    """A clip function under test, and what it needs.

    * ``scenarios``: the only scenarios it can run with (it models their framework), None for any.
    * ``dtensor_only``: it builds DTensors over the whole mesh, so a layout with parameters on some
      ranks only is not a valid combination for it.
    * ``dtypes`` / ``norm_types``: what it supports at all, None for anything; other combinations
      are dropped (with their reason) rather than reported as failures.
    * ``requires``: a third-party framework; where it is missing, the target's cases are skipped.
    * ``dress``: ``dress(model, ctx)``, run on every rank before the gradients are injected, to set the
      model up the way the framework would (its marks, meshes, groups, wrappers). It may replace
      parameters, as long as names and local shapes stay those of the layout.
    * ``backward``: ``backward(model, ctx, grads)``, for a framework that acts on gradients between its
      backward and its clip (hooks, reduce-scatter, buckets, casts): instead of the harness writing
      ``grads`` (this rank's gradients by parameter name, None where it has none) into ``.grad``, it
      produces them through the framework's own path (``harness.run.case.delivery`` checks that exactly
      they arrived). None where the framework does nothing to gradients on the way to the clip.
    * ``findings``: what its known failures are (``Finding``), for the reports and the compatibility
      table.
    * ``in_place``: whether its clip must scale each gradient in the storage it found it in (every clip,
      so the default); False only for a framework whose own clip legitimately writes new gradient tensors
      (ColossalAI's ZeRO: its clipped master partitions are gathered back into a fresh ``.grad``), whose
      replaced gradients are then not a contract fault.
    * ``refuses``: ``refuses(variant) -> reason | None``, for layouts the framework itself rejects
      before any clip runs (torchtitan raises on weight tying under PP, say): such cases are dropped
      and counted with the reason, since judging a clip the framework never lets run says nothing.
    """

    name: str
    fn: ClipFn
    summary: str
    origin: str = "built-in"
    dtensor_only: bool = False
    scenarios: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    norm_types: tuple[float, ...] | None = None
    requires: Framework | None = None
    dress: Callable[..., None] | None = None
    backward: Callable[..., None] | None = None
    refuses: Callable[[Any], str | None] | None = None
    findings: tuple[Finding, ...] = ()
    in_place: bool = True

    def unavailable(self) -> str | None:
        return None if self.requires is None else self.requires.unavailable()

    @property
    def runs_synthetic(self) -> bool:
        """Whether it runs a scenario's synthetic (regression) layouts without ``--synthetic``: only the
        harness's own targets do. A framework's adapter or a user's clip meets them on request, since no
        known trainer path hands a clip those gradients and a FAIL there is no finding."""
        return self.requires is None and self.origin != "user"

    def framework_version(self) -> str | None:
        """'deepspeed 0.19.8', 'torch 2.13.0+cpu' for torch's own clips; None for the harness's own."""
        if self.requires is not None:
            return None if self.unavailable() else f"{self.requires.name} {self.requires.version()}"
        if self.name.startswith("torch"):
            return f"torch {torch.__version__}"
        return None


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
    raise LoadError(
        f"unknown target {name!r}: not one of {', '.join(sorted(registered))}, and not of the form "
        "module:function or path/to/file.py:function"
    )


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
