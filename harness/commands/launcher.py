"""``clipcheck run --nproc N [selection]``: launch the N ranks ourselves and return *our* exit status.

    clipcheck run --nproc 4 --scenario xorl_ep_lora --json results.jsonl

What it adds over ``torchrun --nproc_per_node=N -m harness``:

* the plan is made here first, so bad input is one line and exit status 2 before any process starts;
* torchrun's elastic agent runs in this process (``torch.distributed.launcher.api``), so only our
  output is printed, and each rank's own exit code is known (torchrun itself exits 1 for anything);
* a rank that dies (a signal, ``os._exit``, gloo aborting on a mismatched collective) fails only the
  case it was running: that case is recorded as an ERROR naming the rank and how it died, and the
  launch is resumed at the next case (``--start-at``), at most ``--max-resumes`` times; a hung rank
  is recorded by rank 0 itself (see ``execute``) and the launch resumes the same way;
* on CPU/gloo the ranks are forked from this process after it has planned and imported the plan's
  frameworks, so they do not repeat either (``forked``; ``--spawn-ranks`` starts fresh interpreters);
* the JSON Lines file is rewritten at the end with every planned case exactly once, then the
  metamorphic groups and one summary; JUnit is written from the same records.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from harness.cases.variant import CaseSpec
from harness.judge.checks import unjudged_result
from harness.commands.forked import fork_problem, forked_rank
from harness.commands.options import add_selection_options, add_spawn_ranks_option, spec_from_args, unwritable
from harness.errors import ClipcheckInputError
from harness.report.junit import write_junit
from harness.judge.metamorphic import metamorphic_groups
from harness.cases.plan import Plan, plan_cases
from harness.judge.records import CaseRecord, Record, case_records, read_records
from harness.report.reporter import case_json, metamorphic_json
from harness.judge.verdicts import EXIT_BROKEN, EXIT_USAGE, count, is_unjudged
from harness.run.startup import preload_frameworks
from harness.run.world import default_backend

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig

MAX_RESUMES = 8


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clipcheck run", allow_abbrev=False,
                                description="Launch N ranks on this machine and run the selected cases.")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to launch (the world size; with --from-audit, the audit's by default)")
    p.add_argument("--from-audit", metavar="PATH", default=None,
                   help="replay the layout harness.audit measured (report.save(PATH)) against --target")
    add_selection_options(p)
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="process group backend (default: nccl with CUDA, else gloo)")
    p.add_argument("--json", metavar="PATH", default=None, help="write JSON Lines results (one line per case)")
    p.add_argument("--junit", metavar="PATH", default=None, help="write JUnit XML at the end")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    p.add_argument("--verbose", action="store_true", help="print the measured placement of every parameter")
    add_spawn_ranks_option(p)
    p.add_argument("--max-resumes", type=int, default=MAX_RESUMES,
                   help=f"relaunches after a rank died or hung (default {MAX_RESUMES})")
    return p


@dataclass
class RankExit:
    """How one rank of a launch ended: its exit code (negative: killed by that signal)."""

    rank: int
    exitcode: int
    signal: str | None = None
    cause: str | None = None  # the exception that ended it, when the rank raised one

    def describe(self) -> str:
        how = f"was killed by {self.signal}" if self.signal else f"exited with code {self.exitcode}"
        return f"rank {self.rank} {how}" + (f" ({self.cause})" if self.cause else "")


def raised_in_rank(error_file_data: dict[str, Any]) -> str | None:
    """The first line of the exception a rank raised, from the error file torchelastic's ``record``
    wrote for it (``message``: a dict with its own ``message``, or text; ``<NONE>`` without a file,
    as after a signal): a rank that raises outside a case (a start-up exchange that timed out) is
    otherwise reported as a bare exit code, its traceback left in a temporary file."""
    message = error_file_data.get("message")
    text = message.get("message") if isinstance(message, dict) else message
    if not isinstance(text, str) or not text.strip() or text.strip() == "<NONE>":
        return None
    return text.strip().splitlines()[0][:300]


def launch_ranks(nproc: int, worker_args: list[str], forked_plan: Plan | None = None) -> list[RankExit]:
    """Run ``python -m harness <worker_args>`` on ``nproc`` local ranks under torchrun's elastic agent
    (in this process); every rank's exit, or [] when all exited 0. With ``forked_plan`` (the plan of
    these very arguments) the ranks are forked from this process and start from it (``forked``).
    SIGINT/SIGTERM to this process stop the ranks (the agent forwards them) before they propagate here."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = launch_config(nproc)
    try:
        if forked_plan is not None:
            elastic_launch(config, forked_rank)(forked_plan, worker_args)
        else:
            elastic_launch(config, sys.executable)("-m", "harness", *worker_args)
    except ChildFailedError as exc:
        return rank_exits(exc)
    return []


