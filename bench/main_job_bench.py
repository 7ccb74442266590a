"""The main job as the README runs it (``clipcheck matrix``: the default matrix at worlds 1, 2, 4, 8),
timed world by world, with the most threads any rank held.

    python bench/main_job_bench.py                    # the default matrix, every world
    python bench/main_job_bench.py --nproc-list 8     # one world
    python bench/main_job_bench.py -- --scenario veomni_ep   # anything after -- goes to clipcheck matrix

Why threads: every live gloo process group keeps three threads (two workers and a transport loop that
wakes every few milliseconds), so a rank's thread count is the census of the groups it still holds.
Dropped groups that stay alive pile up threads until a long run stalls (what that looked like:
docs/performance.md, "Process groups: freed, not only forgotten"); the ceiling is 64 per rank at every
point of the default matrix.

How: the matrix runs in a child process; every ``SAMPLE_S`` this process lists the ranks under it from
/proc and counts each one's threads (``/proc/PID/task``), attributing the sample to the world of as many
ranks (launches run one at a time). Per world it prints the matrix's own figures (cases, seconds: from
its "launch:" lines) and the most threads a rank held, with their names at that moment; then the whole
command's wall time.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tests' helpers import each other as top-level modules

from harness.run.guards.family import descendants, process_parents  # noqa: E402
from harness_runs import threads_of  # noqa: E402

SAMPLE_S = 0.2
THREAD_CEILING = 64
MATRIX_GOAL_S = 90.0
DEFAULT_WORLDS = "1,2,4,8"
LAUNCH_START = re.compile(r"launch: world (\d+) (\w+): (\d+) cases")
LAUNCH_END = re.compile(r"(\d+)/(\d+) judged, (.+) in ([\d.]+) s")


@dataclass
class World:
    size: int
    cases: int = 0
    seconds: float = 0.0
    verdict: str = ""
    most_threads: int = 0
    names: dict[str, int] = field(default_factory=dict)


def _ranks(root: int) -> list[int]:
    """The rank processes under ``root`` (the matrix process): its grandchildren and deeper that have no
    children themselves (a launch's ``clipcheck run`` launcher is a child of ``root``)."""
    parents = process_parents()
    below = descendants(root, parents)
    return [pid for pid in below if parents.get(pid) != root and not descendants(pid, parents)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-list", default=DEFAULT_WORLDS)
    p.add_argument("matrix_args", nargs="*", help="more flags for clipcheck matrix (after --)")
    args = p.parse_args()
    worlds: dict[int, World] = {}
    with tempfile.TemporaryDirectory(prefix="clipcheck-main-job-") as out:
        cmd = [sys.executable, "-m", "harness", "matrix", "--nproc-list", args.nproc_list, "--out", out,
               *args.matrix_args]
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        done = threading.Event()

        def sample() -> None:
            while not done.wait(SAMPLE_S):
                ranks = _ranks(proc.pid)
                if not ranks:
                    continue
                world = worlds.setdefault(len(ranks), World(len(ranks)))
                for rank in ranks:
                    names = threads_of(rank)
                    if sum(names.values()) > world.most_threads:
                        world.most_threads, world.names = sum(names.values()), dict(names)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for line in proc.stdout:  # "launch: world N gloo: C cases ... J/C judged, VERDICT in S s": one line at its end
            begun, ended = LAUNCH_START.search(line), LAUNCH_END.search(line)
            if begun and ended:
                world = worlds.setdefault(int(begun.group(1)), World(int(begun.group(1))))
                world.cases, world.seconds, world.verdict = int(begun.group(3)), float(ended.group(4)), ended.group(3)
        status = proc.wait()
        done.set()
        sampler.join()
        wall = time.perf_counter() - start
    print(f"{'world':>5} {'cases':>6} {'seconds':>8} {'most threads':>13}  verdict; threads by name at the most")
    for world in sorted(worlds.values(), key=lambda w: w.size):
        names = ", ".join(f"{k} {v}" for k, v in sorted(world.names.items(), key=lambda kv: -kv[1]))
        print(f"{world.size:>5} {world.cases:>6} {world.seconds:>8.1f} {world.most_threads:>13}  {world.verdict}; {names}")
    matrix = sum(w.seconds for w in worlds.values())
    most = max((w.most_threads for w in worlds.values()), default=0)
    print(f"clipcheck matrix: {wall:.1f} s in all (exit {status}), launches {matrix:.1f} s")
    if args.nproc_list == DEFAULT_WORLDS and not args.matrix_args:
        print(f"goal: launches <= {MATRIX_GOAL_S:.0f} s -> {'met' if matrix <= MATRIX_GOAL_S else 'NOT met'}; "
              f"threads <= {THREAD_CEILING} per rank -> {'met' if most <= THREAD_CEILING else 'NOT met'} (most {most})")
    return 0 if status in (0, 1) else status


if __name__ == "__main__":
    sys.exit(main())
