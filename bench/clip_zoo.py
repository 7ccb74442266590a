"""A zoo of clip functions written from the public contract alone, judged by ``harness.audit`` on a real job.

    python bench/clip_zoo.py --world 2 --params 1e6 --dtype fp32 --layout fsdp2 --norm 2
    python bench/clip_zoo.py --world 4 --params 4e6 --dtype bf16 --layout hsdp --norm inf --json zoo.json

What it asks of the judge: does it pass clips that are right, and fail clips whose only fault is their
arithmetic? Every clip here counts each logical gradient exactly once (the contract: the p-norm of all
logical gradients, each counted once, returned, and every gradient scaled by ``min(1, max_norm / (norm +
1e-6))``); they differ in how they compute it.

* ``correct``: each computes the norm another way with torch's own functions (``clip_grad_norm_``,
  ``get_total_norm`` on DTensors with their true placements, ``_foreach_norm``, per-tensor norms stacked in
  the gradients' dtype, an fp32 upcast, a Python loop, one flat buffer, local partial sums all-reduced with
  replicas divided by their count, reduced over the shard group only, or counted on one owner rank). Each
  is right on the layouts and dtypes it is offered for; a FAIL is the judge's.
* ``arithmetic``: the same counting, but a sum, a square, a coefficient or a reduction carried out in bf16
  or fp16. Whether that shows depends on the gradients: a square of 300 overflows fp16, a norm above 65504
  becomes inf in fp16, a rounding of 2^-9 is within a bf16 tolerance but not an fp32 one. A PASS here is
  the judge's tolerance meeting a small error (compare the ``own`` ratio) or a wrong clip missed.

The job (``--world`` CPU ranks, gloo, started as ``python -m torch.distributed.run --standalone``): an MLP
of square ``nn.Linear`` layers (``--width``) with about ``--params`` parameters, laid out as users lay it
out (``--layout``): ``ddp`` (``DistributedDataParallel``: every gradient a bit-identical replica on every
rank), ``fsdp2`` (``fully_shard`` on a 1-D mesh: DTensor ``Shard(0)``), ``tp`` (``parallelize_module``,
colwise and rowwise pairs: ``Shard(0)``, ``Shard(1)`` and the rowwise bias ``Replicate``) or ``hsdp``
(``fully_shard`` on a ``(replicate, shard)`` mesh: ``(Replicate(), Shard(0))``); in ``--dtype`` fp32, bf16,
fp16 (parameters and gradients in that dtype) or ``autocast`` (fp32 parameters, a bf16 autocast forward).
One real forward and backward (each rank its own batch but under ``tp``), then the gradients multiplied by
a power of two (``--loss-scale``; ``auto`` puts the largest element in [8192, 16384), as fp16 loss scaling
does: squares past fp16's range, a norm past 65504; a power of two commutes with rounding, so this equals
a backward of the scaled loss), and copied.

For each clip, on every rank: the gradients put back from the copy, ``harness.audit(model, clip,
max_norm=..., norm_type=...)``, then (without ``--restore``: the audit leaves the gradients as the clip
left them) the coefficient the clip applied, measured here in float64. Rank 0 prints a row per clip: the
judge's verdict and reported/true ratio, the clip's returned norm over this driver's own float64 norm
(``own``), the relative error of the applied coefficient (``coef err``), and the judge's first failed check.
The summary counts correct clips that FAIL and arithmetic clips that PASS.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = ("ddp", "fsdp2", "tp", "hsdp")
DTYPES = ("fp32", "bf16", "fp16", "autocast")
DTENSOR_LAYOUTS = ("fsdp2", "tp", "hsdp")
EPS = 1e-6
"""The contract's epsilon: the coefficient is ``min(1, max_norm / (norm + EPS))``."""
CHUNK = 256
"""Elements per chunk of ``bf16_chunk_accum`` (a few thousand chunks per rank at 1M parameters)."""
ROWS = 256
"""Elements per row of ``rows_fp64``."""


# ----------------------------------------------------------------------------------------------------------
# The job as a clip sees it: its parameters, each gradient's local tensor, how many ranks hold a copy.
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Job:
    """What a clip is built from: the model, its layout, and the parameters that have gradients.

    Every helper answers from the gradient's own placements (a DTensor's mesh and placements) or, for a
    plain tensor, from the layout (``ddp``: a replica on every rank); nothing here looks at the bits."""

    model: nn.Module
    layout: str
    dtype: str
    world: int
    rank: int
    params: list[nn.Parameter]

    def local(self, p: nn.Parameter) -> torch.Tensor:
        """The rank's own tensor of ``p``'s gradient (a DTensor's local shard, or the plain gradient)."""
        g = p.grad
        assert g is not None
        return g.to_local() if isinstance(g, DTensor) else g

    def grads(self) -> list[torch.Tensor]:
        return [self.local(p) for p in self.params]

    def replicas(self, p: nn.Parameter) -> int:
        """How many ranks hold a bit-identical copy of this rank's piece of ``p``'s gradient: the product of
        the mesh sizes over the dims ``p`` is ``Replicate`` on; every rank for a plain gradient under DDP."""
        g = p.grad
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            return math.prod(mesh.size(i) for i, pl in enumerate(g.placements) if isinstance(pl, Replicate))
        return self.world if self.layout == "ddp" else 1

    def owner(self, p: nn.Parameter) -> bool:
        """Whether this rank is the one copy of its piece that counts: coordinate 0 on every dim ``p`` is
        replicated on (rank 0 for a plain gradient under DDP)."""
        g = p.grad
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            return all(mesh.get_local_rank(i) == 0 for i, pl in enumerate(g.placements) if isinstance(pl, Replicate))
        return self.rank == 0 or self.layout != "ddp"

    def shard_dims(self, p: nn.Parameter) -> tuple[int, ...]:
        """The mesh dims ``p``'s gradient is sharded on: the ranks whose pieces add up to the whole. A plain
        gradient under DDP is whole on every rank (no dims); anywhere else it is this rank's own."""
        g = p.grad
        if isinstance(g, DTensor):
            return tuple(i for i, pl in enumerate(g.placements) if isinstance(pl, Shard))
        return () if self.layout == "ddp" else (-1,)

    def group(self, p: nn.Parameter) -> Any:
        """The process group over ``p``'s shard dims (None: nothing to reduce; the default group for a
        plain gradient that is this rank's own)."""
        dims = self.shard_dims(p)
        if not dims:
            return None
        g = p.grad
        if dims == (-1,) or not isinstance(g, DTensor):
            return dist.group.WORLD
        if len(dims) > 1:
            raise NotImplementedError("a gradient sharded on several mesh dims")
        return g.device_mesh.get_group(dims[0])


