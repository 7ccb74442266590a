"""``clipcheck --replay BLOB``: run the one case a fuzz failure printed (the blob: ``harness.cases.blob``),
under torchrun at the world size it needs, or on a world of ranks started for it."""

from __future__ import annotations

import sys
from typing import Sequence

from harness.run.devices import world_problem
from harness.run.world import default_backend
from harness.cases.blob import case_spec, decode_trusted
from harness.cases.plan import Plan, UsageError
from harness.strategies import DrawnScenario
from harness.targets.registry import registered_targets
from harness.targets.target import resolve_target


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
    from harness.run.pool import RankPool
    from harness.run.on_pool import run_case_on_pool
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
