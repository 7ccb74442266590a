"""One pass over a rank's gradients where they lie: what ``harness.audit`` keeps of them instead of a copy.

Per gradient, on its own device, at about the cost of taking its norm once:

* ``rows``: the 2-norm of every row of ``ROW`` consecutive elements (the last row shorter), in fp32 for
  fp32/bf16/fp16 gradients (each row summed in fp32, a few units in the last place; fp64 for fp64),
  kept on the device (1/256 of the gradient's elements) until the clip has run: the coefficient a clip
  applied is ``sqrt(sum rows_after^2 / sum rows_before^2)``, and the row-by-row ratios tell a uniform
  scaling from one that is not (``cheap_coefficient``);
* ``sq``: sum g^2 from the rows, in float64; ``pow``: the truth's sum |g|^p (``sq`` for the 2-norm; other
  norms need one more pass, in float64 blocks as ``clipmath.pow_sum`` does; max |g| for the inf norm);
* ``samples``: a few elements at fixed positions spread over the tensor, as values and as raw bits
  (``words``): the bits tell gradients apart without hashing them (different bits there: different
  gradients), the values check the coefficient element by element, and its sign;
* ``zero``: every element is zero (+0 or -0), checked exactly (``aminmax``) where the sums say zero;
* for a non-finite gradient, its count of NaNs and infinities, and its first non-finite element;
* ``digest`` (``measure.linear_digest``), only where asked: a gradient whose shape, dtype and sampled
  bits equal another holding's may be a copy of it, and only the digest can say.

Every number of every gradient reaches the host in one transfer per device at the end (``finish``), so
a GPU pass is a few kernels per gradient and one synchronization, never a copy of the gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from harness.clipmath import CPU_BLOCK, flat_error, is_inf_norm, kernel_error, kernel_norm
from harness.run.case.measure import linear_digest

SAMPLES = 16
"""Elements sampled per gradient: spread evenly, the same positions on every rank for one shape."""

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

DTYPE_LABELS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def dtype_label(dtype: torch.dtype) -> str:
    """The harness's name of a gradient dtype (``fp32``...), or torch's own for any other."""
    return DTYPE_LABELS.get(dtype, str(dtype).replace("torch.", ""))


def sample_positions(numel: int) -> list[int]:
    """Where a tensor of ``numel`` elements is sampled: up to ``SAMPLES`` evenly spread positions."""
    if numel <= SAMPLES:
        return list(range(numel))
    return [((2 * j + 1) * numel) // (2 * SAMPLES) for j in range(SAMPLES)]


ROW = 256
"""Elements per row of ``Stats.rows``."""


@dataclass
class Stats:
    """What one pass kept of one gradient (the numbers on the host once the pass has finished)."""

    shape: tuple[int, ...]
    dtype: str
    numel: int
    itemsize: int
    device: str
    pow: float = 0.0
    sq: float = 0.0
    zero: bool = False
    """All elements zero (+0 or -0): they carry no norm whatever their signs."""
    values: list[float] = field(default_factory=list)
    words: list[int] = field(default_factory=list)
    nonfinite: tuple[int, int] = (0, 0)
    """(NaNs, infinities), counted only for a gradient whose sums are not finite."""
    first_nonfinite: tuple[int, str] | None = None
    """Flat index and kind ("nan", "inf", "-inf") of its first non-finite element (a NaN first)."""
    digest: str | None = None
    rows: torch.Tensor | None = field(default=None, repr=False)
    """The row norms, on the gradient's device (``ROW``)."""
    kernel_error: float = 0.0
    """How far torch's own norm kernel is from this gradient's exact norm (``clipmath.kernel_error``):
    what the audit's band is measured from, as a case's is."""

    @property
    def finite(self) -> bool:
        return math.isfinite(self.sq) and math.isfinite(self.pow)

    def record(self) -> list[Any]:
        """What travels to rank 0 in the first round: enough to find the classes of copies."""
        return [list(self.shape), self.dtype, self.numel, self.itemsize, self.pow, self.zero, self.words,
                list(self.first_nonfinite) if self.first_nonfinite is not None else None, self.sq,
                self.kernel_error]


