"""What the measured ground truth costs on large gradients, next to one pass over their bytes.

    python bench/oracle_bench.py                          # 100M fp32 elements, worlds 1 and 2
    python bench/oracle_bench.py --worlds 2,4 --dtype bf16 --elements 50000000

The oracle (``gather_stats`` + ``pre_call_replication``, what every case's pre-call truth runs) must
stay linear in gradient bytes. Each rank holds ``--elements`` elements in four parameters,
bit-identical on every rank of a one-axis mesh ``dp=world``: the worst case, where every word has to
be compared (a spread would not end it sooner, but nothing here lets it). Measured per world, the
slowest rank's median of ``--repeats``:

* read pass: one read of every gradient byte (a MAX over its int32 words, the fastest full read
  torch has on CPU, ahead of a sum over the words or a float64 upcast: docs/performance.md, "Figures
  cited by the code");
* all-reduce: one MAX all-reduce of those words over the mesh axis (the least any exact cross-rank
  comparison has to move; none at world 1);
* truth gloo / truth nccl: the oracle itself as the runner measures it on each backend (``measure``):
  stats with each gradient's digest in one store round, compared on every rank (gloo; no digests at
  world 1, where there is nothing to compare), or stats and a MAX all-reduce per axis with the world
  merge (nccl; run here on gloo groups);
* replicas: the post-call check every case runs, both ways ``harness.run.case.replicas`` answers it:
  ``digests`` (each rank's SHA-256 of every gradient, what gloo worlds use) and ``MAX round``
  (one MAX all-reduce per axis, what nccl worlds use); reported, not part of the goal.

The goal, on both backends' paths: truth <= 3x (read pass + all-reduce), i.e. at most three passes'
worth of work over the bytes, computing and communicating; at world 1 there is nothing to communicate
and the yardstick is the read pass alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness.run.case import replicas  # noqa: E402
from harness.run.case.measure import bit_words, digests_for_truth, gather_stats, pre_call_replication  # noqa: E402
from harness.run.hosts.pool import RankPool, current_world  # noqa: E402
from harness.cases.layout import MeshSpec  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
PARAMS = 4


def _timed(fn: object, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_on_rank(elements: int, dtype: str, repeats: int) -> dict[str, float]:
    """Runs on every rank: the three timings, in seconds."""
    world = current_world()
    mesh = MeshSpec.of(dp=world.world_size)
    groups = world.mesh(mesh)
    generator = torch.Generator().manual_seed(0)  # the same bits on every rank
    grads = {f"w{i}": torch.randn(elements // PARAMS, generator=generator).to(DTYPES[dtype]) for i in range(PARAMS)}
    names = list(grads)
    words = [bit_words(g) for g in grads.values()]

    def read_pass() -> None:
        for w in words:
            w.max()

    def all_reduce() -> None:
        if world.world_size > 1:
            for w in words:
                dist.all_reduce(w.clone(), op=dist.ReduceOp.MAX, group=groups.harness_groups["dp"])

    def truth_by(backend: str) -> Callable[[], None]:
        def truth() -> None:  # what the runner does before each variant's first call, on ``backend``
            stats = gather_stats(names, grads, 2.0, world.store_round("stats"),
                                 digests=digests_for_truth(backend, mesh))
            replication = pre_call_replication(names, grads, stats, mesh, lambda: groups.harness_groups,
                                               world.store_round("replication"), world.device)
            assert not any(replication.distinct["dp"].values())
        return truth

    stats = gather_stats(names, grads, 2.0, world.store_round("stats"))

    def replicas_by(backend: str) -> Callable[[], None]:
        return lambda: replicas.rank_part(backend, names, grads, stats, groups, world.device)

    out = {}
    for label, fn in (("read pass", read_pass), ("all-reduce", all_reduce), ("truth gloo", truth_by("gloo")),
                      ("truth nccl", truth_by("nccl")), ("digests", replicas_by("gloo")),
                      ("MAX round", replicas_by("nccl"))):
        dist.barrier(group=world.harness_world)
        out[label] = _timed(fn, repeats)
    # the all-reduce yardstick clones its input (MAX would overwrite the gradient): take the clone out
    out["all-reduce"] -= _timed(lambda: [w.clone() for w in words], repeats) if world.world_size > 1 else 0.0
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--elements", type=int, default=100_000_000, help="gradient elements per rank")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{args.elements:,} {args.dtype} elements per rank in {PARAMS} parameters, replicated on dp")
    print(f"{'world':>5} {'read pass s':>12} {'all-reduce s':>13} {'truth gloo s':>13} {'truth nccl s':>13} "
          f"{'truth / yardstick':>18} {'replicas: digests s':>20} {'MAX round s':>12}")
    worst = 0.0
    for world_size in (int(w) for w in args.worlds.split(",")):
        with RankPool(world_size, timeout_s=600) as pool:
            results = pool.run(measure_on_rank, args.elements, args.dtype, args.repeats, timeout_s=3600)
        bad = [r for r in results if not r.ok]
        if bad:
            print(f"world {world_size}: rank {bad[0].rank} {bad[0].status}: {bad[0].error}", file=sys.stderr)
            return 2
        slowest = {k: max(r.value[k] for r in results) for k in results[0].value}
        yardstick = slowest["read pass"] + max(slowest["all-reduce"], 0.0)
        ratios = [slowest[f"truth {backend}"] / yardstick for backend in ("gloo", "nccl")]
        worst = max(worst, *ratios)
        print(f"{world_size:>5} {slowest['read pass']:>12.3f} {slowest['all-reduce']:>13.3f} "
              f"{slowest['truth gloo']:>13.3f} {slowest['truth nccl']:>13.3f} "
              f"{' / '.join(f'{r:.2f}x' for r in ratios):>18} {slowest['digests']:>20.3f} {slowest['MAX round']:>12.3f}")
    print(f"goal: truth <= 3x one pass over the bytes -> {'met' if worst <= 3 else 'NOT met'} (worst {worst:.2f}x)")
    return 0 if worst <= 3 else 1


if __name__ == "__main__":
    sys.exit(main())
