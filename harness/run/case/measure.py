"""The measured ground truth, per rank: what the raw bits say is replicated where.

Nothing declared is trusted: only the bits. A gradient is replicated along a mesh axis when, in
every group of that axis, every rank holding it holds the same element count, element size and
bytes. Two ways of asking, with that one criterion:

* ``digests`` (gloo): each rank's SHA-256 of every gradient's bytes (128 bits kept) travels in the
  statistics round every case makes anyway, and every rank compares the digests of each group's
  holders itself: no collective and no merge round. On CPU worlds a small gloo all-reduce costs as
  much as several store rounds (``bench/exchange_bench.py``), and hashing reads the bytes faster
  than gloo moves them (``bench/oracle_bench.py``; the figures: docs/performance.md, "Where it
  stands", item 3, and "Figures cited by the code").
  Different digests prove different bits; equal digests of different bits would take a collision.
* ``collectives`` (nccl): per mesh axis, a MAX all-reduce of the gradients' raw words (viewed as
  int32) over that axis's groups, and each holder's comparison of its own words with that maximum:
  no holder differing from the maximum (MAX = MIN) means replicated. The bytes stay on the device,
  where hashing would first copy every gradient to the host. All parameters share one bucket per
  axis, so a case costs one collective per mesh axis plus a store round merging the verdicts.
  Integer views matter: float MAX merges +0/-0 and drops NaN depending on rank order.

Either way the cost is linear in gradient bytes (``bench/oracle_bench.py`` measures both at 100M
elements). The norm these measurements imply, and its cross-check with the constructive truth, are
pure functions on the results: ``harness.judge.truth``.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from harness.clipmath import combine, flat_error, kernel_error, kernel_norm, pow_sum, root
from harness.judge.records import Replication, StatsTable
from harness.cases.layout import MeshSpec

_ABSENT = torch.iinfo(torch.int32).min  # the identity of MAX: what a rank without the gradient sends
_HEADER = 2  # numel, itemsize: a shape mismatch shows up as a spread too


def bit_words(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` as int32 words, the last one zero-padded: two tensors of one shape and
    dtype are bit-identical exactly when their words are. A view, no copy, for a contiguous tensor
    whose bytes fill whole aligned words (every 4- and 8-byte type; 2-byte types of even length),
    so the oracle reads each gradient's bytes where they lie. Words, not elements, because gloo
    reduces no 16-bit integers and a per-element widening would double a bf16 gradient's traffic."""
    flat = t.detach().contiguous().view(-1)
    raw = flat.view(torch.uint8)
    if raw.numel() % 4 == 0:
        try:
            return raw.view(torch.int32)
        except RuntimeError:  # a storage offset that is not word-aligned: copy below
            pass
    padded = torch.zeros(_word_count(flat.numel(), flat.element_size()) * 4, dtype=torch.uint8, device=raw.device)
    padded[: raw.numel()] = raw
    return padded.view(torch.int32)


