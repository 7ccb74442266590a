"""``clipcheck`` (= ``python -m harness``): run cases on every rank of a launch, rank 0 reports.

    clipcheck run --nproc 4 --scenario xorl_ep_lora       # launches the 4 ranks itself (commands/launcher.py)
    torchrun --nproc_per_node=4 -m harness --scenario xorl_ep_lora --junit junit.xml
    clipcheck --list
    clipcheck matrix ...          # every world size, one launch each, merged (commands/matrix.py)
    clipcheck fuzz --target T     # hypothesis over drawn layouts on a warm world (commands/fuzz.py)
    clipcheck --replay BLOB       # one case from a fuzz failure, on the world it needs
    clipcheck compat R.jsonl      # the real frameworks' verdicts as a markdown table

Exit status (``verdicts``): 0 all cases pass, 1 some case or metamorphic group fails, 2 bad input
(reported before any process group is created; an error on one rank only is printed with its rank),
3 a rank hung or died, or a planned case was not judged, 4 nothing was judged, 5 a results file
could not be written, 130 interrupted. Every rank exits with rank 0's status (a job on several nodes
then ends alike on each). Under plain torchrun torchrun itself exits 1 for any of them; ``clipcheck
run`` returns them as they are.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence


from harness.run.world.startup import settle_startup, share_the_cores
from harness.run.world.devices import world_problem
from harness.plan.project import timeout_problem
from harness.errors import ClipcheckInputError
from harness.run.hosts.launch import Executor
from harness.commands.options import DEFAULT_TIMEOUT_S, add_selection_options, print_error, quiet_torch_warnings, \
    resolve_timeout, results_files_problem, spec_from_args
from harness.plan.project import project_defaults
from harness.plan.planner import Plan, plan_cases
from harness.report.progress import Progress
from harness.targets.registry import builtin_scenarios, registered_targets
from harness.report.reporter import Reporter
from harness.judge.verdicts import EXIT_BROKEN, EXIT_USAGE
from harness.run.world.dist_world import DistWorld, default_backend


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clipcheck", allow_abbrev=False,
        description="Check that a gradient-norm clip counts every logical gradient exactly once "
        "across EP / FSDP / TP / DP ranks. Run under torchrun; rank 0 reports. "
        "Subcommands: 'run' (launch N ranks), 'matrix' (every world size), 'fuzz' (hypothesis), "
        "'compat' (the frameworks' table); see --help of each.",
    )
    p.add_argument("--list", action="store_true", help="list scenarios and targets, then exit")
    p.add_argument("--replay", metavar="BLOB", default=None,
                   help="run the one case a fuzz failure printed; a blob whose target is not built in runs only "
                        "with --target naming that same target")
    p.add_argument("--from-audit", metavar="PATH", default=None,
                   help="replay the layout harness.audit measured on a real job (report.save(PATH)) against "
                        "--target, on CPU ranks")
    p.add_argument("--start-at", type=int, default=0, metavar="INDEX",
                   help="run only the planned cases from this index on (a launcher resuming after a crash)")
    add_selection_options(p)
    p.add_argument("--json", metavar="PATH", default=None, help="write JSON Lines results, one per case as it ends")
    p.add_argument("--junit", metavar="PATH", default=None, help="write JUnit XML at the end")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="process group backend (default: nccl with CUDA, else gloo)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    p.add_argument("--verbose", action="store_true", help="print the measured placement of every parameter")
    return p


def print_listing() -> None:
    print("scenarios:")
    for name, scenario in builtin_scenarios().items():
        print(f"  {name:<18} {scenario.summary}")
        print(f"  {'':<18} default targets: {', '.join(scenario.default_targets)}")
    print("targets:")
    for name, target in registered_targets().items():
        print(f"  {name:<28} {target.summary} [{target.origin}]")
    print("  module:function | path/to/file.py:function   your own clip: fn(model, *, max_norm, norm_type)")


def _distinct_errors(errors: Sequence[str | None]) -> list[str]:
    """One line per distinct error; a message some ranks do not share names its ranks."""
    by_message: dict[str, list[int]] = {}
    for r, e in enumerate(errors):
        if e is not None:
            by_message.setdefault(e, []).append(r)
    if len(by_message) == 1 and len(next(iter(by_message.values()))) == len(errors):
        return list(by_message)
    return [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {message}"
            for message, ranks in by_message.items()]


def run_main(argv: Sequence[str], plan: Plan | None = None) -> int:
    """One rank's run. ``plan``: the launcher's own plan of these very arguments, handed to a rank
    it forked (``commands.forked``); a rank started fresh makes it itself."""
    args = build_parser().parse_args(argv)
    if args.list:
        print_listing()
        return 0
    return _run_rank(args, plan)


def _run_rank(args: argparse.Namespace, plan: Plan | None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    backend = args.backend or default_backend()
    error = None
    try:
        project = project_defaults()
        resolve_timeout(args, project)
        error = usage_problem(args, backend, world_size, rank)
        if error is None and args.from_audit:
            from harness.commands.replay import audit_on_pool, audit_plan

            if "WORLD_SIZE" not in os.environ:  # no launcher: start the world the audit ran on
                return audit_on_pool(args.from_audit, args.targets, args.backend, args.timeout, args.json,
                                     args.verbose, args.max_norm)
            plan = audit_plan(args.from_audit, args.targets, world_size, args.max_norm)[0]
        elif error is None and args.replay:
            from harness.commands.replay import replay_on_pool, replay_plan

            if "WORLD_SIZE" not in os.environ:  # no launcher: start the world the case needs
                return replay_on_pool(args.replay, args.backend, args.timeout, args.json, args.verbose,
                                      args.targets or ())
            plan = replay_plan(args.replay, world_size, args.targets or ())
        elif error is None and plan is None:
            plan = plan_cases(spec_from_args(args, project, project_keys_off=("worlds",)), world_size, backend)
    except ClipcheckInputError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - user code imported while planning may raise anything
        error = f"planning failed: {type(exc).__name__}: {exc}"
    # every rank planned on its own: agree through the store before any process group exists, so an
    # error on one rank only (its import of the target failed) is reported, with its rank, by rank 0
    agree = world_size > 1 and "MASTER_ADDR" in os.environ
    # a timeout that is itself the error cannot time the exchange that reports it
    timeout = DEFAULT_TIMEOUT_S if timeout_problem(args.timeout) else args.timeout
    world = DistWorld(backend, timeout, start=False) if agree or error is None else None
    errors = [error] if world is None else [
        s["error"] for s in world.allgather_json("startup", {"error": error}, world.timeout_s + 60)]
    if any(e is not None for e in errors):
        if rank == 0:
            for line in _distinct_errors(errors):
                print_error(line)
            if world is not None:
                world.signal_ended()
        elif world is not None:  # the launcher stops every rank once one exits: rank 0 prints first
            world.wait_ended()
        return EXIT_USAGE
    assert plan is not None and world is not None
    share_the_cores(_local_world_size())
    settle_startup(plan)
    world.start()
    return execute(world, plan, args, backend, rank, world_size)


def usage_problem(args: argparse.Namespace, backend: str, world_size: int, rank: int = 0) -> str | None:
    """Bad input the parser cannot see, as one line; None when there is none. A world this machine
    cannot run (nccl without CUDA, fewer GPUs than ranks, more ranks than its cores take) is bad input
    here: a single run was asked for exactly that world (the matrix and the plugin skip it instead).
    Only this machine's own ranks count (``LOCAL_WORLD_SIZE``: a job may span nodes)."""
    timeout = DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout  # None: not resolved yet
    problem = world_problem(_local_world_size(world_size), backend) or timeout_problem(timeout)
    if problem:
        return problem
    if args.from_audit and args.replay:
        return "--from-audit and --replay each name one case: give one"
    if args.from_audit and backend != "gloo":
        return "--from-audit replays on CPU ranks: backend gloo"
    if args.start_at < 0:
        return "--start-at must be 0 or more"
    # only rank 0 writes the results files; probing one path from every rank at once races (a rank's
    # probe file removed under another's: seen with forked ranks, which start together)
    return results_files_problem(args) if rank == 0 else None


def _local_world_size(world_size: int | None = None) -> int:
    """The ranks on this machine (torchrun's LOCAL_WORLD_SIZE; the world's without it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size or os.environ.get("WORLD_SIZE", "1")))


def execute(world: DistWorld, plan: Plan, args: argparse.Namespace, backend: str, rank: int, world_size: int) -> int:
    """Run every planned case on this rank; rank 0 reports. Returns the exit status, rank 0's on every
    rank (``DistWorld.leave_together``)."""
    quiet_torch_warnings()
    reporter = Reporter(sys.stdout, args.json, world_size, backend, args.verbose, plan.targets, args.junit,
                        append=args.start_at > 0) if rank == 0 else None
    progress = Progress(len(plan.cases), enabled=bool(rank == 0 and (
        args.progress if args.progress is not None else sys.stderr.isatty())))
    if reporter:
        header_notes = plan.header_lines()
        if args.start_at:
            header_notes.append(f"resuming at case {args.start_at}")
        reporter.header(len([c for c in plan.cases if c.index >= args.start_at]), header_notes)
    status = world.leave_together(Executor(world, plan, reporter, progress, args.start_at, blame=args.blame).run())
    if status != EXIT_BROKEN:
        world.close()
    return status
