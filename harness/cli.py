"""``python -m harness``: run the cases on every rank of a torchrun job and report on rank 0.

    torchrun --nproc_per_node=4 -m harness --scenario xorl_ep_lora
    python -m harness --list

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

from .case import parse_norm_type
from .layout import LayoutError
from .metamorphic import metamorphic_groups
from .plan import Request, UsageError, plan_cases
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m harness",
        description="Check that a gradient-norm clip counts every logical gradient exactly once "
        "across EP / FSDP / TP / DP ranks. Run under torchrun; rank 0 reports.",
    )
    p.add_argument("--list", action="store_true", help="list scenarios and targets, then exit")
    p.add_argument("--scenario", type=_csv(str), default=(),
                   help="scenario name(s), comma separated, or module:Class / file.py:Class (default: all)")
    p.add_argument("--target", type=_csv(str), default=(),
                   help="target name(s) or module:function / file.py:function (default: the scenario's)")
    p.add_argument("--ep-size", type=_csv(int), default=None,
                   help="expert-parallel size(s), comma separated (default: every valid size)")
    p.add_argument("--norm-type", type=_csv(parse_norm_type), default=(),
                   help="norm type(s): 2, 1, inf, ... (default: the scenario's)")
    p.add_argument("--dtype", type=_csv(str), default=("fp32",), help="gradient dtype(s): fp32, bf16, fp16, fp64")
    p.add_argument("--max-norm", type=float, default=0.5,
                   help="clip bound (default 0.5: below the true norm of every built-in case, so clipping is on)")
    p.add_argument("--seed", type=int, default=0, help="seed of the gradient values")
    p.add_argument("--variant", default=None, help="run only layout variants whose label contains this text")
    p.add_argument("--json", metavar="PATH", default=None, help="write JSON Lines results, one per case as it ends")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="process group backend (default: nccl with CUDA, else gloo)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a collective may block before the case fails (default 60)")
    p.add_argument("--verbose", action="store_true", help="print the measured placement of every parameter")
    return p


def print_listing() -> None:
    print("scenarios:")
    for name, scenario in builtin_scenarios().items():
        print(f"  {name:<18} {scenario.summary}")
        print(f"  {'':<18} default targets: {', '.join(scenario.default_targets)}")
    print("targets:")
    for name, target in registered_targets().items():
        print(f"  {name:<26} {target.summary} [{target.origin}]")
    print("  module:function | path/to/file.py:function   your own clip: fn(model, *, max_norm, norm_type)")


def _request(args: argparse.Namespace) -> Request:
    return Request(
        scenarios=args.scenario,
        targets=args.target,
        ep_sizes=args.ep_size,
        norm_types=args.norm_type,
        dtypes=args.dtype,
        max_norm=args.max_norm,
        seed=args.seed,
        variant=args.variant,
    )


def _quiet_torch_warnings() -> None:
    # DTensor warns on every multi-dim norm reduction; it is noise for this tool
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def main(argv: Sequence[str] | None = None) -> int:
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
        plan = plan_cases(_request(args), world_size)
    except UsageError as exc:
        return fail(str(exc), 2)
    if not plan.cases:
        return fail("no cases to run", 2)

    _quiet_torch_warnings()
    world = DistWorld(backend, args.timeout)
    reporter = Reporter(sys.stdout, args.json, world_size, backend, args.verbose) if rank == 0 else None
    results = []
    try:
        if reporter:
            reporter.header(len(plan.cases), plan.notes)
        for case in plan.cases:
            result = run_case(world, case, plan.scenarios[case.scenario], plan.targets[case.target])
            if reporter and result is not None:
                reporter.case(result)
                results.append(result)
        ok = True
        if reporter:
            groups = metamorphic_groups(results)
            reporter.metamorphic(groups)
            ok = reporter.summary(results, groups)
    except DeadRankError as exc:
        print(f"clipcheck: rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 3
    finally:
        if reporter:
            reporter.close()
    world.close()
    return 0 if ok else 1


def main_entry() -> None:
    """Console-script entry point (``clipcheck ...``), same as ``python -m harness``."""
    sys.exit(main())
