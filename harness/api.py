"""``harness.check``: the built-in scenarios against your clip function, from Python.

    import harness

    report = harness.check("my_pkg.clip:clip_grad_norm", scenarios=["dense_dp", "xorl_ep_lora"], worlds=[2, 4])
    assert report.passed, report.describe()

It is the command line's run without a launcher: the same planning (and the same one-line
``ClipcheckInputError`` for bad input, raised before any process starts), the same judge, the same
records (``report.records`` are the JSON Lines records, one ``summary`` per world), on warm worlds
(``RankPool``) instead of torchrun jobs. The ranks are separate processes, so the target must be
importable by name there: a ``"module:function"`` / ``"path/to/file.py:function"`` string, a
registered target name, or a module-level function of an importable module.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from harness.judge.records import CaseRecord, MetamorphicRecord, Record, case_records, metamorphic_records
from harness.run.world.devices import world_problem
from harness.errors import ClipcheckInputError
from harness.cases.loading import load_object
from harness.cases.matrix import MatrixSpec, parse_mapping
from harness.plan.project import project_defaults
from harness.plan.planner import Plan, plan_cases
from harness.judge.checks import unjudged_result
from harness.run.hosts.pool import PoolBroken, RankPool
from harness.run.hosts.pool_cases import forget_blame, run_case_on_pool
from harness.report.failures import failures_text
from harness.report.reporter import Reporter
from harness.judge.verdicts import EXIT_PASS, count
from harness.plan.project import timeout_problem
from harness.run.world.dist_world import default_backend


DEFAULT_WORLDS = (2,)


@dataclass
class CheckReport:
    """What ``check`` found: every record, the text the CLI would have printed, and the status."""

    records: list[Record] = field(default_factory=list)
    text: str = ""
    status: int = EXIT_PASS
    """The command line's exit status for the same run (``verdicts``): 0 only when every case passed
    and at least one was judged; 4 when nothing was judged (every case a SKIP)."""
    skipped: list[str] = field(default_factory=list)
    """Worlds this machine cannot run (e.g. more ranks than GPUs on nccl), each with its reason."""

    @property
    def passed(self) -> bool:
        """Every case passed (no failure, no harness error, nothing unjudged), and some case was
        judged: a selection that is all SKIPs (a framework not installed) has not passed."""
        return self.status == EXIT_PASS

    @property
    def cases(self) -> list[CaseRecord]:
        return case_records(self.records)

    @property
    def metamorphic(self) -> list[MetamorphicRecord]:
        return metamorphic_records(self.records)

    @property
    def failures(self) -> list[CaseRecord]:
        return [r for r in self.cases if r["verdict"] in ("FAIL", "ERROR")]

    def describe(self) -> str:
        """Short, for ``assert report.passed, report.describe()``: the worlds skipped, each world's
        header and summary line, then the failing cases only (``FAILURES_SHOWN`` at most), each with
        its failed checks, signature, first blame lines and the ``clipcheck run`` command that runs it
        again. ``text`` holds everything ``clipcheck run`` would have printed (every case)."""
        kept = [line.split("; norm tolerance")[0] for line in self.text.splitlines()
                if line.startswith(("skipped: ", "clipcheck: ", "summary: "))]
        failing = failures_text(self.records)
        return "\n".join(kept + ([failing] if failing else []))


def target_reference(target: str | Callable[..., Any]) -> str:
    """The name the ranks resolve: strings as given; a function by ``module:qualname``, refused (one
    line) when the ranks could not import it back to the same object."""
    if isinstance(target, str):
        return target
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    reference = f"{module}:{qualname}"
    importable = module not in (None, "__main__") and "<locals>" not in qualname
    try:
        importable = importable and load_object(reference) is target
    except ClipcheckInputError:
        importable = False
    if not importable:
        raise ClipcheckInputError(
            f"cannot pass {target!r} to the ranks: give a module-level function of an importable module, "
            "or a 'module:function' / 'path/to/file.py:function' string")
    return reference


def check(target: str | Callable[..., Any], *, scenarios: Sequence[str] | None = None,
          worlds: Iterable[int] | None = None, dtypes: Sequence[str] | None = None,
          norm_types: Sequence[float | str] | None = None, clip_ratios: Sequence[float] | None = None,
          max_norm: float | None = None, ep_sizes: Sequence[int] | None = None,
          variant: str | Sequence[str] | None = None, exclude: str | Sequence[str] | None = None,
          parallelism: Sequence[str] | None = None, seed: int | None = None, backend: str | None = None,
          timeout_s: float | None = None, pools: Mapping[int, RankPool] | None = None, blame: bool | str = "auto",
          plans: str | None = None, synthetic: bool | None = None) -> CheckReport:
    """Run the selected built-in (or ``module:Class``) scenarios against ``target`` at each world size.

    Defaults are the command line's: every scenario, fp32 and bf16, the scenario's norm types, bounds
    at 0.5x and 2x the true norm, world 2, a 60 s timeout; an argument left out (None) takes the value
    of ``[tool.clipcheck]`` in the current directory's ``pyproject.toml`` (``harness.plan.project``;
    its ``targets`` do not apply: ``target`` names the one clip), and an argument given wins. A world this machine cannot run (nccl with fewer GPUs than ranks)
    is skipped with its reason (``report.skipped``), as the matrix does; none runnable is bad input.
    ``pools`` reuses warm worlds you hold (e.g. the pytest plugin's
    ``rank_pool``), keyed by world size; other worlds are started here and closed afterwards.
    ``blame``: for a case with a wrong norm, the weight the target gives each parameter group (each
    record's ``blame``; printed under the case): ``"auto"`` (the default) once per layout, target, norm
    and dtype, ``"all"`` (or True) every failing case, ``"off"`` (or False) never. ``plans``: ``"all"``
    (the default) or ``"honest"`` (every declared plan replaced by the truth: ``--plans``). ``synthetic``:
    also the scenarios' synthetic (regression) layouts, which no known trainer path reaches (``--synthetic``;
    off by default). ``variant`` / ``exclude``: label patterns (one string or several) a layout must
    match / must not match (``--variant``, ``--exclude``); ``parallelism``: the kinds a layout may be built
    from (``["ep", "fsdp"]``: ``--parallelism``, docs/matrix.md).

    Raises ``ClipcheckInputError`` for bad input, before any rank starts. What goes wrong once ranks
    run is in the report: a hung or dead rank is its case's ERROR, and a world whose ranks do not
    start (``PoolBroken``) leaves its cases ERROR records (``not_run``), status 3."""
    project = project_defaults()
    raw: dict[str, Any] = {"targets": [target_reference(target)]}
    for key, value in (("scenarios", scenarios), ("dtypes", dtypes), ("norm_types", norm_types),
                       ("clip_ratios", clip_ratios), ("ep_sizes", ep_sizes), ("worlds", worlds),
                       ("parallelism", parallelism), ("variant", variant), ("exclude", exclude)):
        if value is not None:  # a lone string is a list of one (not of its characters)
            raw[key] = [value] if isinstance(value, str) else [str(v) if key == "norm_types" else v for v in value]
    for key, single in (("max_norm", max_norm), ("seed", seed), ("plans", plans), ("synthetic", synthetic)):
        if single is not None:
            raw[key] = single
    spec = MatrixSpec(worlds=DEFAULT_WORLDS).updated(project.without("targets")).updated(
        parse_mapping(raw, source="harness.check"))
    timeout_s = timeout_s if timeout_s is not None else project.timeout if project.timeout is not None else 60.0
    problem = timeout_problem(timeout_s, "timeout_s")
    if problem:
        raise ClipcheckInputError(problem)
    backend = backend or default_backend()
    report = CheckReport()
    runnable = []
    for world in spec.worlds:
        reason = world_problem(world, backend)
        if reason:
            report.skipped.append(f"world {world} {backend}: {reason}")
        else:
            runnable.append(world)
    if not runnable:
        raise ClipcheckInputError("nothing to run" + "".join(f"; {line}" for line in report.skipped))
    planned = {world: plan_cases(spec, world, backend) for world in runnable}  # every input error first
    out = io.StringIO()
    for line in report.skipped:
        print(f"skipped: {line}", file=out)
    for world, plan in planned.items():
        given = (pools or {}).get(world)
        pool = given or RankPool(world, backend=backend, timeout_s=timeout_s, import_main=False)
        try:
            _run_plan(pool, plan, world, backend, out, report.records, blame)
        finally:
            if given is None:
                pool.close()
    report.text = out.getvalue()
    report.status = count(report.records).status  # over every world: 4 at one must not hide 3 at another
    return report


def _run_plan(pool: RankPool, plan: Plan, world: int, backend: str, out: io.StringIO,
              records: list[Record], blame: bool | str) -> None:
    """One world's plan on ``pool``. A world whose ranks do not start (or do not start again after a
    case killed them) is not a crash of ``check``: its cases not run are ERROR records (``not_run``)
    and the status 3, as ``clipcheck run`` records a launch that could not run them; the other
    worlds still run."""
    reporter = Reporter(out, None, world, backend, verbose=False, targets=plan.targets)
    reporter.header(len(plan.cases), plan.header_lines())
    judged = 0
    try:
        pool.run(forget_blame)  # the plan's weighings are its own
        for case in plan.cases:
            reporter.case(run_case_on_pool(pool, case, plan.scenarios[case.scenario], blame))
            judged += 1
    except PoolBroken as exc:
        for case in plan.cases[judged:]:
            reporter.case(unjudged_result(case, "not_run", f"not run: {exc}", world))
    reporter.finish()
    records.extend(reporter.records)
