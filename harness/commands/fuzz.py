"""``clipcheck fuzz``: hypothesis over drawn layouts against one or more targets, on one warm world.

    clipcheck fuzz --target mutant-local-root-mean --examples 200 --world 4

Exit status: 0 every target survived, 1 a verdict failed, 2 bad input, 3 a rank hung or died,
4 no example was run, 5 ``--json`` could not be written, 130 / 143 interrupted.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from harness.cases.matrix import PLAN_PROFILES
from harness.commands.options import print_error, resolve_timeout, unwritable
from harness.plan.project import ProjectDefaults, project_defaults
from harness.errors import ClipcheckInputError
from harness.fuzz import FuzzReport, fuzz
from harness.judge.verdicts import EXIT_BROKEN, EXIT_FAIL, EXIT_NOTHING_JUDGED, EXIT_PASS, EXIT_USAGE, worst
from harness.report.results_file import ResultsFile, report_problems
from harness.run.world.devices import world_problem
from harness.run.hosts.pool import RankPool
from harness.run.world.dist_world import default_backend
from harness.cases.loading import LoadError
from harness.targets.registry import registered_targets
from harness.targets.target import resolve_target


DEFAULT_WORLD = 4
DEFAULT_TIMEOUT_S = 30.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clipcheck fuzz", allow_abbrev=False,
                                description="Fuzz clip functions over layouts drawn by hypothesis, on a warm world.")
    p.add_argument("--target", default=None,
                   help="target name(s), comma separated, or module:function (default: [tool.clipcheck] targets)")
    p.add_argument("--examples", type=int, default=100, help="examples per target (default 100)")
    p.add_argument("--world", type=int, default=None,
                   help=f"ranks in the warm world (default: the largest of [tool.clipcheck] worlds, "
                        f"else {DEFAULT_WORLD})")
    p.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    p.add_argument("--plans", choices=PLAN_PROFILES, default=None,
                   help="all: drawn plans may lie about placements; honest: each drawn plan replaced by the truth "
                        "(is a plan-trusting clip's arithmetic right?); default: [tool.clipcheck] plans, else all")
    p.add_argument("--no-shrink", action="store_true", help="report the first failure as found")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds a collective may block (default: [tool.clipcheck] timeout, "
                        f"else {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write one JSON Lines record per target (its minimal case, verdict, blame and replay)")
    return p


def apply_project_defaults(args: argparse.Namespace, project: ProjectDefaults) -> list[str]:
    """Fill what the command line left out from ``[tool.clipcheck]`` (targets, the largest of worlds,
    plans, timeout), else the built-in defaults; the targets to fuzz."""
    if args.target is None:
        if not project.axes.get("targets"):
            raise ClipcheckInputError("--target is required (or targets in [tool.clipcheck] of pyproject.toml)")
        args.target = ",".join(project.axes["targets"])
    if args.world is None:
        args.world = max(project.worlds, default=DEFAULT_WORLD)
    if args.plans is None:
        args.plans = project.axes.get("plans", "all")
    resolve_timeout(args, project, DEFAULT_TIMEOUT_S)
    return [t.strip() for t in args.target.split(",") if t.strip()]


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        targets = apply_project_defaults(args, project_defaults())
        if args.examples < 1 or args.world < 1:
            raise LoadError("--examples and --world must be positive")
        for t in targets:
            resolve_target(t, registered_targets())
        problem = unwritable(args.json)
        if problem:
            raise LoadError(f"--json {args.json}: {problem}")
        problem = world_problem(args.world, args.backend or default_backend())
        if problem:  # the one world asked for cannot run here: bad input, before any process starts
            raise LoadError(problem)
    except ClipcheckInputError as exc:
        print_error(exc)
        return EXIT_USAGE
    status = EXIT_PASS
    records = ResultsFile(args.json) if args.json else None
    try:  # each report's record names the backend its world resolved (FuzzReport.backend)
        with RankPool(args.world, backend=args.backend, timeout_s=args.timeout) as pool:
            started = time.perf_counter()
            pool.start()  # apart from the examples: their rate is what a longer search gets
            print(f"clipcheck fuzz: a world of {args.world} rank(s) started in {time.perf_counter() - started:.1f} s",
                  flush=True)
            for t in targets:
                report = fuzz(t, pool, args.examples, seed=args.seed, shrink=not args.no_shrink, plans=args.plans)
                status = worst(status, target_status(report))
                print(report.describe(), flush=True)
                if records is not None:  # as each target finishes: an interrupted run keeps what it found
                    records.write(report.record())
    finally:
        if records is not None:
            records.close()
    return report_problems([records.problem() if records is not None else None], status, sys.stderr)


def target_status(report: FuzzReport) -> int:
    """A target's share of the exit status: a crash, a failure, no example run at all, or a pass."""
    if not report.passed:
        return EXIT_BROKEN if report.crash else EXIT_FAIL
    return EXIT_PASS if report.examples else EXIT_NOTHING_JUDGED
