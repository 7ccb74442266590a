"""Property-based fuzzing of layouts: does a clip function match the ground truth on *every* layout?

    python -m harness fuzz --target mutant-local-root-mean --examples 200 --world 4

Hypothesis draws cases (``harness.strategies``) in this process; each runs on a warm world of ranks
(``RankPool``), so an example costs milliseconds. The property is "the harness's verdict is PASS".
A failure is shrunk to a minimal layout and printed with a one-line replay command. A case the
harness could not judge (a rank hung or died) ends the search at once, unshrunk: each such example
costs a restart of the world, and the first one already names the rank and the cause.

The command line is ``harness.commands.fuzz``.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Flaky

from harness.cases.matrix import PLAN_PROFILES
from harness.cases.variant import with_honest_plan
from harness.errors import ClipcheckInputError
from harness.judge.blame import blame_lines
from harness.judge.records import CaseResult
from harness.judge.records import FuzzRecord
from harness.report.reporter import case_json
from harness.run.hosts.pool import RankPool
from harness.run.hosts.pool_cases import run_case_on_pool
from harness.run.world.dist_world import default_backend
from harness.targets.registry import registered_targets
from harness.cases.blob import case_spec, replay_command
from harness.cases.injection import Injection
from harness.cases.layout import Layout, box_contains, unravel
from harness.cases.drawn import DrawnCase, DrawnScenario
from harness.strategies import drawn_cases
from harness.targets.target import resolve_target


@dataclass
class FuzzReport:
    """What ``fuzz`` found for one target. It reads as ``CheckReport`` and ``AuditReport`` do:
    ``passed``, ``describe()`` (the text ``clipcheck fuzz`` prints) and ``record()`` (the JSON Lines
    record ``--json`` writes), so a test asserts on any of the three the same way."""

    target: str
    world_size: int
    examples: int
    seconds: float
    failed_at: int | None = None  # 1-based index of the first failing example
    minimal: DrawnCase | None = None
    result: CaseResult | None = None
    crash: str | None = None
    shrink_steps: int = 0
    flaky: str | None = None
    """Why the first failure did not come back when hypothesis ran the same example again."""
    log: list[str] = field(default_factory=list)
    backend: str | None = None
    """The world's backend (``fuzz`` sets it), for ``record()``."""

    @property
    def passed(self) -> bool:
        return self.failed_at is None

    @property
    def replay(self) -> str | None:
        return None if self.minimal is None else replay_command(self.minimal, self.target)

    def describe(self) -> str:
        """Short, for ``assert report.passed, report.describe()``: one line for a pass; for a failure the
        minimal case in words, its verdict, failed checks, signature and blame, and its ``replay:``
        command (what ``clipcheck fuzz`` prints)."""
        rate = self.examples / self.seconds if self.seconds else 0.0
        head = (f"{self.target} on {self.world_size} rank(s): {self.examples} examples in "
                f"{self.seconds:.1f} s ({rate:.1f}/s)")
        if self.passed:
            return f"{head}: PASS"
        lines = [f"{head}: FAIL (first failure at example {self.failed_at}, shrunk in {self.shrink_steps} steps)"]
        if self.flaky:
            lines.append(f"  {self.flaky}")
        lines += [f"  {line}" for line in minimal_case_lines(self)]
        if self.crash:
            lines.append(f"  not judged ({self.crash.splitlines()[0]}); the search stopped without shrinking")
        if self.result is not None:
            r = self.result
            lines.append(f"  verdict {r.verdict}: reported {r.reported[0] if r.reported else None} true {r.truth}")
            lines += [f"    {c.name}: {c.detail}" for c in r.failed]
            lines += [f"      signature: {s}" for s in r.signature]
            lines += [f"      blame: {line}" for line in blame_lines(r)]
        lines.append(f"  replay: {self.replay}")
        return "\n".join(lines)

    def record(self) -> FuzzRecord:
        """The report as one JSON Lines record (``clipcheck fuzz --json``)."""
        backend = self.backend or default_backend()
        return FuzzRecord(
            type="fuzz", target=self.target, world_size=self.world_size, backend=backend,
            examples=self.examples, seconds=round(self.seconds, 3), passed=self.passed,
            failed_at=self.failed_at, shrink_steps=self.shrink_steps, crash=self.crash, flaky=self.flaky,
            minimal=minimal_case_lines(self),
            result=None if self.result is None else case_json(self.result, self.world_size, backend),
            replay=self.replay)


class _Failed(AssertionError):
    pass


FLAKY = ("failed when first drawn, passed when the same example ran again: the function keeps state between "
         "calls (or depends on timing); the failure shown is the first one, as it was judged")