def _op(norm_type: float) -> Any:
    """SUM for the p-th power sums of a finite p, MAX for the inf norm."""
    return dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM


def _power_sum(t: torch.Tensor, norm_type: float) -> torch.Tensor:
    """sum |t|^p (max |t| for inf) in ``t``'s dtype; the caller picks the dtype."""
    if math.isinf(norm_type):
        return t.abs().max() if t.numel() else t.new_zeros(())
    if norm_type == 2:
        return t.square().sum()
    if norm_type == 1:
        return t.abs().sum()
    return t.abs().pow(norm_type).sum()


def _root(total: float, norm_type: float) -> float:
    return total if math.isinf(norm_type) else total ** (1.0 / norm_type)


def _coefficient(max_norm: float, norm: float) -> float:
    """The contract's coefficient, in float64."""
    return min(1.0, max_norm / (norm + EPS))


def _scale(grads: list[torch.Tensor], coefficient: float) -> None:
    """Every local gradient times ``coefficient`` in place (each element rounded once, in its own dtype)."""
    with torch.no_grad():
        for g in grads:
            g.mul_(coefficient)


def _all_reduce(value: torch.Tensor, norm_type: float, group: Any = None) -> torch.Tensor:
    dist.all_reduce(value, op=_op(norm_type), group=group)
    return value


def _reduce_and_scale(job: Job, max_norm: float, norm_type: float, part: torch.Tensor) -> float:
    """The last steps most clips share: this rank's part (its p-th power sum, its max for inf) all-reduced
    in float64 over every rank, the root taken, every local gradient scaled by the contract's coefficient.
    Kept in one place so that the clips differ only in how they compute ``part``; returns the norm."""
    total = _all_reduce(part.double().reshape(1), norm_type)
    norm = _root(float(total), norm_type)
    _scale(job.grads(), _coefficient(max_norm, norm))
    return norm


def _exact_partials(job: Job, norm_type: float) -> float:
    """This rank's p-th power sum in float64, each piece weighted 1 / replicas; its max for inf."""
    parts = []
    for p in job.params:
        part = float(_power_sum(job.local(p).double(), norm_type))
        parts.append(part if math.isinf(norm_type) else part / job.replicas(p))
    return max(parts, default=0.0) if math.isinf(norm_type) else math.fsum(parts)


def exact_norm(job: Job, norm_type: float) -> float:
    """The float64 norm the contract asks for: replicas divided by their count, one all-reduce over every
    rank. The driver's own yardstick (``own`` and ``coef err``), computed outside any clip."""
    total = torch.tensor([_exact_partials(job, norm_type)], dtype=torch.float64)
    return _root(float(_all_reduce(total, norm_type)), norm_type)


# ----------------------------------------------------------------------------------------------------------
# Correct clips: each counts every logical gradient once and computes the norm in a precision that holds.
# ----------------------------------------------------------------------------------------------------------

Clip = Callable[[], Any]
Maker = Callable[[Job, float, float], Clip]


def torch_clip(job: Job, max_norm: float, norm_type: float) -> Clip:
    """``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` as users call it.

    Right wherever the gradients say where they lie: DDP's replicas are whole on every rank (each rank's
    local norm is the norm), DTensor gradients (FSDP2, TP, HSDP) carry their placements and torch reduces
    each over the dims that shard it. Not offered at fp16: torch takes the norm in the gradients' dtype,
    and a norm above 65504 is inf there (``torch_clip_fp16`` among the arithmetic clips). Its precision is
    torch's: on bf16 DTensor gradients DTensor's partial-norm reduction raises each local norm to the p-th
    power, adds and takes the root in bf16, which for p = 3 was measured 1.8% high (FSDP2, world 2)."""
    return lambda: torch.nn.utils.clip_grad_norm_(job.model.parameters(), max_norm, norm_type=norm_type)


