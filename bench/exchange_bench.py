"""What one round of agreement costs, through the rendezvous store and through a gloo group.

    python bench/exchange_bench.py                   # worlds 2, 4, 8
    python bench/exchange_bench.py --worlds 8 --rounds 500

Why it exists: every case agrees on its status and sends its record through the store, and until
the post-call replica check became digests in those records (``harness.run.case.replicas``) every case
also ran one gloo MAX all-reduce per mesh axis. Whether a round should go through the store or a
process group is decided by these figures, per world size, with ranks sharing the cores as the
matrix runs them. Per world, the slowest rank's mean over ``--rounds``:

* store all-gather: ``DistWorld.allgather_json`` of a status (what ``guard.agree`` does once per case);
* store gather: ``DistWorld.gather_json`` of a record-sized payload to rank 0;
* gloo all-reduce: a MAX all-reduce of 8 int32 on the harness's private world group (what one mesh
  axis of the replication round cost with small gradients);
* gloo barrier, on the same group.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness.run.hosts.pool import RankPool, current_world  # noqa: E402

STATUS = {"error": None, "fault": None, "broken": False}
RECORD = {"reported": 1.0, "error": None, "fault": None, "seconds": 0.01,
          "local": {"scale": {f"p{i}": [0.5, 1e-9] for i in range(16)},
                    "digests": {f"p{i}": "0" * 32 for i in range(16)}}}


def rounds_on_rank(rounds: int) -> dict[str, float]:
    """Runs on every rank: mean seconds per round of each kind."""
    world = current_world()
    group = world.harness_world
    words = torch.zeros(8, dtype=torch.int32)
    kinds: dict[str, Callable[[], object]] = {
        "store all-gather": lambda: world.allgather_json("bench", STATUS, 120),
        "store gather": lambda: world.gather_json("bench", RECORD, 120),
        "gloo all-reduce": lambda: dist.all_reduce(words, op=dist.ReduceOp.MAX, group=group),
        "gloo barrier": lambda: dist.barrier(group=group),
    }
    out = {}
    for label, fn in kinds.items():
        for _ in range(10):
            fn()
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(rounds):
            fn()
        dist.barrier(group=group)
        out[label] = (time.perf_counter() - start) / rounds
    world.allgather_json("bench", STATUS, 120)  # the gathers' keys are collected by the next all-gather
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--rounds", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(1)
    labels = ("store all-gather", "store gather", "gloo all-reduce", "gloo barrier")
    print(f"{'world':>5} " + " ".join(f"{label + ' ms':>19}" for label in labels))
    for world_size in (int(w) for w in args.worlds.split(",")):
        with RankPool(world_size, timeout_s=120) as pool:
            results = pool.run(rounds_on_rank, args.rounds, timeout_s=1200)
        bad = [r for r in results if not r.ok]
        if bad:
            print(f"world {world_size}: rank {bad[0].rank} {bad[0].status}: {bad[0].error}", file=sys.stderr)
            return 2
        slowest = {k: max(r.value[k] for r in results) for k in labels}
        print(f"{world_size:>5} " + " ".join(f"{1e3 * slowest[k]:>19.2f}" for k in labels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