def launch_config(nproc: int) -> LaunchConfig:
    """One node, ``nproc`` ranks, a fresh rendezvous on a free port, no restarts (the launcher
    resumes itself after a crash, at the next case)."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                        monitor_interval=0.1, start_method="fork")  # used by a function entry point only


def rank_exits(failed: ChildFailedError) -> list[RankExit]:
    """How each failed rank of an elastic launch ended (``failed``: its ChildFailedError)."""
    exits = []
    for rank, failure in sorted(failed.failures.items()):
        code = int(failure.exitcode)
        exits.append(RankExit(rank, code, failure.signal_name() if code < 0 else None,
                              raised_in_rank(failure.error_file_data)))
    return exits


def worker_args(args: argparse.Namespace, spec_path: str, jsonl: str, start_at: int, backend: str) -> list[str]:
    """What every rank is told: the serialized spec, not the user's argv (no flag surgery)."""
    out = ["--backend", backend, "--timeout", str(args.timeout), "--json", jsonl, "--start-at", str(start_at)]
    if getattr(args, "from_audit", None):  # the case is the file's, the target the command line's
        out += ["--from-audit", args.from_audit, "--target", ",".join(args.targets or ())]
        out += ["--max-norm", str(args.max_norm)] if args.max_norm is not None else []
    else:
        out += ["--matrix", spec_path]
    if args.verbose:
        out.append("--verbose")
    out += ["--blame", args.blame]
    if args.progress is not None:
        out.append("--progress" if args.progress else "--no-progress")
    return out


def _case_records(path: Path) -> dict[int, CaseRecord]:
    if not path.exists():
        return {}
    return {r["index"]: r for r in case_records(read_records(str(path)))}


def _crash_detail(exits: list[RankExit], index: int) -> str:
    # the root cause first: a rank that exited on its own or died of its own signal; the launcher
    # stops the others with SIGTERM, then SIGKILL
    died = ([e for e in exits if e.exitcode > 0 and e.exitcode not in (1, 3)]
            or [e for e in exits if e.exitcode < 0 and e.signal not in ("SIGTERM", "SIGKILL")] or exits)
    return (f"{'; '.join(e.describe() for e in died)} while case {index} ran; the launch was resumed at "
            "the next case")


