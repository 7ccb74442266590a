"""The oracle's replication measurement, both ways it is made (digests in the stats round on gloo,
a MAX all-reduce of raw words per axis on nccl), against a brute-force comparison of every holder's
bytes, and the post-call replica check both ways it is answered.

``measure_replication`` decides replication with one MAX all-reduce of raw words per axis and
``from_digests`` by comparing the holders' digests; this test
gathers every rank's bytes instead and compares them pairwise, on gradients built to hit each corner
the word packing and the MAX-only comparison have to get right: 2-byte types of odd length (a padded
last word), 8-byte and 1-byte types, +0/-0 and NaN payloads (equal as floats, not as bits), a word
equal to the absent sentinel, a gradient absent on some ranks, and shapes that differ by one element.
"""

from __future__ import annotations

import math
import subprocess
import sys

import torch
import torch.distributed as dist

from harness.run.case import replicas
from harness.judge.records import Replication
from harness.run.case.measure import bits_digest, from_digests, gather_stats, measure_replication, merged
from harness.run.hosts.pool import current_world
from harness.cases.layout import MeshSpec

MESH = MeshSpec.of(a=2, b=2)


def _grads(rank: int) -> dict[str, torch.Tensor | None]:
    """Rank ``rank``'s gradients; which axis each one varies along is in its name."""
    a, b = MESH.coordinate(rank)
    neg_zero = torch.tensor([0.0, -0.0 if a else 0.0, 1.0])
    nan_payload = torch.tensor([1.0, math.nan, 2.0]).view(torch.int32)
    nan_payload[1] = nan_payload[1] | b  # another NaN on b = 1: the same float, other bits
    return {
        "same_everywhere": torch.arange(6, dtype=torch.float32),
        "bf16_odd_by_a": torch.arange(7, dtype=torch.bfloat16) + a,
        "fp64_by_b": torch.arange(3, dtype=torch.float64) * (1 + b),
        "int8_by_b": torch.tensor([1, 2, 3], dtype=torch.int8) + b,
        "signed_zero_by_a": neg_zero,
        "nan_payload_by_b": nan_payload.view(torch.float32),
        "sentinel_word_same": torch.tensor([-0.0, -0.0]),  # bits 0x80000000: the absent marker's
        "absent_where_b1": torch.full((4,), 3.0) if b == 0 else None,
        "numel_by_a": torch.zeros(5 + a),
        "bf16_last_half_word_by_b": torch.tensor([1.0, 2.0, 3.0 + b], dtype=torch.bfloat16),
        "absent_but_rank0": torch.ones(2) if rank == 0 else None,
    }


def _brute_force(names: list[str], grads: dict[str, torch.Tensor | None]) -> dict[str, dict[str, bool]]:
    views = [None] * dist.get_world_size()
    mine = {n: None if g is None else (tuple(g.shape), str(g.dtype), bytes(g.contiguous().view(torch.uint8).tolist()))
            for n, g in grads.items()}
    dist.all_gather_object(views, mine)
    out: dict[str, dict[str, bool]] = {}
    for axis in MESH.names:
        out[axis] = {}
        for name in names:
            out[axis][name] = any(len({views[r][name] for r in group if views[r][name] is not None}) > 1
                                  for group in MESH.groups(axis))
    return out


def _measure_on_rank() -> tuple[dict[str, dict[str, bool]], ...]:
    world = current_world()
    grads = _grads(world.rank)
    names = list(grads)
    groups = world.mesh(MESH)
    stats = gather_stats(names, grads, 2.0, world.store_round("stats"))
    world_view = measure_replication(names, grads, stats, MESH, groups.harness_groups, world.store_round("merge"),
                                     world.device)
    own_view = measure_replication(names, grads, stats, MESH, groups.harness_groups, None, world.device)
    parts = {backend: replicas.rank_part(backend, names, grads, stats, groups, world.device)
             for backend in ("gloo", "nccl")}
    with_digests = gather_stats(names, grads, 2.0, world.store_round("digests"), digests=True)
    assert with_digests.digests is not None and stats.digests is None
    by_digests = from_digests(names, with_digests.digests, MESH)
    return world_view.distinct, own_view.distinct, _brute_force(names, grads), parts, by_digests.distinct


def test_replication_matches_a_byte_by_byte_comparison(world4):
    results = world4.run(_measure_on_rank)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    expected = results[0].value[2]
    assert expected["a"]["bf16_odd_by_a"] and not expected["b"]["bf16_odd_by_a"]  # the corners are really hit
    assert expected["b"]["nan_payload_by_b"] and expected["a"]["signed_zero_by_a"]
    assert not expected["a"]["absent_where_b1"] and not expected["b"]["absent_where_b1"]
    for r in results:
        world_view, _, brute, _, by_digests = r.value
        assert world_view == brute, f"rank {r.rank}"
        assert by_digests == brute, f"rank {r.rank}"  # every rank decides alone, from the one table
    assert merged([Replication(r.value[1]) for r in results]).distinct == expected


def test_post_call_replicas_both_ways_match_a_byte_by_byte_comparison(world4):
    results = world4.run(_measure_on_rank)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    expected = results[0].value[2]
    names = list(expected["a"])
    digests = [r.value[3]["gloo"] for r in results]
    rounds = [r.value[3]["nccl"] for r in results]
    assert all("digests" in p for p in digests) and all("distinct" in p for p in rounds)  # both paths really ran
    assert replicas.merge_parts(names, digests, MESH).distinct == expected
    assert replicas.merge_parts(names, rounds, MESH).distinct == expected


def test_a_digest_sees_every_bit_and_the_length():
    base = torch.tensor([1.0, math.nan, -0.0], dtype=torch.float32)
    same = base.clone()
    other_nan = base.view(torch.int32).clone()
    other_nan[1] |= 1
    assert bits_digest(base) == bits_digest(same)
    # the criterion of the MAX round: element count, element size, bytes (an int32 view of the same
    # words is the same gradient to it; a sanitized post-call gradient keeps its dtype anyway)
    assert bits_digest(base.view(torch.int32)) == bits_digest(base)
    variants = [base, other_nan.view(torch.float32), torch.tensor([1.0, math.nan, 0.0]), torch.tensor([1.0, math.nan]),
                base.to(torch.float64), torch.zeros(0), torch.zeros(0, dtype=torch.float64)]
    assert len({bits_digest(v) for v in variants}) == len(variants)
    strided = torch.arange(12.0).view(3, 4).t()
    assert bits_digest(strided) == bits_digest(strided.contiguous())


def test_a_digest_needs_no_numpy():
    """numpy is not a dependency: a plain install with torch alone has none (found by the installed-product
    check of CI, where the first digest raised 'Numpy is not available')."""
    code = ("import sys; sys.modules['numpy'] = None\n"
            "import torch\n"
            "from harness.run.case.measure import bits_digest\n"
            "print(bits_digest(torch.arange(7, dtype=torch.bfloat16)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == bits_digest(torch.arange(7, dtype=torch.bfloat16))