def dtensor_total(job: Job, max_norm: float, norm_type: float) -> Clip:
    """``get_total_norm`` on the DTensor gradients themselves, ``full_tensor()``, then the coefficient in
    float64 applied to each local shard with ``_foreach_mul_``.

    Right because DTensor's norm of a ``Shard`` gradient is a partial norm reduced over the shard dims and
    that of a ``Replicate`` one is already whole: the placements do the counting. In the gradients' dtype,
    so not offered at fp16 (range); in bf16 as precise as ``torch_clip`` (the same reduction)."""

    def clip() -> float:
        total = torch.nn.utils.get_total_norm([p.grad for p in job.params if p.grad is not None], norm_type)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        norm = float(total)
        with torch.no_grad():
            torch._foreach_mul_(job.grads(), _coefficient(max_norm, norm))
        return norm

    return clip


def dtensor_per_param(job: Job, max_norm: float, norm_type: float) -> Clip:
    """One ``torch.linalg.vector_norm`` per DTensor gradient (each made whole with ``full_tensor``),
    combined on the host in float64, then ``DTensor.mul_`` by the coefficient.

    Right for the same reason as ``dtensor_total``: each DTensor's norm is the norm of its logical
    gradient whatever its placements, so a plain sum of p-th powers counts each once. Each norm is the
    gradients' dtype's (bf16: DTensor's reduction of a sharded norm in bf16, as in ``torch_clip``)."""

    def clip() -> float:
        norms = []
        for p in job.params:
            n = torch.linalg.vector_norm(p.grad, norm_type)
            norms.append(float(n.full_tensor() if isinstance(n, DTensor) else n))
        norm = max(norms) if math.isinf(norm_type) else math.fsum(x ** norm_type for x in norms) ** (1 / norm_type)
        coefficient = _coefficient(max_norm, norm)
        with torch.no_grad():
            for p in job.params:
                assert p.grad is not None
                p.grad.mul_(coefficient)
        return norm

    return clip


def foreach_norm(job: Job, max_norm: float, norm_type: float) -> Clip:
    """``torch._foreach_norm`` of the local tensors in fp32 (``dtype=torch.float32``: fp16's range holds),
    p-th powers weighted 1 / replicas in float64, one all-reduce over every rank, ``_foreach_mul_``.

    Right because a piece held by k ranks contributes k times 1/k; a sharded piece (k = 1) once on the
    rank that holds it."""

    def clip() -> float:
        grads = job.grads()
        norms = torch._foreach_norm(grads, norm_type, dtype=torch.float32)
        stacked = torch.stack(norms).double()
        if math.isinf(norm_type):
            part = stacked.max()
        else:
            weights = torch.tensor([1.0 / job.replicas(p) for p in job.params], dtype=torch.float64)
            part = (stacked.pow(norm_type) * weights).sum()
        total = _all_reduce(part.reshape(1), norm_type)
        norm = _root(float(total), norm_type)
        with torch.no_grad():
            torch._foreach_mul_(grads, _coefficient(max_norm, norm))
        return norm

    return clip


def dtype_stack(job: Job, max_norm: float, norm_type: float) -> Clip:
    """Per-tensor ``torch.linalg.vector_norm`` in the gradients' own dtype, stacked and combined in that
    dtype (as torch's ``get_total_norm`` does), the rank's partial all-reduced in fp32.

    Right to the gradients' precision: each norm is accumulated in fp32 inside the kernel and rounded once
    to the gradient dtype (2^-9 in bf16), the stack of a few dozen norms rounded once more. Replicated
    pieces are divided by their count (a power of two: exact). Not offered at fp16 (range)."""

    def clip() -> float:
        grads = job.grads()
        dtype = grads[0].dtype
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads])
        if math.isinf(norm_type):
            part = norms.max()
        else:
            weights = torch.tensor([1.0 / job.replicas(p) for p in job.params], dtype=dtype)
            part = (norms.pow(norm_type) * weights).sum()
        total = _all_reduce(part.float().reshape(1), norm_type)
        norm = _root(float(total), norm_type)
        _scale(grads, _coefficient(max_norm, norm))
        return norm

    return clip


def fp32_upcast(job: Job, max_norm: float, norm_type: float) -> Clip:
    """Each local gradient upcast to fp32, sum of |g|^p (torch's CPU sum is blocked, so it stays within a
    few fp32 ulps), weighted 1 / replicas, one fp32 all-reduce.

    Right: fp32 holds |g|^p of any fp16 or bf16 gradient here, and the sums are exact to fp32's precision."""

    def clip() -> float:
        grads = job.grads()
        parts = [_power_sum(g.float(), norm_type) for g in grads]
        if math.isinf(norm_type):
            part = torch.stack(parts).max()
        else:
            part = torch.stack([x / job.replicas(p) for x, p in zip(parts, job.params)]).sum()
        total = _all_reduce(part.reshape(1), norm_type)
        norm = _root(float(total), norm_type)
        _scale(grads, _coefficient(max_norm, norm))
        return norm

    return clip


