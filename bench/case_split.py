"""Where a ``clipcheck run`` launch's wall time goes, phase by phase: what ``overhead_bench.py --split``
prints, to say which step to make cheaper next.

    python bench/overhead_bench.py --worlds 4 --split                   # the default matrix's world-4 launch
    python bench/overhead_bench.py --worlds 4 --split --by-scenario     # and rank 0's wall per scenario

``python bench/case_split.py --launch run ...`` is ``clipcheck run ...`` with the runner's phase functions
wrapped in timers (the ranks are forked from that launcher, so they inherit the wrappers; the product's hot
path has no timers of its own). Each rank writes, when its cases are done (``CLIPCHECK_SPLIT_DIR``), the wall
and CPU seconds (``time.thread_time``, its main thread) it spent in each phase, exclusive of the phases
nested inside (a store round inside ``agree`` counts as ``exchange``), and how often it entered each. Rank
0's wall is the launch's critical path (it judges and writes; ``exchange`` there is mostly waiting for the
slowest rank). The phases:

* start-up (the launcher, then rank 0, up to its first case): planning, the frameworks' imports, and the
  rest (the interpreter, torch and the harness imported, the ranks forked, their first groups);
* build (the model; its groups: meshes, a generation renewed and the dropped groups freed), framework setup
  (a target's ``dress``), inject, snapshot (the copies of gradients and parameters the checks compare),
  measure (the pre-call truth, its store round inside ``exchange``), target (the clip function under test;
  ``target (backward)``: a framework's own backward, which delivers the gradients), effects (what the call
  did: flags and wrappers ``(state)``, late changes ``(late)``, processes left ``(processes)``, the replicas'
  digests ``(replicas)``), judge and write (rank 0), exchange (the store rounds, by topic), ``late check``
  (the last case's model checked once more), ``blame`` and ``honest plan`` (a failing case's re-runs,
  outside their own cases' phases), and ``loop`` (the rest).
An exchange is named by its topic: ``exchange (status)``, the round after the target's call, is where rank 0
waits for the slowest rank's call to end, part of the target's own ``seconds``.
The targets' own ``seconds`` in the records (overhead_bench's denominator) are the ``target`` phase's
slowest rank, per case.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]

SPLIT_DIR_ENV = "CLIPCHECK_SPLIT_DIR"

_BORN = time.perf_counter()
_STACK: list[str] = []
_WALL: collections.defaultdict[str, float] = collections.defaultdict(float)
_CPU: collections.defaultdict[str, float] = collections.defaultdict(float)
_CALLS: collections.Counter[str] = collections.Counter()
_MARK = [_BORN, time.thread_time()]  # wall, cpu when the innermost phase was last resumed
_STARTUP: dict[str, float] = {}
_SCENARIOS: dict[str, list[float]] = {}
_FIRST_CASE: list[float] = []


def _charge() -> None:
    now, cpu = time.perf_counter(), time.thread_time()
    phase = _STACK[-1] if _STACK else "loop"
    _WALL[phase] += now - _MARK[0]
    _CPU[phase] += cpu - _MARK[1]
    _MARK[0], _MARK[1] = now, cpu


def timed(phase: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its time (exclusive of the phases nested in it) charged to ``phase`` (or to
    ``phase(*args)``), on the main thread only."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)
        _charge()
        _STACK.append(phase(*args, **kwargs) if callable(phase) else phase)
        _CALLS[_STACK[-1]] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _charge()
            _STACK.pop()
    return wrapper


def _patch(owner: Any, name: str, phase: str | Callable[..., str]) -> None:
    setattr(owner, name, timed(phase, getattr(owner, name)))


def _target_phase(world: Any, topic: str, fn: Any) -> str:
    return {"dress": "framework setup", "status": "target"}.get(topic, f"target ({topic})")


def install() -> None:
    """Wrap the phases' functions where the launcher and the runner look them up."""
    from harness.cases.scenario import Scenario
    from harness.commands import launcher
    from harness.report.reporter import Reporter
    from harness.run.case import blame_reruns, runner
    from harness.run.case.truth_cache import TruthCache
    from harness.run.hosts import launch
    from harness.run.world.dist_world import DistWorld
    from harness.targets.registry import builtin_scenarios

    _patch(launcher, "plan_cases", "start-up: planning")
    _patch(launcher, "preload_frameworks", "start-up: frameworks' imports")
    _patch(runner, "attach", "build")
    for name in ("local_grads", "snapshot_params"):
        _patch(runner, name, "snapshot")
    _patch(runner, "rank_effects", "effects")
    for name in ("fingerprint", "settled_changes"):
        _patch(runner, name, "effects (late)")
    for name in ("census", "left_behind"):
        _patch(runner, name, "effects (processes)")
    _patch(runner.replicas, "rank_part", "effects (replicas)")
    _patch(runner.ModelState, "of", "effects (state)")
    _patch(runner.GlobalState, "of", "effects (state)")
    for name in ("evaluate", "variant_truth", "measured_norm"):
        _patch(runner, name, "judge")
    _patch(runner.replicas, "merge_parts", "judge")
    _patch(runner, "guarded", _target_phase)
    _patch(TruthCache, "measure", "measure")
    for name in ("allgather_json", "gather_json"):
        _patch(DistWorld, name, lambda world, topic, *rest, **kw: f"exchange ({topic})")
    for name in ("mesh", "before_case"):
        _patch(DistWorld, name, "build (groups)")
    _patch(DistWorld, "teardown", "build (groups dropped)")
    _patch(DistWorld, "_free_dropped_groups", "build (groups freed)")
    _patch(DistWorld, "_new_generation", "build (new generation)")
    _patch(Reporter, "case", "write")
    _patch(launch.Executor, "_report_pending", "late check")
    _patch(blame_reruns, "_weighed", "blame")
    _patch(blame_reruns, "_tried_on_the_honest_plan", "honest plan")
    for cls in {type(s) for s in builtin_scenarios().values()} | {Scenario}:
        for name, phase in (("build_model", "build"), ("dress", "build"), ("inject", "inject")):
            if name in vars(cls):
                _patch(cls, name, phase)
    _patch_case_loop(runner, blame_reruns, launch)