def _word_count(numel: int, itemsize: int) -> int:
    return -(-numel * itemsize // 4)


AllGather = Callable[[Any], list[Any]]
"""Every rank's JSON-able payload, in rank order: a round through the rendezvous store
(``DistWorld.allgather_json``). For a few numbers per parameter it costs a fraction of a gloo
all-reduce on CPU worlds (``bench/exchange_bench.py``; docs/performance.md, "Where it stands", item 3);
JSON carries every float exactly (repr round-trips; NaN and infinities included)."""


def gather_stats(
    names: Sequence[str],
    grads: Mapping[str, torch.Tensor | None],
    norm_type: float,
    allgather: AllGather,
    digests: bool = False,
) -> StatsTable:
    """Each rank's [numel, itemsize, pow_sum, digest, kernel error] per parameter (numel -1 where it has no
    gradient) and its flat-buffer error, all-gathered: the table every rank then holds alike. ``digests``:
    each gradient's ``bits_digest`` rides along, for ``from_digests`` (the replication without a
    collective). The kernel errors (``clipmath.kernel_error``, ``clipmath.flat_error``) are what the case's
    band is measured from (``harness.judge.band``)."""
    row: list[list[Any]] = [[-1, 0, 0.0, None, 0.0] if g is None else _row(g, norm_type, digests)
           for g in (grads.get(name) for name in names)]
    held = [(g, float(entry[2])) for g, entry in zip((grads.get(name) for name in names), row) if g is not None]
    flat = flat_error([g for g, _ in held], [power for _, power in held], norm_type)
    gathered = allgather([row, flat])
    rows = [r[0] for r in gathered]
    return StatsTable(
        names=list(names),
        numel=[[int(entry[0]) for entry in r] for r in rows],
        itemsize=[[int(entry[1]) for entry in r] for r in rows],
        pow_sum=[[float(entry[2]) for entry in r] for r in rows],
        digests=[{name: entry[3] for name, entry in zip(names, r)} for r in rows] if digests else None,
        kernel_error=[[float(entry[4]) for entry in r] for r in rows],
        flat_error=[float(r[1]) for r in gathered],
    )


def _row(grad: torch.Tensor, norm_type: float, digest: bool) -> list[Any]:
    exact = pow_sum(grad, norm_type)
    return [grad.numel(), grad.element_size(), exact, bits_digest(grad) if digest else None,
            kernel_error(float(kernel_norm(grad, norm_type)), exact, norm_type)]


def uses_digests(backend: str) -> bool:
    """Whether this backend's ranks compare digests (CPU worlds) or run MAX collectives (GPUs)."""
    return backend == "gloo"


def digests_for_truth(backend: str, mesh: MeshSpec) -> bool:
    """Whether the pre-call stats round carries digests: on gloo, where some mesh axis has two ranks
    or more (a one-rank world has nothing to compare, so nothing is hashed)."""
    return uses_digests(backend) and mesh.world_size > 1


def pre_call_replication(names: Sequence[str], grads: Mapping[str, torch.Tensor | None], stats: StatsTable,
                         mesh: MeshSpec, axis_groups: Callable[[], Mapping[str, dist.ProcessGroup]],
                         merge: AllGather, device: torch.device, classes: bool = False) -> Replication:
    """The measured replication from the pre-call table: from its digests where it carries them
    (``digests_for_truth``; with ``classes``, a measured layout's classes of bits too), else the MAX
    round on the private groups (built only then)."""
    if stats.digests is not None:
        return from_digests(names, stats.digests, mesh, classes)
    return measure_replication(names, grads, stats, mesh, axis_groups(), merge, device)


_DIGEST_HEX = 32  # 128 bits of SHA-256


def bits_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's element count, element size and raw bytes (hex, 128 bits): equal for two
    gradients exactly when ``measure_replication`` would call them identical (up to a collision)."""
    flat = t.detach().cpu().contiguous().view(-1)
    h = hashlib.sha256(struct.pack("<qq", flat.numel(), flat.element_size()))
    if flat.numel():
        h.update(_bytes_view(flat))
    return h.hexdigest()[:_DIGEST_HEX]


def _bytes_view(flat: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, read where they lie (no copy). Through ctypes, because
    numpy is not a dependency of clipcheck (a plain ``pip install`` with torch alone has none), and
    torch hands out no buffer of its own; ``flat`` outlives the view in the caller."""
    nbytes = flat.numel() * flat.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(flat.data_ptr())).cast("B")


def from_digests(names: Sequence[str], digests: Sequence[Mapping[str, str | None]], mesh: MeshSpec,
                 classes: bool = False) -> Replication:
    """A gradient is distinct along an axis when the holders of some group of it hold different digests
    (ranks without it say nothing, as in ``measure_replication``). ``classes`` (a measured layout): the
    digests themselves too, as the classes of bits (``Replication.classes``)."""
    distinct = {}
    for axis in mesh.names:
        groups = mesh.groups(axis)
        distinct[axis] = {name: any(len({digests[r][name] for r in group} - {None}) > 1 for group in groups)
                          for name in names}
    if not classes:
        return Replication(distinct)
    return Replication(distinct, {name: [d.get(name) for d in digests] for name in names})


