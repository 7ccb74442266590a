"""Norm arithmetic shared by the oracle, the reference clip and the framework-style targets.

One definition of "the p-th power sum of a gradient", "combine two partial sums" and "apply a clip
coefficient" keeps every consumer honest: the oracle and the reference cannot drift apart, and the
framework-style emulations differ from the reference only in the mistake they model.

All accumulation is float64 so that the harness's own arithmetic never limits what it can detect.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

EPS = 1e-6
"""The epsilon torch.nn.utils.clip_grad_norm_ adds to the norm before dividing."""


def is_inf_norm(norm_type: float) -> bool:
    return math.isinf(norm_type)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a plain tensor or a DTensor (a view, writes go through)."""
    return t.to_local() if isinstance(t, DTensor) else t


CPU_BLOCK = 1 << 16
"""Elements per float64 block on CPU: the upcast of a block stays in cache, so a gradient's power
sum is one pass over its bytes instead of three over float64 copies the size of the gradient
(``bench/oracle_bench.py``; the figures: docs/performance.md, "Figures cited by the code")."""


def kernel_norm(t: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The norm of ``t`` as torch's own kernel computes it for a correct clip (``torch.linalg.vector_norm``,
    which ``clip_grad_norm_``, ``get_total_norm`` and a DTensor's partial norms all run; ``_foreach_norm``
    runs the same kernel on CPU), accumulating in fp32 for bf16 and fp16 gradients and in the gradient's
    own dtype otherwise, before any rounding of the result to the gradient dtype: a 0-dim float64 tensor
    on ``t``'s device. Why measure it: torch's CPU kernel does not sum pairwise, and on a large fp32
    gradient it is further from the exact value than any analytic bound of a pairwise sum
    (``harness.judge.tolerance``, the band; the figures: docs/reading-a-failure.md)."""
    x = local_tensor(t).detach().reshape(-1)
    if x.numel() == 0 or not x.is_floating_point():  # nothing to measure (an empty tensor's inf norm is an error)
        return torch.zeros((), dtype=torch.float64, device=x.device)
    accumulate = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    return torch.linalg.vector_norm(x, norm_type, dtype=accumulate).to(torch.float64)


KERNEL_ERROR_CAP = 1e-3
"""The largest distance of a kernel's norm from the exact one that is taken for rounding. Past it, the
kernel failed otherwise (squares underflowing or overflowing its accumulator, no floating values at all),
and that must not widen a case's band: a miscounted group would hide in it."""


def kernel_error(kernel: float, exact_pow: float, norm_type: float) -> float:
    """The relative error of a kernel's norm of a gradient (``kernel_norm``) from its exact norm
    (``exact_pow``: the float64 p-th power sum, or the maximum for the inf norm), signed (kernel / exact - 1:
    the band replays the sums it enters), where it is rounding; 0 where either is not finite, the gradient
    is zero, or the distance is past ``KERNEL_ERROR_CAP``."""
    exact = root(exact_pow, norm_type)
    if not (math.isfinite(kernel) and math.isfinite(exact)) or exact == 0.0:
        return 0.0
    error = kernel / exact - 1.0
    return error if abs(error) <= KERNEL_ERROR_CAP else 0.0


FLAT_LIMIT = 1 << 24
"""The most elements of a rank's gradients the flat-buffer measurement concatenates (``flat_error``)."""

FLAT_SHARE = 64
"""Past ``FLAT_FLOOR`` elements, the flat buffer measured holds at most this fraction (1/64) of the rank's
gradient elements: its copy and its kernel then cost a few hundredths of a pass over them, which keeps the
audit within its cost budget (one extra pass; docs/performance.md); ``FLAT_LIMIT`` bounds its memory
whatever the model's size. The price: a clip that flattens more than that into one CPU kernel is measured
on a shorter buffer than its own (docs/reading-a-failure.md, "The band")."""

FLAT_FLOOR = 1 << 22
"""The flat buffer's size below which it is measured whole, whatever share of the rank's gradients it is."""


def flat_error(grads: Sequence[torch.Tensor], exact_pows: Sequence[float], norm_type: float) -> float:
    """The relative error (``kernel_error``) of torch's kernel on one flat buffer of a rank's gradients: the
    concatenation of its first gradients (``grads`` in order, whole tensors, those of the first one's dtype
    and device) up to ``flat_size`` elements, against the exact norm of the same gradients (``exact_pows``,
    their float64 p-th power sums). Why: a clip that flattens its gradients (one buffer, one
    ``vector_norm``: DeepSpeed's and apex's buckets) sums far more elements in one kernel than any
    per-gradient measurement does, and on a CPU that kernel's error grows with the length. A rank holding
    more is measured on its first bucket of that size (what a bucketed clip sums); 0 where fewer than two
    gradients fit (the per-gradient measurement is that buffer) and for the inf norm (a maximum is exact)."""
    if is_inf_norm(norm_type) or not grads:
        return 0.0
    local = [local_tensor(g) for g in grads]
    first = local[0]
    if not first.is_floating_point():
        return 0.0
    same = [(x, power) for x, power in zip(local, exact_pows) if x.dtype == first.dtype and x.device == first.device]
    limit = flat_size(sum(x.numel() for x, _ in same))
    bucket: list[torch.Tensor] = []
    exact, size = 0.0, 0
    for x, power in same:
        if size + x.numel() > limit and bucket:
            break
        bucket.append(x.detach().reshape(-1))
        exact, size = exact + power, size + x.numel()
    if len(bucket) < 2 or size > limit:
        return 0.0
    return kernel_error(float(kernel_norm(torch.cat(bucket), norm_type)), exact, norm_type)