def loop_fp32(job: Job, max_norm: float, norm_type: float) -> Clip:
    """A Python loop: one ``vector_norm(g, dtype=torch.float32)`` per gradient, its p-th power added into an
    fp32 scalar (a replicated piece only on its owner rank), one all-reduce, a Python loop of ``mul_``.

    Right: a few dozen fp32 additions of positive terms lose nothing an fp32 norm may not, and the owner
    rule counts each replicated piece on exactly one of the ranks that hold it."""

    def clip() -> float:
        acc = torch.zeros((), dtype=torch.float32)
        for p in job.params:
            if not job.owner(p):
                continue
            n = torch.linalg.vector_norm(job.local(p), norm_type, dtype=torch.float32)
            acc = torch.maximum(acc, n) if math.isinf(norm_type) else acc + n.pow(norm_type)
        total = _all_reduce(acc.reshape(1), norm_type)
        norm = _root(float(total), norm_type)
        coefficient = _coefficient(max_norm, norm)
        with torch.no_grad():
            for g in job.grads():
                g.mul_(coefficient)
        return norm

    return clip


def _flat(job: Job, max_norm: float, norm_type: float, dtype: Any) -> Clip:
    """The owned local gradients concatenated into one flat buffer of ``dtype``, one ``vector_norm`` of it,
    an all-reduce of its p-th power."""

    def clip() -> float:
        owned = [job.local(p).reshape(-1).to(dtype) for p in job.params if job.owner(p)]
        flat = torch.cat(owned) if owned else torch.zeros(0, dtype=dtype)
        n = torch.linalg.vector_norm(flat, norm_type) if flat.numel() else torch.zeros((), dtype=dtype)
        part = n if math.isinf(norm_type) else n.double().pow(norm_type)
        return _reduce_and_scale(job, max_norm, norm_type, part)

    return clip


def flat_fp32(job: Job, max_norm: float, norm_type: float) -> Clip:
    """One fp32 flat buffer of the owned gradients, one ``torch.linalg.vector_norm`` (a replicated piece
    kept only on its owner rank).

    Right by the contract; its precision is torch's: a CPU fp32 norm of one long vector accumulates
    sequentially (docs/audit.md, "Limits": about 1e-5 off at 1M elements), and this buffer holds every
    gradient of the rank (measured 1e-5 to 6e-5 off at 1M parameters)."""
    return _flat(job, max_norm, norm_type, torch.float32)


def flat_fp64(job: Job, max_norm: float, norm_type: float) -> Clip:
    """``flat_fp32`` with a float64 buffer: the same counting, with no precision to lose."""
    return _flat(job, max_norm, norm_type, torch.float64)


def partial_divide(job: Job, max_norm: float, norm_type: float) -> Clip:
    """Local p-th power sums in float64, each replicated piece divided by its replica count, one
    all-reduce over every rank, ``torch.nn.utils.clip_grads_with_norm_`` on the local tensors.

    Right: a piece held by k ranks adds k * (1/k) of its p-th power to the sum; a shard adds its own once."""

    def clip() -> float:
        total = _all_reduce(torch.tensor([_exact_partials(job, norm_type)], dtype=torch.float64), norm_type)
        norm = _root(float(total), norm_type)
        holders = [_holder(g) for g in job.grads()]
        torch.nn.utils.clip_grads_with_norm_(holders, max_norm, torch.tensor(norm, dtype=torch.float64))
        return norm

    return clip


def _holder(grad: torch.Tensor) -> torch.Tensor:
    """A view of ``grad`` whose ``.grad`` is ``grad`` itself: ``clip_grads_with_norm_`` scales the ``.grad`` of
    what it is given, and a DTensor gradient's local shard has no parameter of its own."""
    holder = grad.detach().view_as(grad)
    holder.grad = grad
    return holder


def partial_subgroup(job: Job, max_norm: float, norm_type: float) -> Clip:
    """Local float64 p-th power sums bucketed by the mesh dims that shard each gradient, each bucket
    all-reduced over that group only (HSDP: the shard group, never the replicate one; a TP ``Replicate``
    bias: no reduction, its whole value is on every rank; DDP: nothing to reduce), buckets added after.

    Right: within a bucket the ranks of the group hold disjoint pieces of the same set of gradients, and
    every rank ends with the same whole-model sum without any replica counted twice."""

    def clip() -> float:
        buckets: dict[tuple[int, ...], list[float]] = {}
        groups: dict[tuple[int, ...], Any] = {}
        for p in job.params:
            dims = job.shard_dims(p)
            buckets.setdefault(dims, []).append(float(_power_sum(job.local(p).double(), norm_type)))
            groups.setdefault(dims, job.group(p))
        totals = []
        for dims in sorted(buckets):
            values = buckets[dims]
            part = torch.tensor([max(values) if math.isinf(norm_type) else math.fsum(values)], dtype=torch.float64)
            if groups[dims] is not None:
                _all_reduce(part, norm_type, groups[dims])
            totals.append(float(part))
        norm = _root(max(totals) if math.isinf(norm_type) else math.fsum(totals), norm_type)
        _scale(job.grads(), _coefficient(max_norm, norm))
        return norm

    return clip


def partial_owner(job: Job, max_norm: float, norm_type: float) -> Clip:
    """``torch.nn.utils.get_total_norm`` of this rank's owned local tensors (upcast to fp32: the range of any
    dtype), its p-th power all-reduced in float64 over every rank.

    Right: each replicated piece is counted on the one rank at coordinate 0 of its replicate dims, each
    shard on the rank that holds it, so the all-reduce adds every logical element once."""

    def clip() -> float:
        owned = [job.local(p).float() for p in job.params if job.owner(p)]
        local = torch.nn.utils.get_total_norm(owned, norm_type) if owned else torch.zeros(())
        part = local.double() if math.isinf(norm_type) else local.double().pow(norm_type)
        return _reduce_and_scale(job, max_norm, norm_type, part)

    return clip