_LINEAR_ROW = 512
"""Words per row of ``linear_digest``'s matrix."""
_LINEAR_COLUMNS = 6
"""Independent random combinations per row: two rows that differ collide in one with probability at
most 2**-12 (the coefficients are uniform on 12 bits), in all six at most 2**-72."""
_LINEAR_SMALL = 4096
"""Bytes below which the rest is hashed on the host (SHA-256)."""
_LINEAR_CHUNK = {"cpu": 1 << 10, "cuda": 1 << 15}
"""Rows converted at once: a few MiB of scratch on a CPU, large enough to keep a GPU busy."""
_COEFFICIENTS: dict[torch.device, torch.Tensor] = {}


def _coefficients(device: torch.device) -> torch.Tensor:
    """The fixed coefficient matrix, transposed (``_LINEAR_COLUMNS`` x ``_LINEAR_ROW``: the same numbers on
    every rank and device, from a seeded CPU generator)."""
    if device not in _COEFFICIENTS:
        generator = torch.Generator().manual_seed(0x5EED)
        _COEFFICIENTS[device] = torch.randint(0, 1 << 12, (_LINEAR_ROW, _LINEAR_COLUMNS), generator=generator,
                                              dtype=torch.int64).to(torch.float64).t().contiguous().to(device)
    return _COEFFICIENTS[device]