def flat_size(elements: int) -> int:
    """The most elements ``flat_error`` concatenates for a rank holding ``elements`` gradient elements."""
    return min(FLAT_LIMIT, max(FLAT_FLOOR, elements // FLAT_SHARE))


def pow_sum(t: torch.Tensor, norm_type: float) -> float:
    """sum |t|^p accumulated in float64, or max |t| for the inf norm (exact in the gradient's own
    dtype, NaN kept); 0 for an empty tensor."""
    x = local_tensor(t).detach().reshape(-1)
    if x.numel() == 0:
        return 0.0
    if is_inf_norm(norm_type):
        low, high = torch.aminmax(x)
        top = max(-float(low), float(high))
        return math.nan if math.isnan(float(low)) else top
    block = CPU_BLOCK if x.device.type == "cpu" else x.numel()  # one kernel per pass on an accelerator
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for part in x.split(block):
        y = part.to(torch.float64)
        total += torch.dot(y, y) if norm_type == 2 else y.abs().pow(norm_type).sum()
    return float(total)


def combine(a: float, b: float, norm_type: float) -> float:
    """Merge two partial pow sums (sum) or two partial maxima (max), keeping NaN visible."""
    if is_inf_norm(norm_type):
        if math.isnan(a) or math.isnan(b):
            return math.nan
        return max(a, b)
    return a + b


def root(total: float, norm_type: float) -> float:
    """Turn a global pow sum into a norm; the inf norm is already a norm."""
    if is_inf_norm(norm_type):
        return total
    return total ** (1.0 / norm_type) if total >= 0 or math.isnan(total) else math.nan


def reduce_op(norm_type: float) -> dist.ReduceOp.RedOpType:
    """The collective that merges partial results for this norm."""
    return dist.ReduceOp.MAX if is_inf_norm(norm_type) else dist.ReduceOp.SUM


def collective_device() -> torch.device:
    """Where a tensor must live to go through the default group's backend."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collective_scalar(value: float) -> torch.Tensor:
    """A float64 scalar on the device the default group's backend reduces on."""
    return torch.tensor(value, dtype=torch.float64, device=collective_device())


def smallest_normal(dtype: torch.dtype) -> float:
    """The smallest positive normal number of ``dtype`` (0 for a non-floating one): below it, roundings are
    absolute (``subnormal_spacing``)."""
    return float(torch.finfo(dtype).smallest_normal) if dtype.is_floating_point else 0.0


def subnormal_spacing(dtype: torch.dtype) -> float:
    """The distance between two neighbouring subnormal numbers of ``dtype`` (0 for a non-floating one): below
    the smallest normal number a rounding's error is at most half of it, an absolute amount, not a relative
    one. A correctly clipped element rounds at most twice (a product, a quotient), so it may land one
    spacing from ``c * before`` however small it is: the uniformity residual allows that much."""
    return smallest_normal(dtype) * float(torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """min(1, max_norm / (total + eps)), as torch computes it; NaN when the norm is not finite."""
    if not math.isfinite(total_norm):
        return math.nan
    return min(1.0, max_norm / (total_norm + EPS))


def trainable_with_grads(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.grad is not None]


def weighted_partial(
    params: Iterable[tuple[str, nn.Parameter]],
    norm_type: float,
    replica_count: Callable[[str, nn.Parameter], int],
) -> float:
    """This rank's share of the global p-th power sum: each local gradient's sum |g|^p divided by the
    number of ranks holding the same slice (so a sum over all ranks counts it once). For the inf norm,
    the local maximum: replicas do not change a maximum."""
    local = 0.0
    for name, p in params:
        part = pow_sum(cast(torch.Tensor, p.grad), norm_type)  # params with gradients, by contract
        if not is_inf_norm(norm_type):
            part /= replica_count(name, p)
        local = combine(local, part, norm_type)
    return local


def scale_grads_(params: Iterable[nn.Parameter], coefficient: float) -> None:
    """Multiply every gradient in place by a finite coefficient below 1 (a no-op otherwise)."""
    if not math.isfinite(coefficient) or coefficient >= 1.0:
        return
    for p in params:
        if p.grad is not None:
            local_tensor(p.grad).mul_(coefficient)


def reduce_root_and_clip(
    local: float,
    params: Iterable[nn.Parameter],
    *,
    max_norm: float,
    norm_type: float,
    group: dist.ProcessGroup | None = None,
) -> float:
    """Finish a layout-aware clip: one all-reduce of the rank's partial (SUM of already de-duplicated
    p-th powers, or MAX for the inf norm), one root, then the clip. Returns the global norm.

    A NaN flag rides along with the value because gloo's float MAX can drop a NaN depending on rank
    order; with it every rank sees the same non-finite verdict.
    """
    total = torch.tensor([local, float(math.isnan(local))], dtype=torch.float64, device=collective_device())
    dist.all_reduce(total, op=reduce_op(norm_type), group=group)
    norm = math.nan if total[1] > 0 else root(float(total[0]), norm_type)
    scale_grads_(params, clip_coefficient(max_norm, norm))
    return norm
