"""Fuzz examples per second against ``reference``, and where an example's time goes.

    python bench/fuzz_bench.py                        # worlds 2 and 4: 300 and 200 examples
    python bench/fuzz_bench.py --worlds 2 --examples 500 --repeats 3

Per world: one warm world (``RankPool``), a short warm-up (the world's first cases import and
build what every later one reuses), then ``--repeats`` derandomized runs of ``harness.fuzz.fuzz``
without shrinking (the goal is about searching). Each run's wall time is split in two:

* world: inside ``RankPool.run``: sending the case, every rank building, injecting, measuring the
  truth, calling the target and exchanging records, rank 0 judging, the results coming back;
* this process: everything else, mostly hypothesis drawing the case (``harness.strategies``,
  including the constructive truth the bound is a ratio of, which then travels with the case).

The goal of issue 12: at least 100 examples/s at world 2 and 50 at world 4, on 2 CPU cores (gloo).
Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import harness.fuzz  # noqa: E402
from harness.run.hosts.pool import RankPool  # noqa: E402

fuzzing = sys.modules["harness.fuzz"]  # the module: ``harness.fuzz`` (and ``import harness.fuzz as x``) is the function

GOALS = {2: 100.0, 4: 50.0}
WARM_UP_EXAMPLES = 20


class _TimedWorld:
    """``run_case_on_pool`` with the seconds spent in it added up (what the world costs)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._run = fuzzing.run_case_on_pool

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._run(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def measure(world: int, examples: int, repeats: int) -> list[tuple[float, float, float]]:
    """(examples/s, ms per example in the world, ms per example in this process) per run."""
    timed = _TimedWorld()
    fuzzing.run_case_on_pool = timed  # type: ignore[assignment]
    try:
        with RankPool(world, timeout_s=30) as pool:
            fuzzing.fuzz("reference", pool, WARM_UP_EXAMPLES, derandomize=True, shrink=False, blame=False)
            runs = []
            for _ in range(repeats):
                timed.seconds = 0.0
                start = time.perf_counter()
                report = fuzzing.fuzz("reference", pool, examples, derandomize=True, shrink=False, blame=False)
                wall = time.perf_counter() - start
                if not report.passed:
                    sys.exit(f"fuzz_bench: reference failed at world {world}: {report.crash or report.failed_at}")
                n = report.examples
                runs.append((n / wall, 1000 * timed.seconds / n, 1000 * (wall - timed.seconds) / n))
            return runs
    finally:
        fuzzing.run_case_on_pool = timed._run  # type: ignore[assignment]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--examples", default="300,200", help="examples per run, per world (one number: every world)")
    p.add_argument("--repeats", type=int, default=3, help="runs per world (the median is judged)")
    args = p.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    counts = [int(n) for n in args.examples.split(",")]
    counts = counts if len(counts) == len(worlds) else counts[:1] * len(worlds)
    print(f"{'world':>5} {'examples':>8} {'examples/s (runs)':>26} {'median':>7} {'world ms':>9} {'here ms':>8} "
          f"{'goal':>5}")
    met = True
    for world, examples in zip(worlds, counts):
        runs = measure(world, examples, args.repeats)
        rates = [r[0] for r in runs]
        median = statistics.median(rates)
        goal = GOALS.get(world)
        met = met and (goal is None or median >= goal)
        print(f"{world:>5} {examples:>8} {' / '.join(f'{r:.1f}' for r in rates):>26} {median:>7.1f} "
              f"{statistics.median(r[1] for r in runs):>9.2f} {statistics.median(r[2] for r in runs):>8.2f} "
              f"{'-' if goal is None else f'{goal:.0f}':>5}")
    print(f"goal: fuzz >= 100 examples/s at world 2 and >= 50 at world 4 -> {'met' if met else 'NOT met'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
