"""Are the true replicas still identical after the call? Each rank's part of the answer (it travels
in the record the rank sends rank 0 anyway) and rank 0's merge of the parts.

Before the call the oracle measures replication with collectives over the raw words (``measure``):
that is the ground truth, measured once per layout variant. After the call one question is left, and
it is asked on every case: do the holders of each gradient along each mesh axis still hold the same
bits? Both ways of answering it use the criterion of ``measure_replication`` (element count, element
size, every byte) and give the same ``Replication``:

* ``digests`` (gloo): each rank sends a SHA-256 digest (128 bits kept) of every post-call gradient and
  rank 0 compares the digests of each group's holders; no collective at all. On CPU worlds the
  per-axis MAX round was the largest per-case cost of the harness: a small gloo all-reduce takes
  ~10 ms at world 8 on 2 cores, a store round under 1 ms (``bench/exchange_bench.py``), one per mesh
  axis per case, while hashing reads ~1.8 GB/s, faster than gloo moves the same bytes even at world 2
  (``bench/oracle_bench.py``). Different digests prove
  different bits; equal digests of different bits would take a SHA-256 collision.
* ``collectives`` (nccl): the per-axis MAX round of ``measure_replication``, each rank's own view,
  merged by rank 0 (``merged``): the bytes stay on the device, where hashing would first copy every
  gradient to the host.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from typing import Any, Mapping, Sequence

import torch

from harness.run.measure import Replication, StatsTable, measure_replication, merged
from harness.run.world import MeshGroups
from harness.spec.layout import MeshSpec

Grads = Mapping[str, "torch.Tensor | None"]

_DIGEST_HEX = 32  # 128 bits of SHA-256


def uses_digests(backend: str) -> bool:
    """Whether this backend's ranks answer with digests (CPU worlds) or with a collective (GPUs)."""
    return backend == "gloo"


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


def rank_part(backend: str, names: Sequence[str], post: Grads, stats: StatsTable, groups: MeshGroups,
              device: torch.device) -> dict[str, Any]:
    """This rank's part, for its record. ``stats`` (the pre-call table) sizes the collective's buckets:
    a post-call gradient keeps its shape or was dropped as mangled. The digests touch no group (not
    even to build the mesh's harness twins)."""
    if uses_digests(backend):
        return {"digests": {n: None if (g := post.get(n)) is None else bits_digest(g) for n in names}}
    return {"distinct": measure_replication(names, post, stats, groups.spec, groups.harness_groups, None,
                                            device).distinct}


def from_digests(names: Sequence[str], digests: Sequence[Mapping[str, str | None]], mesh: MeshSpec) -> Replication:
    """A gradient is distinct along an axis when the holders of some group of it hold different digests
    (ranks without it say nothing, as in ``measure_replication``)."""
    distinct = {
        axis: {name: any(len({digests[r][name] for r in group if digests[r][name] is not None}) > 1
                         for group in mesh.groups(axis))
               for name in names}
        for axis in mesh.names
    }
    return Replication(distinct)


def merge_parts(names: Sequence[str], parts: Sequence[Mapping[str, Any]], mesh: MeshSpec) -> Replication:
    """Rank 0: the world's post-call replication from every rank's part."""
    if parts and "digests" in parts[0]:  # every rank of a world runs one backend
        return from_digests(names, [p["digests"] for p in parts], mesh)
    return merged([Replication(p["distinct"]) for p in parts])
