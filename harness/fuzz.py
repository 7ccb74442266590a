"""Property-based fuzzing of layouts: does a clip function match the ground truth on *every* layout?

    python -m harness fuzz --target mutant-local-root-mean --examples 200 --world 4

Hypothesis draws cases (``harness.strategies``) in this process; each runs on a warm world of ranks
(``RankPool``), so an example costs milliseconds. The property is "the harness's verdict is PASS".
A failure is shrunk to a minimal layout and printed with a one-line replay command. A case the
harness could not judge (a rank hung or died) ends the search at once, unshrunk: each such example
costs a restart of the world, and the first one already names the rank and the cause.

Exit status: 0 every target survived, 1 a verdict failed, 2 bad input, 3 a rank hung or died.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from .checks import CaseResult
from .devices import world_problem
from .loading import LoadError
from .pool import RankPool
from .pooled import run_case_on_pool
from .registry import registered_targets
from .replay import case_spec, replay_command
from .strategies import DrawnCase, DrawnScenario, drawn_cases
from .targets import resolve_target
from .verdicts import EXIT_BROKEN, EXIT_FAIL, EXIT_PASS, EXIT_USAGE
from .world import default_backend


@dataclass
class FuzzReport:
    target: str
    world_size: int
    examples: int
    seconds: float
    failed_at: int | None = None  # 1-based index of the first failing example
    minimal: DrawnCase | None = None
    result: CaseResult | None = None
    crash: str | None = None
    shrink_steps: int = 0
    log: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.failed_at is None

    @property
    def replay(self) -> str | None:
        return None if self.minimal is None else replay_command(self.minimal, self.target)


class _Failed(AssertionError):
    pass


def fuzz(target: str, pool: RankPool, examples: int, *, seed: int | None = None, shrink: bool = True,
         derandomize: bool = False, on_example: Callable[[int, CaseResult], None] | None = None,
         database: Any = None) -> FuzzReport:
    """Fuzz ``target`` on ``pool``'s world for up to ``examples`` drawn cases. ``database``: a
    hypothesis example database (e.g. ``DirectoryBasedExampleDatabase(".hypothesis")``) to replay
    earlier failures first; None (the default) keeps nothing between runs."""
    resolve_target(target, registered_targets())
    scenario = DrawnScenario()
    report = FuzzReport(target, pool.world_size, 0, 0.0)
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])

    @settings(max_examples=examples, deadline=None, database=database, derandomize=derandomize, phases=phases,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(drawn_cases(pool.world_size))
    def property_holds(drawn: DrawnCase) -> None:
        if report.crash is not None:  # no shrinking after a crash: only the crashed example fails
            if drawn == report.minimal:
                _fail(report.crash)
            return
        report.examples += 1
        result = run_case_on_pool(pool, case_spec(drawn, target), scenario)
        if result.verdict == "ERROR" and result.checks and result.checks[0].name in ("hang", "crash"):
            report.crash = f"{result.checks[0].name}: {result.checks[0].detail}"
            _record_failure(report, drawn, result)
            _fail(report.crash)
        if on_example is not None:
            on_example(report.examples, result)
        if result.verdict != "PASS":
            _record_failure(report, drawn, result)
            _fail(result.verdict)

    if seed is not None:
        property_holds = hypothesis_seed(seed)(property_holds)
    start = time.perf_counter()
    try:
        property_holds()
    except _Failed:
        pass
    report.seconds = time.perf_counter() - start
    return report


def _fail(message: str) -> None:
    """Every failure is raised from this one line: hypothesis replays the minimal example and calls
    the run flaky if the failure comes from a different place than when it was found."""
    raise _Failed(message)


def _record_failure(report: FuzzReport, drawn: DrawnCase, result: CaseResult | None) -> None:
    if report.failed_at is None:
        report.failed_at = report.examples
    else:
        report.shrink_steps += 1
    # hypothesis runs the minimal failing example last, so the last one recorded is the shrunk one
    report.minimal, report.result = drawn, result


def describe(report: FuzzReport) -> list[str]:
    rate = report.examples / report.seconds if report.seconds else 0.0
    head = (f"{report.target} on {report.world_size} rank(s): {report.examples} examples in "
            f"{report.seconds:.1f} s ({rate:.1f}/s)")
    if report.passed:
        return [f"{head}: PASS"]
    lines = [f"{head}: FAIL (first failure at example {report.failed_at}, shrunk in {report.shrink_steps} steps)"]
    assert report.minimal is not None
    layout = report.minimal.variant.layout
    lines.append(f"  minimal case: mesh {layout.describe()}, {len(layout.params)} param(s), "
                 f"L{report.minimal.norm_type:g} {report.minimal.variant.injection.dtype}, "
                 f"max_norm {report.minimal.max_norm:.6g}")
    for spec in layout:
        placement = ", ".join(f"{d}={p}" for d, p in spec.placements) or "replicated"
        present = "" if spec.present_ranks is None else f" on ranks {sorted(spec.present_ranks)}"
        lines.append(f"    {spec.name} {list(spec.shape)} {placement}{present}")
    if report.crash:
        lines.append(f"  not judged ({report.crash.splitlines()[0]}); the search stopped without shrinking")
    if report.result is not None:
        r = report.result
        lines.append(f"  verdict {r.verdict}: reported {r.reported[0] if r.reported else None} true {r.truth}")
        lines += [f"    {c.name}: {c.detail}" for c in r.failed]
        lines += [f"      signature: {s}" for s in r.signature]
    lines.append(f"  replay: {report.replay}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clipcheck fuzz", allow_abbrev=False,
                                description="Fuzz clip functions over layouts drawn by hypothesis, on a warm world.")
    p.add_argument("--target", required=True, help="target name(s), comma separated, or module:function")
    p.add_argument("--examples", type=int, default=100, help="examples per target (default 100)")
    p.add_argument("--world", type=int, default=4, help="ranks in the warm world (default 4)")
    p.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    p.add_argument("--no-shrink", action="store_true", help="report the first failure as found")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a collective may block (default 30)")
    return p


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    targets = [t.strip() for t in args.target.split(",") if t.strip()]
    try:
        if args.examples < 1 or args.world < 1:
            raise LoadError("--examples and --world must be positive")
        for t in targets:
            resolve_target(t, registered_targets())
        if not args.timeout > 0:
            raise LoadError("--timeout must be positive")
        problem = world_problem(args.world, args.backend or default_backend())
        if problem:  # the one world asked for cannot run here: bad input, before any process starts
            raise LoadError(problem)
    except LoadError as exc:
        print(f"clipcheck: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    status = EXIT_PASS
    with RankPool(args.world, backend=args.backend, timeout_s=args.timeout) as pool:
        for t in targets:
            report = fuzz(t, pool, args.examples, seed=args.seed, shrink=not args.no_shrink)
            if not report.passed:
                status = max(status, EXIT_BROKEN if report.crash else EXIT_FAIL)
            print("\n".join(describe(report)), flush=True)
    return status