def fuzz(target: str, pool: RankPool, examples: int, *, seed: int | None = None, shrink: bool = True,
         derandomize: bool = False, on_example: Callable[[int, CaseResult], None] | None = None,
         database: Any = None, blame: bool = True, plans: str = "all") -> FuzzReport:
    """Fuzz ``target`` on ``pool``'s world for up to ``examples`` drawn cases. ``database``: a
    hypothesis example database (e.g. ``DirectoryBasedExampleDatabase(".hypothesis")``) to replay
    earlier failures first; None (the default) keeps nothing between runs. ``blame``: re-run the
    minimal failing case one parameter group at a time (``harness.run.case.blame_reruns``) when its norm is wrong."""
    resolve_target(target, registered_targets())
    scenario = DrawnScenario()
    report = FuzzReport(target, pool.world_size, 0, 0.0, backend=pool.backend or default_backend())
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])

    @settings(max_examples=examples, deadline=None, database=database, derandomize=derandomize, phases=phases,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(drawn_cases(pool.world_size))
    def property_holds(drawn: DrawnCase) -> None:
        if plans == "honest":
            drawn = dataclasses.replace(drawn, variant=with_honest_plan(drawn.variant))
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
    except Flaky:  # the failure did not come back on replay: judged as found, never a crash of the search
        report.flaky = FLAKY
    if report.crash is None and report.flaky is None and report.minimal is not None:
        # the minimal case once more, on its own (with its blame): a failure that does not come back was
        # the function's state or timing, and the failure shown stays the one that was judged
        again = run_case_on_pool(pool, case_spec(report.minimal, target), scenario, blame=blame)
        if again.verdict == "PASS":
            report.flaky = FLAKY
        else:
            report.result = again
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
    """Deprecated: ``report.describe()`` (a string, as ``CheckReport.describe`` and
    ``AuditReport.describe`` are). Kept for callers of the old module function: the same lines."""
    warnings.warn("harness.fuzz.describe(report) is deprecated: use report.describe()", DeprecationWarning,
                  stacklevel=2)
    return report.describe().split("\n")


def minimal_case_lines(report: FuzzReport) -> list[str]:
    """The minimal failing case in words: mesh, every parameter with its placements (and what the
    plan declares where that differs), and everything the injection does."""
    if report.minimal is None:
        return []
    variant = report.minimal.variant
    layout = variant.layout
    lines = [f"minimal case: mesh {layout.describe()}, {len(layout.params)} param(s), "
             f"L{report.minimal.norm_type:g} {variant.injection.dtype}, max_norm {report.minimal.max_norm:.6g}"
             f"{', DTensor parameters placed as declared' if variant.dtensor else ''}"
             f"{' (plain: ' + ', '.join(sorted(variant.plain)) + ')' if variant.plain else ''}"]
    for spec in layout:
        placement = ", ".join(f"{d}={p}" for d, p in spec.placements) or "replicated"
        present = "" if spec.present_ranks is None else f" on ranks {sorted(spec.present_ranks)}"
        lies = {axis: p for axis, p in variant.declared.get(spec.name, {}).items() if p != spec.placement(axis)}
        declared = "; declared " + ", ".join(f"{d}={p}" for d, p in lies.items()) if lies else ""
        lines.append(f"  {spec.name} {list(spec.shape)} {placement}{present}{declared}")
    return lines + injection_lines(variant.injection, layout)


def fuzz_record(report: FuzzReport, backend: str) -> FuzzRecord:
    """``report.record()`` with the backend given (kept for its earlier callers)."""
    return dataclasses.replace(report, backend=backend).record()


def injection_lines(injection: Injection, layout: Layout) -> list[str]:
    """Everything an injection does, in words: what a minimal case's blob encodes."""
    lines = [f"gradients: seed {injection.seed}, {injection.dtype}, scale {injection.scale:g}"]
    if injection.zero:
        lines.append(f"  all zero: {', '.join(sorted(injection.zero))}")
    for name, ranks in injection.none_on:
        holders = sorted(r for r in range(layout.mesh.world_size)
                         if injection.grad_is_none(layout, layout.param(name), r) and layout.local_box(
                             layout.param(name), r) is not None)
        lines.append(f"  None on ranks {holders} for {name} (listed: {sorted(ranks)} and their replicas)")
    for name, flat, kind in injection.nonfinite:
        spec = layout.param(name)
        index = unravel(flat, spec.shape)
        box_holders = [r for r in range(layout.mesh.world_size)
                       if (box := layout.local_box(spec, r)) is not None and box_contains(box, index)]
        lines.append(f"  {kind} at {name}{list(index)}, held by ranks {box_holders}")
    return lines