def _patch_case_loop(runner: Any, blame_reruns: Any, launch: Any) -> None:
    """The first case ends the start-up; each case's wall on this rank goes to its scenario; each rank
    writes its figures when its cases are done."""
    run_case, with_blame, run = runner.run_case, launch.run_case_with_blame, launch.Executor.run

    @functools.wraps(run_case)
    def first_case(*args: Any, **kwargs: Any) -> Any:
        if not _FIRST_CASE:
            _charge()
            _FIRST_CASE.append(time.perf_counter())
            _STARTUP.update((k, v) for k, v in _WALL.items() if k.startswith("start-up"))
            for counter in (_WALL, _CPU, _CALLS):
                counter.clear()
        return run_case(*args, **kwargs)

    @functools.wraps(with_blame)
    def per_scenario(world: Any, state: Any, case: Any, *rest: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return with_blame(world, state, case, *rest, **kwargs)
        finally:
            entry = _SCENARIOS.setdefault(case.scenario, [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - start

    @functools.wraps(run)
    def dumped(self: Any) -> int:
        try:
            return run(self)
        finally:
            _charge()
            first = _FIRST_CASE[0] if _FIRST_CASE else time.perf_counter()
            Path(os.environ[SPLIT_DIR_ENV], f"rank{self.world.rank}.json").write_text(json.dumps({
                "rank": self.world.rank, "wall": dict(_WALL), "cpu": dict(_CPU), "calls": dict(_CALLS),
                "startup": first - _BORN, "startup_phases": _STARTUP, "cases_wall": time.perf_counter() - first,
                "scenarios": _SCENARIOS}))

    runner.run_case = blame_reruns.run_case = first_case
    launch.run_case_with_blame = per_scenario
    launch.Executor.run = dumped


def launch_command(python: str, run_args: list[str]) -> list[str]:
    """The command that runs ``clipcheck run RUN_ARGS`` with the timers in place."""
    return [python, str(Path(__file__).resolve()), "--launch", "run", *run_args]


def read_split(folder: Path) -> list[dict[str, Any]]:
    """Every rank's figures, in rank order."""
    return sorted((json.loads(f.read_text()) for f in folder.glob("rank*.json")), key=lambda r: r["rank"])


def print_split(world: int, ranks: list[dict[str, Any]], cases: int, target_s: float) -> None:
    """The start-up's and the cases' split, rank 0's wall first (the launch's critical path)."""
    zero = ranks[0]
    startup = zero["startup"]
    phases = zero["startup_phases"]
    rest = startup - sum(phases.values())
    print(f"world {world}: start-up {startup:.1f} s: " + ", ".join(
        [f"{k.split(': ', 1)[1]} {v:.1f} s" for k, v in sorted(phases.items())] +
        [f"the rest (interpreter, torch and harness imports, ranks forked, first groups) {rest:.1f} s"]))
    print(f"world {world}: {cases} cases in {zero['cases_wall']:.1f} s on rank 0; the targets' own seconds "
          f"{target_s:.1f} s")
    print(f"world {world}: {'phase':24} {'rank 0 wall s':>13} {'rank 0 cpu s':>12} {'all ranks cpu s':>15} "
          f"{'ms/case':>8} {'calls':>7}")
    for k in sorted(zero["wall"], key=lambda k: -zero["wall"][k]):
        cpu = sum(r["cpu"].get(k, 0.0) for r in ranks)
        print(f"world {world}: {k:24} {zero['wall'][k]:13.2f} {zero['cpu'].get(k, 0.0):12.2f} {cpu:15.2f} "
              f"{1000 * zero['wall'][k] / max(cases, 1):8.2f} {zero['calls'].get(k, 0):7d}")


def print_by_scenario(world: int, ranks: list[dict[str, Any]], records: list[dict[str, Any]]) -> None:
    """Rank 0's wall per scenario (each case with its blame and honest-plan re-runs), next to its targets'
    own seconds, most first."""
    target: collections.defaultdict[str, float] = collections.defaultdict(float)
    for r in records:
        if r.get("verdict") != "SKIP":
            target[r["scenario"]] += float(r.get("seconds") or 0.0)
    rows = sorted(ranks[0]["scenarios"].items(), key=lambda kv: -kv[1][1])
    print(f"world {world}: {'scenario':<20} {'cases':>5} {'wall s':>7} {'target s':>8} {'ms/case':>8} {'ratio':>6}")
    for name, (n, wall) in rows:
        ratio = wall / target[name] if target[name] else float("inf")
        print(f"world {world}: {name:<20} {int(n):>5} {wall:>7.1f} {target[name]:>8.1f} {1000 * wall / n:>8.1f} "
              f"{ratio:>5.1f}x")


if __name__ == "__main__" and sys.argv[1:2] == ["--launch"]:
    sys.path.insert(0, str(ROOT))
    install()
    from harness.commands.main import leave, main as command

    leave(command(sys.argv[2:]))
