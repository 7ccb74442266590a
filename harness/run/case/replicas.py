"""Are the true replicas still identical after the call? Each rank's part of the answer (it travels
in the record the rank sends rank 0 anyway) and rank 0's merge of the parts.

Before the call the oracle measures replication (``measure``): that is the ground truth, measured
once per layout variant. After the call one question is left, and it is asked on every case: do the
holders of each gradient along each mesh axis still hold the same bits? It is answered the way the
backend's pre-call measurement is (``measure.uses_digests``), with the same criterion (element count,
element size, every byte) and the same ``Replication``:

* ``digests`` (gloo): each rank sends a digest of every post-call gradient in its record and rank 0
  compares the digests of each group's holders (``measure.from_digests``); no collective at all;
* ``collectives`` (nccl): the per-axis MAX round of ``measure_replication``, each rank's own view,
  merged by rank 0 (``merged``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from harness.judge.records import Replication, StatsTable
from harness.run.case.measure import (bits_digest, from_digests, measure_replication, merged,
                                 uses_digests)
from harness.run.world.dist_world import MeshGroups
from harness.cases.layout import MeshSpec

Grads = Mapping[str, "torch.Tensor | None"]


def rank_part(backend: str, names: Sequence[str], post: Grads, stats: StatsTable, groups: MeshGroups,
              device: torch.device) -> dict[str, Any]:
    """This rank's part, for its record. ``stats`` (the pre-call table) sizes the collective's buckets:
    a post-call gradient keeps its shape or was dropped as mangled. The digests touch no group (not
    even to build the mesh's harness twins)."""
    if uses_digests(backend):
        return {"digests": {n: None if (g := post.get(n)) is None else bits_digest(g) for n in names}}
    return {"distinct": measure_replication(names, post, stats, groups.spec, groups.harness_groups, None,
                                            device).distinct}


def merge_parts(names: Sequence[str], parts: Sequence[Mapping[str, Any]], mesh: MeshSpec,
                classes: bool = False) -> Replication:
    """Rank 0: the world's post-call replication from every rank's part (``classes``: a measured
    layout's, by class of bits)."""
    if parts and "digests" in parts[0]:  # every rank of a world runs one backend
        return from_digests(names, [p["digests"] for p in parts], mesh, classes)
    return merged([Replication(p["distinct"]) for p in parts])
