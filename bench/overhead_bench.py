"""What the harness costs next to the clip functions it judges, launch by launch.

    python bench/overhead_bench.py                          # the default matrix at worlds 1, 2, 4, 8
    python bench/overhead_bench.py --worlds 2,4 --scenario dense_dp,xorl_ep_lora
    python bench/overhead_bench.py --worlds 8 --by-scenario     # where world 8's wall time goes
    python bench/overhead_bench.py --spawn-ranks                # ranks as fresh interpreters (torchrun's way)

For each world size it runs ``clipcheck run --nproc N`` over the selected cases (the default matrix
unless ``--scenario`` narrows it), as ``clipcheck matrix`` launches it (backend: the default, gloo on
this CPU machine), and reads back the JSON Lines. Per world:

* wall: the launch from start to exit, process start-up and imports included (what a user waits for);
* start: when the first case's record appeared (start-up: imports, planning, the first groups);
* target: the sum over cases of the clip function's own seconds (``seconds``: the slowest rank's time in the
  call; a framework's setup, ``dress``, is not in it: ``phase_profile.py`` shows it apart);
* ratio: wall / target. The goal of issue 12 is at most 2 at worlds 2, 4 and 8 (the harness costs no
  more than the function it judges), and the whole default matrix under 90 s on 2 cores;
* after start: (wall - start) / target, the cases' own ratio, without the launch's start-up (which a
  world-2 launch of the default matrix spends mostly importing the frameworks).

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

from harness.commands.matrix import default_matrix_path  # noqa: E402

RATIO_GOAL = 2.0
MATRIX_GOAL_S = 90.0
FOLLOW_S = 0.2  # how often the launch's JSON Lines are read while it runs


def launch(world: int, scenarios: str | None, out: Path, spawn: bool) -> tuple[float, float, list[dict]]:
    """One ``clipcheck run`` launch: its wall seconds, when its first case record was written, and its
    case records, each with ``_arrived`` (seconds from the start when this process read it: the file
    is followed while the launch runs, since rank 0 writes each record as its case ends)."""
    jsonl = out / f"world{world}.jsonl"
    jsonl.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "harness", "run", "--nproc", str(world), "--matrix", default_matrix_path(),
           "--json", str(jsonl), "--no-progress"]
    cmd += ["--scenario", scenarios] if scenarios else []
    cmd += ["--spawn-ranks"] if spawn else []
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    arrived: list[float] = []
    follow = _NewLines(jsonl)
    # the launch's output is kept beside its results: a crash is diagnosed from its first traceback,
    # not from the last lines (the launcher stopping the other ranks)
    with open(out / f"world{world}.log", "w+") as log:
        proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
        while proc.poll() is None:
            time.sleep(FOLLOW_S)
            arrived += [time.perf_counter() - start] * follow.count()
        wall = time.perf_counter() - start
        if proc.returncode not in (0, 1):  # 1: some case failed, which is what the matrix is for
            log.seek(0)
            lines = log.read().splitlines()
            first = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), max(len(lines) - 40, 0))
            sys.exit(f"overhead_bench: world {world} exited {proc.returncode} (output: {log.name}, gone without --keep); "
                     "from its first traceback:\n" + "\n".join(lines[first:first + 60]))
    # the launcher rewrites the file at the end, case records first, in the order they were written
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    cases = [r for r in records if r.get("type") == "case"]
    for case, seconds in zip(cases, arrived):
        case["_arrived"] = seconds
    first = min((c["_arrived"] for c in cases if "_arrived" in c), default=wall)
    return wall, first, cases


class _NewLines:
    """Lines appended to a file since the last look, reading only the new bytes: the benchmark shares
    the cores with the launch it measures, so it must not re-read a file of megabytes every 0.2 s.
    Stops counting once the file shrinks (the launcher's final rewrite): every case was seen by then."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.done = False

    def count(self) -> int:
        if self.done or not self.path.exists():
            return 0
        with open(self.path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() < self.offset:
                self.done = True
                return 0
            f.seek(self.offset)
            new = f.read()
        complete = new[: new.rfind(b"\n") + 1]  # a line being written is counted when it ends
        self.offset += len(complete)
        return complete.count(b"\n")


def by_scenario(cases: list[dict]) -> list[tuple[str, int, float, float]]:
    """(scenario, cases, wall seconds from the previous record to each of its records, its targets'
    seconds): where a launch's wall time went, scenario by scenario, most first."""
    spans: dict[str, list[float]] = {}
    previous = None
    for case in cases:
        if "_arrived" not in case:
            continue
        entry = spans.setdefault(case["scenario"], [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += 0.0 if previous is None else case["_arrived"] - previous
        entry[2] += float(case.get("seconds") or 0.0)
        previous = case["_arrived"]
    return sorted(((name, int(n), wall, target) for name, (n, wall, target) in spans.items()), key=lambda r: -r[2])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="1,2,4,8")
    p.add_argument("--scenario", default=None, help="scenario name(s), comma separated (default: the matrix's)")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="keep each world's JSON Lines and output in DIR (to compare verdicts between versions)")
    p.add_argument("--spawn-ranks", action="store_true",
                   help="ranks as fresh interpreters (as torchrun starts them), not forked from the launcher")
    p.add_argument("--by-scenario", action="store_true",
                   help="also print, per world, the wall time spent on each scenario's cases (most first)")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="clipcheck-overhead-") as tmp:
        out = Path(args.keep or tmp)
        out.mkdir(parents=True, exist_ok=True)
        for world in (int(w) for w in args.worlds.split(",")):
            wall, first, cases = launch(world, args.scenario, out, args.spawn_ranks)
            target = sum(float(c.get("seconds") or 0.0) for c in cases if c.get("verdict") != "SKIP")
            rows.append((world, len(cases), wall, first, target))
            if args.by_scenario:
                print(f"world {world}: {'scenario':<20} {'cases':>5} {'wall s':>7} {'target s':>8} {'ms/case':>8}")
                for name, n, span, spent in by_scenario(cases):
                    print(f"world {world}: {name:<20} {n:>5} {span:>7.1f} {spent:>8.1f} {1000 * span / n:>8.1f}")
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