def run_plan(plan: Plan, args: argparse.Namespace, backend: str, spec_path: str, jsonl: Path,
             nproc: int) -> tuple[dict[int, CaseRecord], int, int]:
    """Launch, and relaunch after each crash, until every planned case has a record. Returns the
    records by case index, the number of resumes, and 2 if a rank reported bad input (else 0)."""
    by_index: dict[int, CaseSpec] = {c.index: c for c in plan.cases}
    order = [c.index for c in plan.cases]
    records: dict[int, CaseRecord] = {}
    start, resumes = 0, 0
    forked_plan = None if fork_problem(backend, args.spawn_ranks) else plan
    if forked_plan is not None:
        preload_frameworks(plan)
    while True:
        jsonl.unlink(missing_ok=True)
        exits = launch_ranks(nproc, worker_args(args, spec_path, str(jsonl), start, backend), forked_plan)
        found = _case_records(jsonl)
        if any(e.exitcode == EXIT_USAGE for e in exits) and not found:
            return records, resumes, EXIT_USAGE
        pending = [i for i in order if i >= start]
        recorded = [i for i in pending if i in found and not _not_run(found[i])]
        records.update({i: found[i] for i in recorded})
        if len(recorded) == len(pending):
            return records, resumes, 0
        if recorded and is_unjudged(found[recorded[-1]]):
            broken = recorded[-1]  # rank 0 recorded the hang or the stop itself
            if exits and "crash" in records[broken]["checks"]:
                records[broken]["checks"]["crash"]["detail"] = _crash_detail(exits, broken)
        else:  # died without a word from rank 0: we know who died, and how
            broken = next(i for i in pending if i not in recorded)
            detail = _crash_detail(exits, broken) if exits else "the launch ended before this case"
            records[broken] = case_json(unjudged_result(by_index[broken], "crash", detail, nproc), nproc, backend)
        rest = [i for i in pending if i > broken or (i not in records)]
        later = [i for i in rest if i != broken]
        if not later:
            return records, resumes, 0
        if resumes >= args.max_resumes:
            for i in later:
                records[i] = case_json(unjudged_result(
                    by_index[i], "not_run", f"not run: {resumes} relaunches after crashes, the limit", nproc),
                    nproc, backend)
            return records, resumes, 0
        resumes += 1
        start = later[0]
        what = next(iter(records[broken]['checks']))
        print(f"clipcheck run: case {broken} did not finish ({what}); "
              f"relaunching at case {start}", file=sys.stderr, flush=True)


def _not_run(record: CaseRecord) -> bool:
    return "not_run" in record["checks"]


def write_results(records: list[CaseRecord], backend: str, jsonl: Path | None, junit: str | None) -> int:
    groups = [metamorphic_json(g, backend) for g in metamorphic_groups(records)]
    counts = count([*records, *groups])
    everything: list[Record] = [*records, *groups, counts.as_record()]
    if jsonl is not None:
        with open(jsonl, "w", encoding="utf-8") as f:
            for rec in everything:
                f.write(json.dumps(rec) + "\n")
    if junit:
        write_junit(junit, everything)
    return counts.status


def main(argv: Sequence[str], plan: Plan | None = None) -> int:
    """``clipcheck run``. ``plan``: the plan of these very arguments, made by a ``clipcheck matrix``
    that forked this launcher (``forked.ForkedProcess``); made here otherwise."""
    args = build_parser().parse_args(argv)
    backend = args.backend or default_backend()
    try:
        if args.from_audit:
            from harness.commands.replay import audit_plan

            if backend != "gloo":
                raise ClipcheckInputError("--from-audit replays on CPU ranks: backend gloo")
            plan, saved = audit_plan(args.from_audit, args.targets, args.nproc, args.max_norm)
            args.nproc = saved.world_size
        if args.nproc is None:
            raise ClipcheckInputError("--nproc is required (the number of ranks to launch)")
        if args.nproc < 1:
            raise ClipcheckInputError("--nproc must be positive")
        for flag, path in (("--json", args.json), ("--junit", args.junit)):
            problem = unwritable(path)
            if problem:
                raise ClipcheckInputError(f"{flag} {path}: {problem}")
        spec = spec_from_args(args)
        plan = plan if plan is not None else plan_cases(spec, args.nproc, backend)
    except ClipcheckInputError as exc:
        print(f"clipcheck: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    with tempfile.TemporaryDirectory(prefix="clipcheck-run-") as tmp:
        spec_path = os.path.join(tmp, "matrix.json")
        Path(spec_path).write_text(json.dumps(spec.to_mapping()))
        jsonl = Path(args.json) if args.json else Path(tmp) / "results.jsonl"
        records, resumes, usage = run_plan(plan, args, backend, spec_path, jsonl, args.nproc)
        if usage:
            return usage
        ordered = [records[c.index] for c in plan.cases if c.index in records]
        status = write_results(ordered, backend, Path(args.json) if args.json else None, args.junit)
    if resumes or any(is_unjudged(r) for r in ordered):
        print(f"clipcheck run: {resumes} relaunch(es); summary over every planned case: "
              f"{count(ordered).line()}", flush=True)
    return max(status, EXIT_BROKEN if any(is_unjudged(r) for r in ordered) else 0)