def _units(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor as integers of the widest width its dtype allows (int32 for
    4- and 8-byte dtypes, int16 for 2-byte ones, uint8 for 1-byte ones): a function of the dtype and the
    bytes only, never of where they lie, so copies of one gradient give the same integers."""
    raw = t.reshape(-1).view(torch.uint8)
    width = torch.int32 if t.element_size() >= 4 else torch.int16 if t.element_size() == 2 else torch.uint8
    return raw.view(width)


def _linear_reduce(units: torch.Tensor) -> torch.Tensor:
    """One level of ``linear_digest``: rows of ``_LINEAR_ROW`` integers (the last one zero-padded) times
    the coefficient matrix, in float64. Every product is below 2**43 and every row sum below 2**52, so
    the arithmetic is exact and the result the same on any device and in any summation order. Returns
    the row results as int32 words (their exact bits), the next level's input. The product is taken
    transposed (the coefficients times the rows' columns: a skinny matrix on the left runs faster on a
    CPU), into a scratch buffer converted block by block; exactness makes the numbers the same."""
    device = units.device
    coefficients = _coefficients(device)
    rows = -(-units.numel() // _LINEAR_ROW)
    out = torch.empty(_LINEAR_COLUMNS, rows, dtype=torch.float64, device=device)
    chunk = _LINEAR_CHUNK.get(device.type, _LINEAR_CHUNK["cuda"]) * _LINEAR_ROW
    full = units.numel() // _LINEAR_ROW * _LINEAR_ROW
    scratch = torch.empty(min(chunk, full), dtype=torch.float64, device=device)
    for start in range(0, full, chunk):
        part = scratch[:min(chunk, full - start)]
        part.copy_(units[start:start + part.numel()])
        at = start // _LINEAR_ROW
        torch.mm(coefficients, part.view(-1, _LINEAR_ROW).t(), out=out[:, at:at + part.numel() // _LINEAR_ROW])
    if full < units.numel():
        tail = torch.zeros(_LINEAR_ROW, dtype=torch.float64, device=device)
        tail[: units.numel() - full] = units[full:].to(torch.float64)
        out[:, -1] = coefficients @ tail
    return out.t().contiguous().to(torch.int64).view(torch.int32).reshape(-1)


def linear_digest(t: torch.Tensor) -> str:
    """A digest of a tensor's dtype, shape and raw bytes, computed where the tensor lies: exact integer
    linear combinations of its words in float64 (``_linear_reduce``, a matrix product, repeated until a
    few kilobytes are left; each level shrinks the data ~40-fold), then SHA-256 of what is left on the
    host. On a GPU only that remainder (under 1/40 of the gradient's bytes, usually a few KB) ever
    leaves the device. Equal for bit-identical tensors on any device; two tensors that differ are told
    apart unless a difference cancels in all six combinations of a row (about 2**-72 per row), for
    data not built against the fixed coefficients."""
    flat = t.detach().contiguous()
    h = hashlib.sha256(f"{flat.dtype}|{tuple(flat.shape)}|".encode())
    units = _units(flat)
    while units.numel() * units.element_size() > _LINEAR_SMALL:
        units = _linear_reduce(units)
    rest = units.cpu().contiguous()
    if rest.numel():
        h.update(_bytes_view(rest.view(torch.uint8)))
    return h.hexdigest()[:_DIGEST_HEX]


def measure_replication(
    names: Sequence[str],
    grads: Mapping[str, torch.Tensor | None],
    stats: StatsTable,
    mesh: MeshSpec,
    axis_groups: Mapping[str, dist.ProcessGroup],
    merge: AllGather | None,
    device: torch.device,
) -> Replication:
    """Per mesh axis, one MAX all-reduce of every parameter's raw words (one bucket, a header of
    numel and itemsize in front of each); a rank holding a gradient then compares its own words
    with the group's maximum. Every holder equals the maximum exactly when all holders are equal,
    so one collective of the gradient's own bytes decides replication (a MIN round would double the
    traffic and say nothing more). Ranks without the gradient send the identity of MAX and judge
    nothing. Then every rank's verdicts are gathered (``merge``, a store round: a few flags) and
    OR-ed, a spread any group saw (``merge`` None: this rank's own view, for ``merged``). Cost: one
    pass to fill the bucket, the all-reduce, one compare pass per axis; no per-element index tensors."""
    axes = [axis for axis in mesh.names if mesh.size(axis) > 1]
    flags = torch.zeros(len(mesh.names), len(names), dtype=torch.int32)
    if names and axes:
        lengths = [_HEADER + max((_word_count(stats.numel[r][j], stats.itemsize[r][j])
                                  for r in range(stats.world_size) if stats.present(r, j)), default=0)
                   for j in range(len(names))]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        held: dict[int, tuple[list[int], torch.Tensor]] = {}
        bucket = torch.empty(offsets[-1], dtype=torch.int32, device=device)
        for j, name in enumerate(names):
            start, end = offsets[j], offsets[j + 1]
            g = grads.get(name)
            if g is None:
                bucket[start:end] = _ABSENT
                continue
            words = bit_words(g).to(device)
            header = [g.numel(), g.element_size()]
            bucket[start:start + _HEADER] = torch.tensor(header, dtype=torch.int32)
            bucket[start + _HEADER:start + _HEADER + words.numel()] = words
            bucket[start + _HEADER + words.numel():end] = _ABSENT
            held[j] = (header, words)
        headers = torch.tensor(offsets[:-1], device=device)
        for i, axis in enumerate(axes):
            top = bucket if i == len(axes) - 1 else bucket.clone()  # the last axis may use it up
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=axis_groups[axis])
            top_headers = torch.stack([top[headers], top[headers + 1]], dim=1).tolist()
            row = mesh.names.index(axis)
            for j, (header, words) in held.items():
                start = offsets[j] + _HEADER
                flags[row, j] = int(top_headers[j] != header
                                    or not torch.equal(top[start:start + words.numel()], words))
    if merge is not None and names:
        flags = torch.tensor(merge(flags.tolist()), dtype=torch.int32).amax(dim=0)
    return Replication(
        {axis: {name: bool(flags[a, j]) for j, name in enumerate(names)} for a, axis in enumerate(mesh.names)}
    )


def merged(views: Sequence[Replication]) -> Replication:
    """The world's replication from each rank's own view (a spread any group saw): what the world
    MAX of ``measure_replication`` gives, merged where the views arrive anyway (rank 0's records)."""
    axes = views[0].distinct if views else {}
    return Replication({axis: {name: any(v.distinct[axis][name] for v in views) for name in names}
                        for axis, names in axes.items()})
