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
* the JSON Lines file is written as each case ends (rank 0 writes a file of the launcher's own,
  which alone the launcher reads back; ``mirror`` copies it to ``--json``) and rewritten at the end
  with every planned case exactly once, then the metamorphic groups and one summary; JUnit is
  written from the same records. A second run on the same ``--json`` is refused (``exclusive``);
* the rendezvous stores listen on 127.0.0.1 only (``rendezvous``);
* SIGINT / SIGTERM stop the ranks (rank 0 records the case in flight as ``interrupted``), the
  results are written with the summary, and the launcher exits 130 / 143;
* ranks die with the launcher, spawned or forked, and so does whatever they started (``family``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Sequence

from harness.commands.exclusive import OutputClaim
from harness.commands.forked import fork_problem, forked_rank
from harness.commands.mirror import ResultsMirror
from harness.commands.options import add_selection_options, add_spawn_ranks_option, print_error, \
    resolve_timeout, results_files_problem, spec_from_args
from harness.plan.project import project_defaults
from harness.commands.rendezvous import launch_config
from harness.errors import ClipcheckInputError
from harness.judge.checks import unjudged_result
from harness.judge.records import CaseRecord, case_records, read_records
from harness.judge.verdicts import EXIT_BROKEN, EXIT_OUTPUT, EXIT_USAGE, is_unjudged, worst
from harness.report.finish import finish_run
from harness.report.reporter import case_json
from harness.run.world.devices import world_problem
from harness.run.guards.family import PARENT_PID_ENV, descendants, end_descendants
from harness.run.world.startup import preload_frameworks
from harness.run.world.openmp import name_rank_threads
from harness.run.case.guard import IN_PHASE, harness_phase_of
from harness.run.world.phase_marks import PHASE_DIR_ENV, phase_of
from harness.plan.project import timeout_problem
from harness.run.world.dist_world import default_backend
from harness.plan.planner import Plan, plan_cases

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

__all__ = ["main", "rank_exits", "RankExit"]

MAX_RESUMES = 8
RANK_STATUSES = (1, 2, 3, 4, 5, 128 + signal.SIGINT)
"""Exit codes a rank leaves with on purpose (``verdicts``): never the root cause of a crash."""


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
    phase: str | None = None  # the phase of the harness's own work it was in (``phase_marks``), if any

    def describe(self) -> str:
        how = f"was killed by {self.signal}" if self.signal else f"exited with code {self.exitcode}"
        where = f" {IN_PHASE.format(phase=self.phase)}" if self.phase else ""
        return f"rank {self.rank} {how}{where}" + (f" ({self.cause})" if self.cause else "")


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the launcher. Control flow, not an error: a BaseException (as
    pytest-xdist's ``Interrupted(KeyboardInterrupt)``, outside the ``ClipcheckError`` root as
    hypothesis's ``StopTest`` is), so an ``except Exception`` on its way (a framework import the
    launcher preloads, the elastic agent's own handlers) cannot swallow it and let the run go on."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, frame: Any) -> NoReturn:
    raise Interrupted(signum)


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


def launch_ranks(nproc: int, worker_args: list[str], forked_plan: Plan | None = None,
                 phase_dir: str | None = None) -> list[RankExit]:
    """Run ``python -m harness <worker_args>`` on ``nproc`` local ranks under torchrun's elastic agent
    (in this process); every rank's exit, or [] when all exited 0. With ``forked_plan`` (the plan of
    these very arguments) the ranks are forked from this process and start from it (``forked``).
    SIGINT/SIGTERM to this process stop the ranks (the agent passes them on) and raise Interrupted.
    What the ranks left behind (orphans this process adopted) is ended before it returns. ``phase_dir``: a
    fresh folder where the ranks mark the phase of the harness's own work they are in, read for those
    that failed (``RankExit.phase``)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    quiet_the_agent()
    name_rank_threads(os.environ)
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # a spawned rank dies with this process
    if phase_dir is not None:
        os.environ[PHASE_DIR_ENV] = phase_dir
    config = launch_config(nproc)
    ours = descendants()
    try:
        if forked_plan is not None:
            elastic_launch(config, forked_rank)(forked_plan, worker_args)
        else:
            elastic_launch(config, sys.executable)("-m", "harness", *worker_args)
    except ChildFailedError as exc:
        exits = rank_exits(exc)
        return exits if phase_dir is None else [replace(e, phase=phase_of(phase_dir, e.rank)) for e in exits]
    except SignalException as exc:
        raise Interrupted(int(exc.sigval)) from None
    finally:
        end_descendants(spare=ours)
        for signum in (signal.SIGINT, signal.SIGTERM):  # the agent left its own handlers installed
            signal.signal(signum, _raise_interrupted)
    return []


def quiet_the_agent() -> None:
    """Only our output: torch's elastic agent and process helpers log each step ("Received 2 death
    signal, shutting down workers", "Terminating process ..."), and their module loggers carry a level
    of their own, so each is set (they are imported by now)."""
    noisy = ("torch.distributed.elastic", "torch.multiprocessing")
    for name in [*noisy, *logging.root.manager.loggerDict]:
        if name.startswith(noisy):
            logging.getLogger(name).setLevel(logging.CRITICAL)


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


def _crash_detail(exits: list[RankExit], index: int) -> str:
    # the root cause first: a rank that exited on its own or died of its own signal; the launcher
    # stops the others with SIGTERM, then SIGKILL
    died = ([e for e in exits if e.exitcode > 0 and e.exitcode not in RANK_STATUSES]
            or [e for e in exits if e.exitcode < 0 and e.signal not in ("SIGTERM", "SIGKILL")] or exits)
    return (f"{'; '.join(e.describe() for e in died)} while case {index} ran; the launch was resumed at "
            "the next case")


@dataclass(frozen=True)
class PhaseBreak:
    """A launch that ended in a phase of the harness's own work: the case, how (``hang``, ``crash``), the phase."""

    case: int
    how: str
    phase: str

    def again(self, later: "PhaseBreak") -> str | None:
        """Why the rest is not run when ``later``, the next launch, broke in the same phase; None when not."""
        if later.phase != self.phase:
            return None
        verbs = {"hang": "hung", "crash": "died"}
        how = verbs[self.how] if self.how == later.how else "hung or died"
        return (f"not run: the ranks {how} {IN_PHASE.format(phase=self.phase)} again (case {self.case}, then case "
                f"{later.case}): a relaunch would break there too")


def _not_run(record: CaseRecord) -> bool:
    return "not_run" in record["checks"]


@dataclass
class LaunchFile:
    """What rank 0 wrote in one launch attempt: its case records by index, and the case it had
    started and not recorded (its in-flight marker), if any."""

    records: dict[int, CaseRecord] = field(default_factory=dict)
    in_flight: int | None = None

    @classmethod
    def read(cls, path: Path) -> "LaunchFile":
        if not path.exists():
            return cls()
        read = read_records(str(path))
        cases = {r["index"]: r for r in case_records(read)}
        markers = [r.get("index") for r in read if r.get("type") == "in_flight"]
        in_flight = markers[-1] if markers and markers[-1] not in cases else None
        return cls(cases, in_flight if isinstance(in_flight, int) else None)


@dataclass
class Launches:
    """A plan run to the end: launched, and relaunched after each crash or stop, until every planned
    case has a record (``records``), or the launcher is interrupted (``interrupted``)."""

    plan: Plan
    args: argparse.Namespace
    backend: str
    spec_path: str
    folder: Path
    records: dict[int, CaseRecord] = field(default_factory=dict)
    resumes: int = 0
    start: int = 0
    attempt: int = 0
    interrupted: int | None = None
    last_break: PhaseBreak | None = None
    """Where the last launch broke, if it broke in a phase of the harness's own work."""

    def run(self, mirror: ResultsMirror | None) -> int:
        """0, or EXIT_USAGE if a rank reported bad input, or EXIT_OUTPUT if rank 0 could not write."""
        forked_plan = None if fork_problem(self.backend, self.args.spawn_ranks) else self.plan
        if forked_plan is not None:
            preload_frameworks(self.plan)
        while True:
            self.attempt += 1
            path = self.folder / f"launch{self.attempt}.jsonl"
            if mirror is not None:
                mirror.follow(path)
            phases = self.folder / f"phases{self.attempt}"
            phases.mkdir()
            try:
                exits = launch_ranks(self.args.nproc, worker_args(self.args, self.spec_path, str(path), self.start,
                                                                  self.backend), forked_plan, str(phases))
            except Interrupted as exc:
                self.interrupted = exc.signum
                self._settle(LaunchFile.read(path))
                return 0
            found = LaunchFile.read(path)
            if any(e.exitcode == EXIT_USAGE for e in exits) and not found.records:
                return EXIT_USAGE
            rest = self._settle(found)
            if not rest:
                return 0
            if any(e.exitcode == EXIT_OUTPUT for e in exits):
                self._not_run(rest, "not run: rank 0 could not write its records")
                return EXIT_OUTPUT
            why = self._why_it_ended(found, exits, rest[0])
            rest = [i for i in rest if i not in self.records]
            if not rest:
                return 0
            before, self.last_break = self.last_break, self._phase_break()
            again = before.again(self.last_break) if before is not None and self.last_break is not None else None
            if again is not None:
                self._not_run(rest, again)
                return 0
            if self.resumes >= self.args.max_resumes:
                self._not_run(rest, f"not run: {self.resumes} relaunches after crashes, the limit")
                return 0
            self.resumes += 1
            self.start = rest[0]
            print(f"clipcheck run: {why}; relaunching at case {self.start}", file=sys.stderr, flush=True)

    def _settle(self, found: LaunchFile) -> list[int]:
        """Keep what this launch judged (or recorded as not judged); the planned indices left."""
        pending = [c.index for c in self.plan.cases if c.index >= self.start and c.index not in self.records]
        self.records.update({i: found.records[i] for i in pending if i in found.records
                             and not _not_run(found.records[i])})
        return [i for i in pending if i not in self.records]

    def _why_it_ended(self, found: LaunchFile, exits: list[RankExit], first_missing: int) -> str:
        """Record the case the launch broke in, if it broke in one; say why it ended."""
        judged = [i for i in sorted(found.records) if i in self.records and i >= self.start]
        if judged and is_unjudged(self.records[judged[-1]]):  # rank 0 recorded the hang or the stop itself
            broken = judged[-1]
            if exits and "crash" in self.records[broken]["checks"]:
                self.records[broken]["checks"]["crash"]["detail"] = _crash_detail(exits, broken)
        elif found.in_flight is None and first_missing in found.records:  # rank 0 stopped it between cases
            return next(iter(found.records[first_missing]["checks"].values()))["detail"].removeprefix("not run: ")
        else:  # died without a word from rank 0 (in the case it marked as started): we know who died, and how
            broken = found.in_flight if found.in_flight is not None else first_missing
            detail = _crash_detail(exits, broken) if exits else "the launch ended before this case"
            self.records[broken] = self._unjudged(broken, "crash", detail)
        return f"case {broken} did not finish ({next(iter(self.records[broken]['checks']))})"

    def _phase_break(self) -> PhaseBreak | None:
        """Where this launch ended, if it ended in a phase of the harness's own work (a hang or a death
        whose detail names the phase: ``guard.harness_phase_of``); None otherwise (the target hung or
        killed its rank, the world was stopped)."""
        ended = [i for i in sorted(self.records) if i >= self.start and is_unjudged(self.records[i])
                 and not _not_run(self.records[i])]
        checks = self.records[ended[-1]]["checks"] if ended else {}
        for how in ("hang", "crash"):
            phase = harness_phase_of(checks[how]["detail"]) if how in checks else None
            if phase is not None:
                return PhaseBreak(ended[-1], how, phase)
        return None

    def _unjudged(self, index: int, check: str, detail: str) -> CaseRecord:
        case = next(c for c in self.plan.cases if c.index == index)
        return case_json(unjudged_result(case, check, detail, self.args.nproc), self.args.nproc, self.backend)

    def _not_run(self, indices: list[int], detail: str) -> None:
        for i in indices:
            self.records[i] = self._unjudged(i, "not_run", detail)

    def record_interruption(self) -> None:
        """The case in flight when the launcher was interrupted (the one rank 0 recorded as stopped,
        else the first without a record), and every later one, as not judged."""
        assert self.interrupted is not None
        name = signal.Signals(self.interrupted).name
        stopped = [i for i, r in self.records.items()
                   if i >= self.start and is_unjudged(r) and {"crash", "interrupted"} & set(r["checks"])]
        missing = [c.index for c in self.plan.cases if c.index not in self.records]
        in_flight = stopped[-1] if stopped else (missing[0] if missing else None)
        if in_flight is None:
            return
        self.records[in_flight] = self._unjudged(in_flight, "interrupted",
                                                 f"the launch was interrupted by {name} while this case ran")
        self._not_run([i for i in missing if i != in_flight], f"not run: the launch was interrupted by {name}")

    def ordered(self) -> list[CaseRecord]:
        return [self.records[c.index] for c in self.plan.cases if c.index in self.records]



def _usage_problem(args: argparse.Namespace, backend: str) -> str | None:
    if args.nproc < 1:
        return "--nproc must be positive"
    return world_problem(args.nproc, backend) or timeout_problem(args.timeout) or results_files_problem(args)


def main(argv: Sequence[str], plan: Plan | None = None) -> int:
    """``clipcheck run``. ``plan``: the plan of these very arguments, made by a ``clipcheck matrix``
    that forked this launcher (``forked.ForkedProcess``); made here otherwise."""
    args = build_parser().parse_args(argv)
    backend = args.backend or default_backend()
    claims: list[OutputClaim] = []
    try:
        project = project_defaults()
        resolve_timeout(args, project)
        if args.from_audit:
            from harness.commands.replay import audit_plan

            if backend != "gloo":
                raise ClipcheckInputError("--from-audit replays on CPU ranks: backend gloo")
            plan, saved = audit_plan(args.from_audit, args.targets, args.nproc, args.max_norm)
            args.nproc = saved.world_size
        if args.nproc is None:
            raise ClipcheckInputError("--nproc is required (the number of ranks to launch)")
        problem = _usage_problem(args, backend)
        if problem:
            raise ClipcheckInputError(problem)
        spec = spec_from_args(args, project, project_keys_off=("worlds",))  # the world is --nproc
        plan = plan if plan is not None else plan_cases(spec, args.nproc, backend)
        claims = [OutputClaim(path, flag) for flag, path in (("--json", args.json), ("--junit", args.junit)) if path]
    except ClipcheckInputError as exc:
        print_error(exc)
        return EXIT_USAGE
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with tempfile.TemporaryDirectory(prefix="clipcheck-run-") as tmp:
            return _run(plan, spec.to_mapping(), args, backend, Path(tmp))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for claim in claims:
            claim.release()


def _run(plan: Plan, spec: dict[str, Any], args: argparse.Namespace, backend: str, folder: Path) -> int:
    spec_path = folder / "matrix.json"
    spec_path.write_text(json.dumps(spec))
    launches = Launches(plan, args, backend, str(spec_path), folder)
    mirror = ResultsMirror(args.json) if args.json else None
    try:
        status = launches.run(mirror)
    except Interrupted as exc:  # between launches: nothing of the ranks is left to stop
        launches.interrupted = exc.signum
        status = 0
    finally:
        copied = mirror.close() if mirror is not None else None  # why the copy to --json failed, or None
    if status == EXIT_USAGE:
        return status
    if launches.interrupted is not None:
        launches.record_interruption()
    ordered = launches.ordered()
    # the final files: every planned case, the metamorphic groups, the summary; a --json whose copy
    # failed is left as the failure left it
    done = finish_run([(ordered, backend)], None if copied else args.json, args.junit, problems=[copied])
    status = worst(status, done.exit_status())
    # the counts of the files just written (cases and metamorphic groups), as rank 0's summary line has
    # them: a count of the case records alone would say 0 groups under rank 0's N
    if launches.interrupted is not None:
        print(f"clipcheck run: interrupted by {signal.Signals(launches.interrupted).name}; results written for "
              f"every planned case: {done.counts.line()}", flush=True)
        return 128 + launches.interrupted
    if launches.resumes or any(is_unjudged(r) for r in ordered):
        print(f"clipcheck run: {launches.resumes} relaunch(es); summary over every planned case: "
              f"{done.counts.line()}", flush=True)
    return worst(status, EXIT_BROKEN if any(is_unjudged(r) for r in ordered) else 0)
