"""What the harness costs next to the clip functions it judges, launch by launch.

    python bench/overhead_bench.py                          # the default matrix at worlds 1, 2, 4, 8
    python bench/overhead_bench.py --worlds 2,4 --scenario dense_dp,xorl_ep_lora
    python bench/overhead_bench.py --worlds 4 --split           # where world 4's wall time goes, phase by phase
    python bench/overhead_bench.py --worlds 8 --by-scenario     # and scenario by scenario
    python bench/overhead_bench.py --spawn-ranks                # ranks as fresh interpreters (torchrun's way)

For each world size it runs ``clipcheck run --nproc N`` over the selected cases (the default matrix
unless ``--scenario`` narrows it), as ``clipcheck matrix`` launches it (backend: the default, gloo on
this CPU machine), and reads back the JSON Lines. Per world:

* wall: the launch from start to exit, process start-up and imports included (what a user waits for);
* start: when the first case's record appeared (start-up: imports, planning, the first groups);
* target: the sum over cases of the clip function's own seconds (``seconds``: the slowest rank's time in the
  call; a framework's setup, ``dress``, is not in it: ``phase_profile.py`` shows it apart);
* ratio: wall / target. The goal (issues 12 and 40) is at most 2 at worlds 2, 4 and 8 (the harness costs no
  more than the function it judges), and the whole default matrix under 90 s on 2 cores;
* after start: (wall - start) / target, the cases' own ratio, without the launch's start-up (which a
  world-2 launch of the default matrix spends mostly importing the frameworks).

With ``--split`` (or ``--by-scenario``) each launch runs with timers around the runner's phases
(``case_split.py``: a few microseconds per phase call) and prints where its wall time went: the start-up
(planning, the frameworks' imports, the rest) and, per phase of a case, rank 0's wall and CPU seconds and
every rank's CPU; ``--by-scenario`` adds rank 0's wall per scenario.

Run it on a quiet machine: every rank is a process, and at world 8 they share the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import case_split  # noqa: E402
from harness.commands.matrix import default_matrix_path  # noqa: E402

RATIO_GOAL = 2.0
MATRIX_GOAL_S = 90.0
FOLLOW_S = 0.2  # how often the launch's JSON Lines are looked at while it runs


def launch(world: int, scenarios: str | None, out: Path, spawn: bool, split: Path | None = None
           ) -> tuple[float, float, list[dict]]:
    """One ``clipcheck run`` launch: its wall seconds, when its first case record was written (the file is
    followed while the launch runs, since rank 0 writes each record as its case ends), and its case
    records. ``split``: the launch runs with ``case_split``'s timers, its ranks' figures written there."""
    jsonl = out / f"world{world}.jsonl"
    jsonl.unlink(missing_ok=True)
    run_args = ["--nproc", str(world), "--matrix", default_matrix_path(), "--json", str(jsonl), "--no-progress"]
    run_args += ["--scenario", scenarios] if scenarios else []
    run_args += ["--spawn-ranks"] if spawn else []
    cmd = case_split.launch_command(sys.executable, run_args) if split is not None else \
        [sys.executable, "-m", "harness", "run", *run_args]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=str(ROOT))
    if split is not None:
        split.mkdir(parents=True, exist_ok=True)
        env[case_split.SPLIT_DIR_ENV] = str(split)
    start = time.perf_counter()
    first: float | None = None
    # the launch's output is kept beside its results: a crash is diagnosed from its first traceback,
    # not from the last lines (the launcher stopping the other ranks)
    with open(out / f"world{world}.log", "w+") as log:
        proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
        while proc.poll() is None:
            time.sleep(FOLLOW_S)
            if first is None and _has_a_record(jsonl):
                first = time.perf_counter() - start
        wall = time.perf_counter() - start
        if proc.returncode not in (0, 1):  # 1: some case failed, which is what the matrix is for
            log.seek(0)
            lines = log.read().splitlines()
            at = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), max(len(lines) - 40, 0))
            sys.exit(f"overhead_bench: world {world} exited {proc.returncode} (output: {log.name}, gone without --keep); "
                     "from its first traceback:\n" + "\n".join(lines[at:at + 60]))
    # the launcher rewrites the file at the end, case records first, in the order they were written
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    return wall, wall if first is None else first, [r for r in records if r.get("type") == "case"]


def _has_a_record(path: Path) -> bool:
    """Whether rank 0 has written its first record line (a look at the file's first bytes only: the
    benchmark shares the cores with the launch it measures)."""
    try:
        with open(path, "rb") as f:
            return b"\n" in f.read(1 << 16)
    except OSError:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="1,2,4,8")
    p.add_argument("--scenario", default=None, help="scenario name(s), comma separated (default: the matrix's)")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="keep each world's JSON Lines and output in DIR (to compare verdicts between versions)")
    p.add_argument("--spawn-ranks", action="store_true",
                   help="ranks as fresh interpreters (as torchrun starts them), not forked from the launcher")
    p.add_argument("--split", action="store_true",
                   help="time the runner's phases (case_split.py) and print, per world, where the wall time went")
    p.add_argument("--by-scenario", action="store_true",
                   help="with the split, also print rank 0's wall time per scenario (most first)")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="clipcheck-overhead-") as tmp:
        out = Path(args.keep or tmp)
        out.mkdir(parents=True, exist_ok=True)
        for world in (int(w) for w in args.worlds.split(",")):
            split = out / f"split-world{world}" if args.split or args.by_scenario else None
            wall, first, cases = launch(world, args.scenario, out, args.spawn_ranks, split)
            target = sum(float(c.get("seconds") or 0.0) for c in cases if c.get("verdict") != "SKIP")
            rows.append((world, len(cases), wall, first, target))
            if split is not None:
                ranks = case_split.read_split(split)
                case_split.print_split(world, ranks, len(cases), target)
                if args.by_scenario:
                    case_split.print_by_scenario(world, ranks, cases)
    print(f"{'world':>5} {'cases':>6} {'wall s':>8} {'start s':>8} {'target s':>9} {'harness s':>10} {'ms/case':>8} "
          f"{'ratio':>6} {'after start':>11}")
    for world, n, wall, first, target in rows:
        ratio = wall / target if target else float("inf")
        per_case = (wall - first) / target if target else float("inf")
        print(f"{world:>5} {n:>6} {wall:>8.1f} {first:>8.1f} {target:>9.1f} {wall - target:>10.1f} "
              f"{1000 * (wall - target) / max(n, 1):>8.1f} {ratio:>5.1f}x {per_case:>10.1f}x")
    total = sum(r[2] for r in rows)
    judged = [r for r in rows if r[0] > 1]
    worst = max((r[2] / r[4] if r[4] else float("inf")) for r in judged) if judged else 0.0
    print(f"total wall {total:.1f} s over {sum(r[1] for r in rows)} cases")
    print(f"goal: wall <= {RATIO_GOAL:.0f}x target at worlds > 1 -> {'met' if worst <= RATIO_GOAL else 'NOT met'} "
          f"(worst {worst:.1f}x)")
    if args.scenario is None and args.worlds == "1,2,4,8":
        print(f"goal: default matrix < {MATRIX_GOAL_S:.0f} s -> {'met' if total < MATRIX_GOAL_S else 'NOT met'}")
    return 0 if worst <= RATIO_GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
