"""``clipcheck --replay BLOB``: run the one case a fuzz failure printed (the blob: ``harness.cases.blob``),
under torchrun at the world size it needs, or on a world of ranks started for it; ``--from-audit PATH
--target T``: the layout ``harness.audit`` measured on a real job (``harness.cases.measured``), the same
ways (``clipcheck run --from-audit``: the launcher)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Sequence

from harness.run.world.devices import world_problem
from harness.run.world.dist_world import default_backend
from harness.cases.blob import case_spec, decode_trusted
from harness.cases.variant import CaseSpec
from harness.errors import UsageError
from harness.plan.planner import Plan
from harness.cases.drawn import DrawnScenario
from harness.targets.registry import registered_targets
from harness.targets.target import resolve_target

if TYPE_CHECKING:
    from harness.cases.measured import AuditFile


def replay_plan(blob: str, world_size: int, named_targets: Sequence[str] = ()) -> Plan:
    """A one-case plan for a torchrun launch of exactly the world size the case needs. ``named_targets``:
    the targets the command line names, the only ones besides built-ins a blob may name."""
    drawn, target = decode_trusted(blob, named_targets)
    if world_size != drawn.world_size:
        raise UsageError(f"this case needs {drawn.world_size} ranks, the launch has {world_size}: "
                         f"use torchrun --nproc_per_node={drawn.world_size}, or no launcher at all")
    resolved = resolve_target(target, registered_targets())
    return Plan(cases=[case_spec(drawn, target)], scenarios={DrawnScenario.name: DrawnScenario()},
                targets={target: resolved})


def replay_on_pool(blob: str, backend: str | None, timeout_s: float, json_path: str | None, verbose: bool,
                   named_targets: Sequence[str] = ()) -> int:
    """Start the ranks the case needs, run it, report it like a launch would."""
    from harness.run.hosts.pool import RankPool
    from harness.run.hosts.pool_cases import run_case_on_pool
    from harness.report.reporter import Reporter

    drawn, target = decode_trusted(blob, named_targets)
    problem = world_problem(drawn.world_size, backend or default_backend())
    if problem:  # a world this machine cannot run: bad input, before any process starts
        raise UsageError(problem)
    resolve_target(target, registered_targets())  # a clear error before any process starts
    reporter = Reporter(sys.stdout, json_path, drawn.world_size, backend or "gloo", verbose)
    with RankPool(drawn.world_size, backend=backend, timeout_s=timeout_s) as pool:
        reporter.header(1, [f"replaying a drawn case on a fresh world of {drawn.world_size} rank(s)"])
        reporter.case(run_case_on_pool(pool, case_spec(drawn, target), DrawnScenario()))
        return reporter.finish()


def audit_plan(path: str, targets: Sequence[str] | None, world_size: int | None,
               max_norm: float | None = None) -> tuple[Plan, AuditFile]:
    """The plan of ``--from-audit PATH``: the measured case once per ``--target`` (a file names no target:
    it comes from the command line), at the world size the audit ran on; bad input as one line."""
    from harness.cases.measured import SCENARIO, dtensor_replay_problem, measured_scenario, read_audit

    saved = read_audit(path)
    if not targets:
        raise UsageError("--from-audit needs --target (an audit file names no target: give the clip to replay, "
                         "a registered name or module:function)")
    if world_size is not None and world_size != saved.world_size:
        raise UsageError(f"the audit ran on {saved.world_size} ranks, the launch has {world_size}: use "
                         f"--nproc {saved.world_size} (torchrun --nproc_per_node={saved.world_size}), or no launcher")
    registered = registered_targets()
    resolved = {t: resolve_target(t, registered) for t in targets}
    for name, target in resolved.items():
        if target.scenarios is not None:
            raise UsageError(f"target {name} runs with {', '.join(target.scenarios)} only, not a measured layout "
                             "(a framework's adapter needs its own model: audit the framework in its own job)")
        problem = dtensor_replay_problem(saved.variant) if target.dtensor_only else None
        if problem is not None:
            raise UsageError(f"target {name} needs DTensor parameters on every rank, which this measured layout "
                             f"cannot replay: {problem}")
    bound = max_norm if max_norm is not None else saved.max_norm
    cases = [CaseSpec(i, SCENARIO, saved.variant, name, saved.norm_type, bound, resolved[name].unavailable())
             for i, name in enumerate(resolved)]
    return Plan(cases=cases, scenarios={SCENARIO: measured_scenario()}, targets=resolved), saved


def audit_on_pool(path: str, targets: Sequence[str] | None, backend: str | None, timeout_s: float,
                  json_path: str | None, verbose: bool, max_norm: float | None = None) -> int:
    """``--from-audit`` without a launcher: start the ranks the audit ran on, replay, report."""
    from harness.run.hosts.pool_cases import run_case_on_pool
    from harness.run.hosts.pool import RankPool
    from harness.report.reporter import Reporter

    plan, saved = audit_plan(path, targets, None, max_norm)
    problem = world_problem(saved.world_size, backend or "gloo")
    if problem:  # a world this machine cannot run: bad input, before any process starts
        raise UsageError(problem)
    reporter = Reporter(sys.stdout, json_path, saved.world_size, backend or "gloo", verbose, plan.targets)
    with RankPool(saved.world_size, backend=backend, timeout_s=timeout_s) as pool:
        reporter.header(len(plan.cases), [audit_note(saved)])
        for case in plan.cases:
            reporter.case(run_case_on_pool(pool, case, plan.scenarios[case.scenario]))
        return reporter.finish()


def audit_note(saved: AuditFile) -> str:
    """What the audit itself found, printed above its replay: the replay's truth must equal it."""
    found = saved.found

    def shown(key: str) -> str:  # the file is someone else's data: nothing it says may forge a line
        text = str(found.get(key, "?"))
        return text if text.isprintable() else repr(text)

    truth = found.get("truth")
    what = f"truth {shown('truth')}" if truth is not None else "no truth"
    return (f"replaying a layout measured by harness.audit on {saved.world_size} rank(s) ({what}, the clip "
            f"{shown('target')} reported {shown('reported')}: {shown('verdict')})")