class GradientPass:
    """One pass over many gradients: queue them with ``add``, then ``finish`` once."""

    def __init__(self, norm_type: float, band: bool = False) -> None:
        self.norm_type = norm_type
        self.band = band
        """Measure each gradient's ``kernel_error`` and the rank's ``flat_error`` too (the first pass: the case's
        band; one more read, and one flat buffer of at most ``clipmath.FLAT_LIMIT`` elements)."""
        self.flat_error = 0.0
        """The rank's ``clipmath.flat_error`` over the gradients in the order they were added (``band``)."""
        self._pending: list[tuple[torch.Tensor, Stats, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, grad: torch.Tensor, digest: bool = False) -> Stats:
        """Queue one gradient; its ``Stats`` are filled in by ``finish``."""
        flat = grad.detach().contiguous().reshape(-1)
        stats = Stats(tuple(grad.shape), dtype_label(grad.dtype), flat.numel(), grad.element_size(),
                      str(grad.device))
        stats.rows = row_norms(flat)
        power = self._power(flat, stats.rows)
        positions = torch.tensor(sample_positions(flat.numel()), dtype=torch.int64, device=flat.device)
        values = flat[positions].to(torch.float64)
        bits = _BITS.get(flat.element_size())
        words = (flat.view(bits)[positions] if bits is not None else positions).to(torch.int64)
        if digest:
            stats.digest = linear_digest(grad)
        squares = stats.rows.to(torch.float64).square().sum()
        kernel = kernel_norm(flat, self.norm_type) if self.band else squares.new_zeros(())  # the band's one pass
        self._pending.append((flat, stats, torch.stack([power if power is not None else squares, squares, kernel]),
                              values, words))
        return stats

    def _power(self, flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """sum |g|^p on the device (None: the 2-norm's, which is ``sq``)."""
        p = self.norm_type
        if p == 2 or flat.numel() == 0:
            return None
        if is_inf_norm(p):
            low, high = torch.aminmax(flat)
            top = torch.maximum(-low, high).to(torch.float64)
            return torch.where(torch.isnan(low) | torch.isnan(high), torch.nan, top)
        total = torch.zeros((), dtype=torch.float64, device=flat.device)
        for part in flat.split(CPU_BLOCK if flat.device.type == "cpu" else flat.numel()):
            total += torch.linalg.vector_norm(part.to(torch.float64), p) ** p
        return total

    def finish(self) -> None:
        """Every queued gradient's numbers on the host: one transfer per device."""
        by_device: dict[torch.device, list[int]] = {}
        for i, entry in enumerate(self._pending):
            by_device.setdefault(entry[2].device, []).append(i)
        for indices in by_device.values():
            entries = [self._pending[i] for i in indices]
            sums = torch.stack([e[2] for e in entries]).tolist()
            values = torch.cat([e[3] for e in entries]).tolist()
            words = torch.cat([e[4] for e in entries]).tolist()
            at = 0
            for (flat, stats, _, sampled, _), (power, sq, kernel) in zip(entries, sums):
                n = sampled.numel()
                stats.pow, stats.sq = power, sq
                stats.kernel_error = kernel_error(kernel, power, self.norm_type) if self.band else 0.0
                stats.values, stats.words = values[at:at + n], words[at:at + n]
                at += n
                if sq == 0.0 and flat.numel():  # the row norms of tiny values underflow: ask the bits
                    low, high = torch.aminmax(flat)
                    stats.zero = bool(low == 0) and bool(high == 0)
                stats.zero = stats.zero or flat.numel() == 0
                if not stats.finite:
                    stats.nonfinite, stats.first_nonfinite = _nonfinite(flat)
        if self.band:
            self.flat_error = flat_error([e[0] for e in self._pending], [e[1].pow for e in self._pending],
                                         self.norm_type)
        self._pending = []


def row_norms(flat: torch.Tensor) -> torch.Tensor:
    """The 2-norm of each row of ``ROW`` consecutive elements of ``flat`` (the last row shorter), in
    fp32 for fp32, bf16 and fp16 gradients (float64 for fp64 ones), on ``flat``'s device."""
    wide = torch.float64 if flat.dtype == torch.float64 else torch.float32
    full = flat.numel() // ROW * ROW
    parts = []
    if full:
        body = flat[:full].view(-1, ROW)
        if body.dtype in (torch.float32, torch.float64):
            parts.append(torch.linalg.vector_norm(body, dim=1))
        else:  # converted in blocks: torch's own conversion inside the norm is a slow path on CPUs
            block = CPU_BLOCK // ROW if flat.device.type == "cpu" else body.shape[0]
            parts.extend(torch.linalg.vector_norm(b.to(wide), dim=1) for b in body.split(block))
    if full < flat.numel():
        parts.append(torch.linalg.vector_norm(flat[full:].to(wide)).reshape(1))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=wide, device=flat.device)


def _nonfinite(flat: torch.Tensor) -> tuple[tuple[int, int], tuple[int, str] | None]:
    """(NaNs, infinities) of a gradient, and its first non-finite element (a NaN before any inf)."""
    nan = torch.isnan(flat)
    inf = torch.isinf(flat)
    counts = (int(nan.sum()), int(inf.sum()))
    for mask in (nan, inf):
        where = torch.nonzero(mask)
        if where.numel():
            index = int(where[0, 0])
            value = float(flat[index])
            return counts, (index, "nan" if math.isnan(value) else "inf" if value > 0 else "-inf")
    return counts, None


def pass_over(grads: Mapping[str, torch.Tensor | None], norm_type: float,
              digest: frozenset[str] = frozenset()) -> dict[str, Stats]:
    """``GradientPass`` over every present gradient, digesting those named in ``digest``."""
    gradient_pass = GradientPass(norm_type)
    out = {name: gradient_pass.add(grad, digest=name in digest) for name, grad in grads.items() if grad is not None}
    gradient_pass.finish()
    return out