def rows_fp64(job: Job, max_norm: float, norm_type: float) -> Clip:
    """Norms by rows of ``ROWS`` elements in fp32, combined in float64 (the way ``bench/audit_bench.py``
    takes its norms), replicas divided by their count, one all-reduce.

    Right: each row's fp32 norm is a short sum; everything past it is float64."""

    def clip() -> float:
        parts = []
        for p in job.params:
            g = job.local(p).reshape(-1)
            pad = (-g.numel()) % ROWS
            rows = torch.nn.functional.pad(g.float(), (0, pad)).view(-1, ROWS)
            per_row = torch.linalg.vector_norm(rows, norm_type, dim=1).double()
            if math.isinf(norm_type):
                parts.append(float(per_row.max()) if per_row.numel() else 0.0)
            else:
                parts.append(float(per_row.pow(norm_type).sum()) / job.replicas(p))
        part = max(parts) if math.isinf(norm_type) else math.fsum(parts)
        return _reduce_and_scale(job, max_norm, norm_type, torch.tensor(part, dtype=torch.float64))

    return clip


# ----------------------------------------------------------------------------------------------------------
# Arithmetic clips: counting as above, one step carried out in a dtype that cannot hold it.
# ----------------------------------------------------------------------------------------------------------


def _weighted_total(job: Job, norm_type: float, part_of: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """``part_of`` each local gradient (its p-th power sum, in whatever dtype it chose), weighted
    1 / replicas in float64, one float64 all-reduce: the counting of ``partial_divide``."""
    parts = [float(part_of(job.local(p))) for p in job.params]
    if math.isinf(norm_type):
        part = max(parts, default=0.0)
    else:
        part = math.fsum(x / job.replicas(p) for x, p in zip(parts, job.params))
    return float(_all_reduce(torch.tensor([part], dtype=torch.float64), norm_type))


def _weighted_clip(
    job: Job, max_norm: float, norm_type: float, part_of: Callable[[torch.Tensor], torch.Tensor]
) -> Clip:
    """A clip whose only wrong step is ``part_of``: counted as ``_weighted_total`` counts, the coefficient and
    the scaling the contract's, so what the judge sees off is that one step's arithmetic."""

    def clip() -> float:
        norm = _root(_weighted_total(job, norm_type, part_of), norm_type)
        _scale(job.grads(), _coefficient(max_norm, norm))
        return norm

    return clip


def bf16_chunk_accum(job: Job, max_norm: float, norm_type: float) -> Clip:
    """|g|^p summed per chunk of ``CHUNK`` elements in fp32, the chunk sums of every local gradient then
    added one by one into one running bf16 scalar (a Python loop: each addition rounded to bf16), each
    replicated piece's chunks halved as often as it has copies (a power of two: exact); the rank's total
    all-reduced in float64.

    Wrong arithmetic: once the running sum is 2^8 times a chunk's sum, adding a chunk moves it by at most
    one bf16 ulp, so the tail of a few thousand chunks is rounded away."""

    def clip() -> float:
        acc = torch.zeros((), dtype=torch.bfloat16)
        for p in job.params:
            flat = job.local(p).reshape(-1).float()
            chunks = torch.nn.functional.pad(flat, (0, (-flat.numel()) % CHUNK)).view(-1, CHUNK)
            if math.isinf(norm_type):
                acc = torch.maximum(acc, chunks.abs().max().bfloat16())
                continue
            for s in (chunks.abs().pow(norm_type).sum(dim=1) / job.replicas(p)).bfloat16():
                acc = acc + s
        return _reduce_and_scale(job, max_norm, norm_type, acc)

    return clip


def bf16_square_sum(job: Job, max_norm: float, norm_type: float) -> Clip:
    """Each gradient cast to bf16, |g|^p taken in bf16 and summed with ``sum(dtype=torch.bfloat16)``.

    Wrong arithmetic, but mildly: torch's CPU sum of bf16 accumulates in fp32 inside the kernel (measured:
    a bf16 sum of 1M squares is 3e-4 off, not more), so the error is each square's and the result's
    rounding to bf16: within a bf16 tolerance, outside an fp32 one."""

    def part_of(g: torch.Tensor) -> torch.Tensor:
        b = g.bfloat16()
        if math.isinf(norm_type):
            return b.abs().max()
        return b.abs().pow(norm_type).sum(dtype=torch.bfloat16)

    return _weighted_clip(job, max_norm, norm_type, part_of)


def fp16_pow_overflow(job: Job, max_norm: float, norm_type: float) -> Clip:
    """|g|^p taken in fp16 (``g.half().abs().pow(p)``), then summed in fp32.

    Wrong arithmetic: any |g| above 256 squares past 65504 (above 40.3 for p = 3) and becomes inf, so the
    norm is inf and the coefficient 0. Gradients below that square exactly enough: then it is right to
    fp16's rounding of each square (2^-11)."""

    def part_of(g: torch.Tensor) -> torch.Tensor:
        h = g.half().abs()
        if math.isinf(norm_type):
            return h.max()
        return h.pow(norm_type).sum(dtype=torch.float32)

    return _weighted_clip(job, max_norm, norm_type, part_of)


def fp16_coefficient(job: Job, max_norm: float, norm_type: float) -> Clip:
    """The norm exact (float64), the coefficient computed in fp16 tensors before the multiply.

    Wrong arithmetic: a norm above 65504 is inf in fp16 and the coefficient 0 (every gradient zeroed); a
    coefficient below 6.1e-5 is subnormal in fp16 and keeps few bits; otherwise it is rounded by 2^-11."""

    def clip() -> float:
        norm = _root(_weighted_total(job, norm_type, lambda g: _power_sum(g.double(), norm_type)), norm_type)
        half = torch.tensor(max_norm, dtype=torch.float16) / (torch.tensor(norm, dtype=torch.float16) + EPS)
        coefficient = float(half.clamp(max=1.0))
        _scale(job.grads(), coefficient)
        return norm

    return clip


def fp16_norm_roundtrip(job: Job, max_norm: float, norm_type: float) -> Clip:
    """The norm exact (float64), then rounded through fp16 before it is returned and used.

    Wrong arithmetic: a norm above 65504 comes back inf (coefficient 0); below it is 2^-11 off."""

    def clip() -> float:
        exact = _root(_weighted_total(job, norm_type, lambda g: _power_sum(g.double(), norm_type)), norm_type)
        norm = float(torch.tensor(exact, dtype=torch.float16))
        _scale(job.grads(), _coefficient(max_norm, norm))
        return norm

    return clip


def fp16_allreduce(job: Job, max_norm: float, norm_type: float) -> Clip:
    """Each rank's partial p-th power sum exact (float64, replicas divided by their count), then cast to
    fp16 for the all-reduce.

    Wrong arithmetic: a partial sum of squares above 65504 (a norm above 256) is inf in fp16; below it is
    rounded by 2^-11, and the fp16 sum of the partials rounded again."""

    def clip() -> float:
        part = _exact_partials(job, norm_type)
        total = _all_reduce(torch.tensor([part], dtype=torch.float16), norm_type)
        norm = _root(float(total), norm_type)
        _scale(job.grads(), _coefficient(max_norm, norm))
        return norm

    return clip


def bf16_coefficient(job: Job, max_norm: float, norm_type: float) -> Clip:
    """The norm exact (float64), the coefficient rounded to bf16 before the multiply.

    Wrong arithmetic by at most 2^-9 of the coefficient: outside an fp32 tolerance, inside a bf16 one."""

    def clip() -> float:
        norm = _root(_weighted_total(job, norm_type, lambda g: _power_sum(g.double(), norm_type)), norm_type)
        coefficient = torch.tensor(_coefficient(max_norm, norm), dtype=torch.bfloat16)
        with torch.no_grad():
            for g in job.grads():
                g.mul_(coefficient)
        return norm

    return clip


def torch_clip_fp16(job: Job, max_norm: float, norm_type: float) -> Clip:
    """``torch.nn.utils.clip_grad_norm_`` on fp16 gradients: ``torch_clip`` itself, offered at fp16 only.

    Its counting is right (see ``torch_clip``); its arithmetic is fp16's: each per-tensor norm and the total
    are fp16 tensors, so a norm above 65504 is inf and the coefficient 0 (``error_if_nonfinite`` is off by
    default)."""
    return torch_clip(job, max_norm, norm_type)


@dataclass(frozen=True)
class Entry:
    """One clip of the zoo: its name, its kind, how to build it, and where it is offered."""

    name: str
    kind: str
    make: Maker
    layouts: tuple[str, ...] = LAYOUTS
    dtypes: tuple[str, ...] = DTYPES

    def offered(self, layout: str, dtype: str) -> bool:
        return layout in self.layouts and dtype in self.dtypes


NOT_FP16 = ("fp32", "bf16", "autocast")
ZOO: tuple[Entry, ...] = (
    Entry("torch_clip", "correct", torch_clip, dtypes=NOT_FP16),
    Entry("dtensor_total", "correct", dtensor_total, layouts=DTENSOR_LAYOUTS, dtypes=NOT_FP16),
    Entry("dtensor_per_param", "correct", dtensor_per_param, layouts=DTENSOR_LAYOUTS, dtypes=NOT_FP16),
    Entry("foreach_norm", "correct", foreach_norm),
    Entry("dtype_stack", "correct", dtype_stack, dtypes=NOT_FP16),
    Entry("fp32_upcast", "correct", fp32_upcast),
    Entry("loop_fp32", "correct", loop_fp32),
    Entry("flat_fp32", "correct", flat_fp32),
    Entry("flat_fp64", "correct", flat_fp64),
    Entry("partial_divide", "correct", partial_divide),
    Entry("partial_subgroup", "correct", partial_subgroup),
    Entry("partial_owner", "correct", partial_owner),
    Entry("rows_fp64", "correct", rows_fp64),
    Entry("bf16_chunk_accum", "arithmetic", bf16_chunk_accum),
    Entry("bf16_square_sum", "arithmetic", bf16_square_sum),
    Entry("fp16_pow_overflow", "arithmetic", fp16_pow_overflow),
    Entry("fp16_coefficient", "arithmetic", fp16_coefficient),
    Entry("fp16_norm_roundtrip", "arithmetic", fp16_norm_roundtrip),
    Entry("fp16_allreduce", "arithmetic", fp16_allreduce),
    Entry("bf16_coefficient", "arithmetic", bf16_coefficient),
    Entry("torch_clip_fp16", "arithmetic", torch_clip_fp16, dtypes=("fp16",)),
)


# ----------------------------------------------------------------------------------------------------------
# The job: a model as users build it, one real backward, then every clip audited on the same gradients.
# ----------------------------------------------------------------------------------------------------------


def _layers(params: float, width: int) -> int:
    """An even number of square layers (TP pairs colwise with rowwise) holding about ``params``."""
    return max(2, 2 * round(params / (2 * (width * width + width))))


def build_job(args: argparse.Namespace, world: int, rank: int) -> tuple[Job, Any]:
    """The model laid out as ``--layout`` says, after one forward and backward; returns it and its mesh."""
    width, layers = args.width, _layers(args.params, args.width)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "autocast": torch.float32}
    torch.manual_seed(0)
    modules: list[nn.Module] = []
    for i in range(layers):
        modules.append(nn.Linear(width, width))
        if i < layers - 1:
            modules.append(nn.ReLU())
    body = nn.Sequential(*modules).to(dtype[args.dtype])
    mesh: DeviceMesh | None = None
    model: nn.Module
    if args.layout == "ddp":
        model = nn.parallel.DistributedDataParallel(body)
    elif args.layout in ("fsdp2", "hsdp"):
        from torch.distributed.fsdp import fully_shard

        if args.layout == "fsdp2":
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        else:
            if world % 2 or world < 4:
                raise SystemExit("hsdp needs an even world of at least 4 ranks: (replicate=2, shard=world/2)")
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for m in body:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(body, mesh=mesh)
        model = body
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if width % world:
            raise SystemExit(f"tp needs --width divisible by the world ({width} % {world})")
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        plan: dict[str, Any] = {str(2 * i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                                for i in range(layers)}
        model = parallelize_module(body, mesh, plan)
    torch.manual_seed(100 + (0 if args.layout == "tp" else rank))  # TP ranks share a batch; the others own one
    x = torch.randn(args.batch, width, dtype=dtype[args.dtype])
    if args.dtype == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
    else:
        out = model(x)
    out.float().pow(2).mean().backward()
    params = [p for p in model.parameters() if p.grad is not None]
    job = Job(model=model, layout=args.layout, dtype=args.dtype, world=world, rank=rank, params=params)
    _loss_scale(job, args.loss_scale)
    return job, mesh


def _loss_scale(job: Job, how: str) -> float:
    """Multiply every gradient by a power of two: ``auto`` puts the largest element of the job in
    [8192, 16384) (squares and norms past fp16's range, as a loss-scaled fp16 step has them, each element
    still an fp16 number); a number is used as it is given."""
    if how == "auto":
        biggest = torch.tensor([max(float(g.abs().max()) for g in job.grads())], dtype=torch.float64)
        _all_reduce(biggest, math.inf)
        scale = 2.0 ** (13 - math.floor(math.log2(float(biggest)))) if float(biggest) > 0 else 1.0
    else:
        scale = float(how)
    if scale != 1.0:
        _scale(job.grads(), scale)
    return scale


@dataclass
class Row:
    """What one clip's audit came to, on rank 0."""

    name: str
    kind: str
    verdict: str
    ratio: float | None
    true_norm: float | None
    reported: list[float | None] = field(default_factory=list)
    own: float | None = None
    coefficient_error: float | None = None
    seconds: float = 0.0
    text: str = ""

    def first_failure(self) -> str:
        """The judge's first indented line (under its header and the case's row): its first failed check,
        or for an ERROR what broke."""
        lines = self.text.splitlines()
        indented = [line.strip() for line in lines if line[:1].isspace() and line.strip()]
        return indented[0] if indented else (lines[-1].strip() if lines else "")


def _returned(value: Any) -> float | None:
    """The clip's returned norm as a float (a DTensor made whole); None for a clip that returned nothing."""
    if value is None:
        return None
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return float(value)


def judge_source() -> str:
    """Where ``harness`` was imported from, and its git commit (with "+ local changes" when harness/ differs
    from it): the judge's verdicts are those of that tree."""
    import subprocess

    import harness

    where = Path(harness.__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--", "."], capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head, dirty = "", ""
    return f"{where} at {head or 'no git commit'}" + (" + local changes" if dirty else "")


def rank_main(args: argparse.Namespace) -> None:
    from harness.auditor import audit  # harness.audit itself, typed (the package exports it lazily)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    job, mesh = build_job(args, world, rank)
    norm_type = math.inf if args.norm == "inf" else float(args.norm)
    saved = [g.detach().clone() for g in job.grads()]
    truth = exact_norm(job, norm_type)
    max_norm = args.max_norm if args.max_norm is not None else args.clip_ratio * truth
    expected = _coefficient(max_norm, truth)
    chosen = [e for e in ZOO if e.offered(args.layout, args.dtype) and (not args.only or e.name in args.only)]
    if rank == 0:
        elements = sum(p.numel() for p in job.params)
        print(f"clip_zoo: {args.layout} world {world}, {args.dtype}, L{args.norm}, {elements} parameters "
              f"({_layers(args.params, args.width)} layers of width {args.width}), loss scale {args.loss_scale}; "
              f"float64 norm {truth:.9g}, max_norm {max_norm:.6g}, coefficient {expected:.6g}; "
              f"restore={args.restore}", flush=True)
        print(f"judge: {judge_source()}", flush=True)
        print(f"{'clip':<20} {'kind':<10} {'verdict':<7} {'ratio':>10} {'own':>10} {'coef err':>9} "
              f"{'secs':>6}  first failed check", flush=True)
    rows: list[Row] = []
    for entry in chosen:
        with torch.no_grad():
            for g, copy in zip(job.grads(), saved):
                g.copy_(copy)
        clip = entry.make(job, max_norm, norm_type)
        dist.barrier()
        start = time.perf_counter()
        report = audit(job.model, clip, max_norm=max_norm, norm_type=norm_type, mesh=mesh,
                       restore=args.restore, timeout_s=args.timeout, label=entry.name)
        seconds = time.perf_counter() - start
        if report.broken:  # a rank hung or died in the clip: the job's groups cannot be trusted any more
            if rank == 0:
                print(f"{entry.name}: {report.verdict}, the world is broken; stopping", flush=True)
                print(report.describe(), flush=True)
            break
        applied: float | None = None
        if not args.restore and report.verdict != "ERROR":
            after = exact_norm(job, norm_type)
            applied = after / truth if truth > 0 else None
        returned = _returned(report.value) if report.verdict != "ERROR" else None
        if rank == 0:
            record: dict[str, Any] = dict(report.record() or {})
            row = Row(name=entry.name, kind=entry.kind, verdict=report.verdict, ratio=_number(record.get("ratio")),
                      true_norm=_number(record.get("true_norm")),
                      reported=[_number(v) for v in record.get("reported") or []],
                      own=returned / truth if returned is not None and truth > 0 else None,
                      coefficient_error=(abs(applied - expected) / expected if applied is not None and expected > 0
                                         else None),
                      seconds=seconds, text=report.describe())
            rows.append(row)
            _print_row(row, args.verbose)
    if rank == 0:
        _summary(rows)
        if args.json:
            Path(args.json).write_text(json.dumps({
                "world": world, "layout": args.layout, "dtype": args.dtype, "norm": args.norm,
                "params": args.params, "width": args.width, "loss_scale": args.loss_scale,
                "max_norm": max_norm, "float64_norm": truth, "restore": args.restore,
                "rows": [row.__dict__ for row in rows]}, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


def _number(value: Any) -> float | None:
    """A record's number as a float: JSON keeps a non-finite one as text ("inf", "nan"), float reads it back."""
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _fmt(value: float | None, spec: str) -> str:
    """``value`` by ``spec`` ("10.6f"); a missing one as "-" in the same width."""
    return "-".rjust(int(spec.split(".")[0])) if value is None else format(value, spec)


def _print_row(row: Row, verbose: bool) -> None:
    failure = row.first_failure() if row.verdict != "PASS" else ""
    print(f"{row.name:<20} {row.kind:<10} {row.verdict:<7} {_fmt(row.ratio, '10.6f')} {_fmt(row.own, '10.6f')} "
          f"{_fmt(row.coefficient_error, '9.2e')} {row.seconds:6.2f}  {failure[:110]}", flush=True)
    if verbose:
        for line in row.text.splitlines()[1:]:
            print(f"    {line}", flush=True)


def _summary(rows: list[Row]) -> None:
    correct = [r for r in rows if r.kind == "correct"]
    arithmetic = [r for r in rows if r.kind == "arithmetic"]
    failed = [r.name for r in correct if r.verdict != "PASS"]
    passed = [r.name for r in arithmetic if r.verdict == "PASS"]
    print(f"correct FAIL {len(failed)}/{len(correct)}" + (f" ({', '.join(failed)})" if failed else ""))
    print(f"arithmetic PASS {len(passed)}/{len(arithmetic)}" + (f" ({', '.join(passed)})" if passed else ""),
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--params", type=float, default=1e6, help="about this many parameters (default 1e6)")
    parser.add_argument("--width", type=int, default=512, help="the square layers' width (default 512)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--layout", choices=LAYOUTS, default="fsdp2")
    parser.add_argument("--norm", default="2", help="the norm type: 1, 2, 3, ..., or inf (default 2)")
    parser.add_argument("--loss-scale", default="auto",
                        help="auto (largest element in [8192, 16384)) or a number the gradients are multiplied by")
    parser.add_argument("--clip-ratio", type=float, default=0.3,
                        help="max_norm as a multiple of the float64 norm (default 0.3: no low dtype holds 0.3 exactly)")
    parser.add_argument("--max-norm", type=float, default=None, help="an absolute max_norm instead")
    parser.add_argument("--restore", action="store_true", help="audit with restore=True (blame; slower)")
    parser.add_argument("--timeout", type=float, default=60.0, help="the audit's timeout_s")
    parser.add_argument("--only", type=lambda s: s.split(","), default=None, help="comma-separated clip names")
    parser.add_argument("--verbose", action="store_true", help="print the judge's whole text under each row")
    parser.add_argument("--json", default=None)
    parser.add_argument("--list", action="store_true", help="list the clips and exit")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.list:
        for e in ZOO:
            doc = (e.make.__doc__ or "").strip().split("\n")[0]
            print(f"{e.name:<20} {e.kind:<10} {doc}")
        return
    if args.params > 1e7:
        raise SystemExit("--params above 1e7 is more than this bench is meant for")
    if args.rank:
        rank_main(args)
        return
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world}",
           __file__, "--rank", *sys.argv[1:]]
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
