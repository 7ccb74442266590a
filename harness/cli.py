"""``python -m harness``: run cases on every rank of a torchrun job and report on rank 0.

    torchrun --nproc_per_node=4 -m harness --scenario xorl_ep_lora
    torchrun --nproc_per_node=4 -m harness --matrix matrix/default.toml --junit junit.xml
    python -m harness --list
    python -m harness matrix ...          # every world size, one torchrun each, merged (see launch.py)
    python -m harness fuzz --target T     # hypothesis over drawn layouts on a warm world (see fuzz.py)
    python -m harness --replay BLOB       # one case from a fuzz failure, on the world it needs
    python -m harness compat R.jsonl      # the real frameworks' verdicts as a markdown table

Exit status: 0 all cases pass, 1 some case or metamorphic group fails, 2 bad input (reported before
any process group is created), 3 a rank hung or died.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

import torch

from .case import CaseSpec, parse_norm_type
from .junit import write_junit
from .layout import LayoutError
from .loading import LoadError
from .matrix import MatrixSpec, load_matrix
from .metamorphic import metamorphic_groups
from .plan import Plan, UsageError, plan_cases
from .progress import Progress
from .registry import builtin_scenarios, registered_targets
from .report import Reporter
from .runner import run_case
from .world import DeadRankError, DistWorld, default_backend


def _csv(cast):
    def parse(text: str):
        try:
            return tuple(cast(part.strip()) for part in text.split(",") if part.strip())
        except (ValueError, LayoutError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def add_selection_options(p: argparse.ArgumentParser) -> None:
    """What to run: the matrix axes. Shared by the run command and the multi-world launcher."""
    p.add_argument("--matrix", metavar="PATH", default=None, help="matrix file (TOML or JSON); flags override it")
    p.add_argument("--scenario", type=_csv(str), default=None,
                   help="scenario name(s), comma separated, or module:Class / file.py:Class (default: all)")
    p.add_argument("--target", "--targets", dest="target", type=_csv(str), default=None,
                   help="target name(s) or module:function / file.py:function (default: the scenario's)")
    p.add_argument("--ep-size", type=_csv(int), default=None,
                   help="expert-parallel size(s), comma separated (default: every valid size)")
    p.add_argument("--norm-type", type=_csv(parse_norm_type), default=None,
                   help="norm type(s): 2, 1, inf, ... (default: the scenario's)")
    p.add_argument("--dtype", type=_csv(str), default=None, help="gradient dtype(s): fp32 (default), bf16, fp16, fp64")
    p.add_argument("--max-norm", type=float, default=None,
                   help="clip bound (default 0.5: below the true norm of every built-in case, so clipping is on)")
    p.add_argument("--seed", type=int, default=None, help="seed of the gradient values (default 0)")
    p.add_argument("--variant", default=None, help="run only layout variants whose label contains this text")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a collective may block before the case fails (default 60)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m harness",
        description="Check that a gradient-norm clip counts every logical gradient exactly once "
        "across EP / FSDP / TP / DP ranks. Run under torchrun; rank 0 reports. "
        "Subcommands: 'matrix' (every world size), 'fuzz' (hypothesis); see --help of each.",
    )
    p.add_argument("--list", action="store_true", help="list scenarios and targets, then exit")
    p.add_argument("--replay", metavar="BLOB", default=None, help="run the one case a fuzz failure printed")
    add_selection_options(p)
    p.add_argument("--json", metavar="PATH", default=None, help="write JSON Lines results, one per case as it ends")
    p.add_argument("--junit", metavar="PATH", default=None, help="write JUnit XML at the end")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="process group backend (default: nccl with CUDA, else gloo)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    p.add_argument("--verbose", action="store_true", help="print the measured placement of every parameter")
    return p


def spec_from_args(args: argparse.Namespace) -> MatrixSpec:
    base = load_matrix(args.matrix) if args.matrix else MatrixSpec()
    return base.merged({
        "scenarios": args.scenario,
        "targets": args.target,
        "ep_sizes": args.ep_size,
        "norm_types": args.norm_type,
        "dtypes": args.dtype,
        "max_norm": args.max_norm,
        "seed": args.seed,
        "variant": args.variant,
    })


def print_listing() -> None:
    print("scenarios:")
    for name, scenario in builtin_scenarios().items():
        print(f"  {name:<18} {scenario.summary}")
        print(f"  {'':<18} default targets: {', '.join(scenario.default_targets)}")
    print("targets:")
    for name, target in registered_targets().items():
        print(f"  {name:<28} {target.summary} [{target.origin}]")
    print("  module:function | path/to/file.py:function   your own clip: fn(model, *, max_norm, norm_type)")


def quiet_torch_warnings() -> None:
    # DTensor warns on every multi-dim norm reduction; it is noise for this tool
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "matrix":
        from .launch import main as matrix_main

        return matrix_main(argv[1:])
    if argv and argv[0] == "compat":
        from .compat import main as compat_main

        return compat_main(argv[1:])
    if argv and argv[0] == "fuzz":
        from .fuzz import main as fuzz_main

        return fuzz_main(argv[1:])
    return run_main(argv)


def run_main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        print_listing()
        return 0
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))

    def fail(message: str, status: int) -> int:
        if rank == 0:
            print(f"clipcheck: error: {message}", file=sys.stderr, flush=True)
        return status

    backend = args.backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        return fail("--backend nccl needs CUDA, and none is available here", 2)
    if not args.timeout > 0:
        return fail("--timeout must be positive", 2)
    try:
        if args.replay:
            from .replay import replay_on_pool, replay_plan

            if "WORLD_SIZE" not in os.environ:  # no launcher: start the world the case needs
                return replay_on_pool(args.replay, args.backend, args.timeout, args.json, args.verbose)
            plan = replay_plan(args.replay, world_size)
        else:
            plan = plan_cases(spec_from_args(args), world_size, backend)
    except (UsageError, LayoutError, LoadError) as exc:
        return fail(str(exc), 2)
    return execute(plan, args, backend, rank, world_size)


def execute(plan: Plan, args: argparse.Namespace, backend: str, rank: int, world_size: int) -> int:
    """Run every planned case on this rank; rank 0 reports. Returns the exit status."""
    quiet_torch_warnings()
    world = DistWorld(backend, args.timeout)
    frameworks = {name: t.framework_version() for name, t in plan.targets.items()} if rank == 0 else {}
    reporter = Reporter(sys.stdout, args.json, world_size, backend, args.verbose, frameworks) if rank == 0 else None
    progress = Progress(len(plan.cases), enabled=bool(rank == 0 and (
        args.progress if args.progress is not None else sys.stderr.isatty())))
    try:
        if reporter:
            reporter.header(len(plan.cases), plan.notes + plan.drop_lines())
        results = []
        for case in plan.cases:
            result = run_case(world, case, plan.scenarios[case.scenario], plan.targets[case.target])
            if reporter and result is not None:
                progress.clear()
                reporter.case(result)
                results.append(result)
            progress.advance(_short(case))
        progress.finish()
        ok = True
        if reporter:
            groups = metamorphic_groups(results)
            reporter.metamorphic(groups)
            ok = reporter.summary(results, groups)
            if args.junit:
                write_junit(args.junit, reporter.records)
    except DeadRankError as exc:
        print(f"clipcheck: rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 3
    finally:
        if reporter:
            reporter.close()
    world.close()
    return 0 if ok else 1


def _short(case: CaseSpec) -> str:
    return f"{case.scenario} {case.target}"


def main_entry() -> None:
    """Console-script entry point (``clipcheck ...``), same as ``python -m harness``."""
    sys.exit(main())
