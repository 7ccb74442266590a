"""Cases per second in a warm world vs one process launch per case, and fuzz examples per second.

    python bench/matrix_bench.py                 # world 2 and 4, CPU/gloo
    python bench/matrix_bench.py --worlds 2 --cases 100 --launches 2

For each world size it measures:
* warm: the same real cases (dense_dp and xorl_ep_lora, every default target) run back to back on
  one RankPool, i.e. one process group for all of them, as a torchrun launch of a whole matrix does;
* launch per case: ``torchrun -m harness`` started for a single case, the cost a harness without a
  shared world would pay for every case;
* fuzz: hypothesis examples per second against the reference target.
The goal is at least 20x more cases per second warm than with a launch per case.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.fuzz import fuzz  # noqa: E402
from harness.cases.matrix import MatrixSpec  # noqa: E402
from harness.plan.planner import plan_cases  # noqa: E402
from harness.run.hosts.pool import RankPool  # noqa: E402
from harness.run.hosts.pool_cases import run_case_on_pool  # noqa: E402


def warm_cases_per_second(world: int, n_cases: int) -> tuple[float, int]:
    plan = plan_cases(MatrixSpec(scenarios=("dense_dp", "xorl_ep_lora")), world, "gloo")
    cases = (plan.cases * (n_cases // len(plan.cases) + 1))[:n_cases]
    with RankPool(world, timeout_s=30) as pool:
        run_case_on_pool(pool, cases[0], plan.scenarios[cases[0].scenario])  # start-up is not per case
        start = time.perf_counter()
        for case in cases:
            run_case_on_pool(pool, case, plan.scenarios[case.scenario])
        return n_cases / (time.perf_counter() - start), len(plan.cases)


def launch_per_case_seconds(world: int, launches: int) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           "-m", "harness", "--scenario", "dense_dp", "--variant", "replicated", "--target", "reference"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    for _ in range(launches):
        subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, check=True)
    return (time.perf_counter() - start) / launches


def fuzz_examples_per_second(world: int, examples: int) -> float:
    with RankPool(world, timeout_s=30) as pool:
        fuzz("reference", pool, 2, derandomize=True, shrink=False)  # start the world first
        report = fuzz("reference", pool, examples, derandomize=True, shrink=False)
        return report.examples / report.seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--cases", type=int, default=60, help="warm cases per world")
    p.add_argument("--launches", type=int, default=3, help="single-case torchrun launches per world")
    p.add_argument("--examples", type=int, default=60, help="fuzz examples per world")
    args = p.parse_args()
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        warm, distinct = warm_cases_per_second(world, args.cases)
        per_launch = launch_per_case_seconds(world, args.launches)
        examples = fuzz_examples_per_second(world, args.examples)
        rows.append((world, distinct, warm, 1 / per_launch, warm * per_launch, examples))
    print(f"{'world':>5} {'distinct':>8} {'warm cases/s':>13} {'launch cases/s':>15} {'speedup':>8} "
          f"{'fuzz examples/s':>16}")
    for world, distinct, warm, launch, speedup, examples in rows:
        print(f"{world:>5} {distinct:>8} {warm:>13.1f} {launch:>15.3f} {speedup:>7.0f}x {examples:>16.1f}")
    worst = min(r[4] for r in rows)
    print(f"goal: >= 20x more cases per second warm than with a launch per case -> "
          f"{'met' if worst >= 20 else 'NOT met'} (worst {worst:.0f}x)")
    return 0 if worst >= 20 else 1


if __name__ == "__main__":
    sys.exit(main())
