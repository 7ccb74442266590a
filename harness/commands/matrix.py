"""``clipcheck matrix`` (= ``python -m harness matrix``, ``run_matrix.sh``): the matrix over several
world sizes and backends, one ``clipcheck run`` launch per (world size, backend), merged into one
summary, one JSON Lines file, one JUnit file and one HTML page.

    clipcheck matrix --nproc-list 1,2,4,8 --backends gloo --out results
    NPROC_LIST="2 4" ./run_matrix.sh --targets reference

Every launch is planned here first, so bad input and impossible combinations are reported before any
process starts. Each launch gets the serialized spec (``matrix.json`` in the output folder), never a
copy of this command's argv. A launch that does not judge every planned case is a crash: each
missing case becomes an ERROR record with the cause, it is counted and shown, and the exit status is
3. SIGINT or SIGTERM stops the launch in flight (the signal goes to its whole process group), waits
for it, and still merges what finished. A second matrix on the same ``--out`` is refused (one line,
exit 2: ``exclusive``); each launch's launcher dies with the matrix, and whatever a launch left
behind is ended before the next starts (``family``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from harness.judge.checks import unjudged_result
from harness.commands.exclusive import OutputClaim
from harness.commands.forked import ForkedProcess, fork_problem
from harness.commands.launcher import main as launcher_main
from harness.commands.options import add_selection_options, add_spawn_ranks_option, print_error, resolve_timeout, \
    spec_from_args, world_sizes
from harness.plan.project import ProjectDefaults, project_defaults
from harness.cases.matrix import MatrixSpec
from harness.run.world.devices import cuda_device_count, world_skip_reason
from harness.run.guards.family import PARENT_PID_ENV, descendants, end_descendants
from harness.run.world.startup import preload_frameworks
from harness.run.world.openmp import name_rank_threads
from harness.errors import ClipcheckInputError
from harness.report.finish import finish_run
from harness.report.numbers import format_ratio
from harness.report.safe_text import one_line
from harness.report.summary import compact_summary
from harness.errors import UsageError
from harness.plan.planner import Plan, plan_cases
from harness.plan.selection import emptied_across_worlds
from harness.judge.records import CaseRecord, MetamorphicRecord, case_records, read_records
from harness.report.reporter import case_json
from harness.judge.verdicts import EXIT_BROKEN, EXIT_NOTHING_JUDGED, EXIT_OUTPUT, EXIT_USAGE, count, is_unjudged
from harness.run.world.dist_world import default_backend

DEFAULT_MATRIX = "default_matrix.toml"
DEFAULT_WORLDS = "1,2,4,8"
STOP_GRACE_S = 30.0
LAUNCH_STATUSES = (0, 1, 3, EXIT_NOTHING_JUDGED, EXIT_OUTPUT, 128 + signal.SIGINT, 128 + signal.SIGTERM)
"""What a launch that ended on its own terms (or was interrupted) exits with; anything else is a
crashed launch."""


@dataclass
class Launch:
    world_size: int
    backend: str
    plan: Plan
    jsonl: Path
    log: Path
    returncode: int | None = None
    seconds: float = 0.0
    records: list[CaseRecord] = field(default_factory=list)

    @property
    def tag(self) -> str:
        return f"world {self.world_size} {self.backend}"

    @property
    def crashed(self) -> bool:
        return self.returncode is not None and self.returncode not in LAUNCH_STATUSES


def default_matrix_path() -> str:
    return str(resources.files("harness").joinpath(DEFAULT_MATRIX))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clipcheck matrix", allow_abbrev=False,
                                description="Run the matrix at every world size (one launch each) and merge.")
    p.add_argument("--nproc-list", default=os.environ.get("NPROC_LIST") or None,
                   help="world sizes, comma or space separated (env NPROC_LIST; default: [tool.clipcheck] worlds, "
                        f"else {DEFAULT_WORLDS})")
    p.add_argument("--backends", default=os.environ.get("BACKENDS", ""),
                   help="backends (env BACKENDS; default nccl with CUDA, else gloo)")
    p.add_argument("--out", default="results", help="folder for per-launch logs and merged results")
    p.add_argument("--verbose", action="store_true", help="print every case, not only the summary and failures")
    add_selection_options(p)
    add_spawn_ranks_option(p)
    return p


def _split(text: str) -> list[str]:
    return [x for x in text.replace(",", " ").split() if x]


def plan_launches(args: argparse.Namespace, out: Path,
                  spec: MatrixSpec | None = None) -> tuple[list[Launch], list[str]]:
    """Every (backend, world) launch, planned; what cannot run here is listed, not launched. ``spec``:
    ``matrix_spec``'s (without it, the flags and ``--matrix`` alone)."""
    spec = spec if spec is not None else spec_from_args(args)
    worlds = world_sizes(args.nproc_list, "--nproc-list")
    backends = _split(args.backends) or list(spec.backends) or [default_backend()]
    for backend in backends:
        if backend not in ("gloo", "nccl"):
            raise ClipcheckInputError(f"unknown backend {backend!r} (known: gloo, nccl)")
    launches, skipped = [], []
    devices = cuda_device_count()
    for backend in backends:
        if backend == "nccl" and devices == 0:
            skipped.append(f"backend nccl: {world_skip_reason(1, backend, devices)}")
            continue
        for world in worlds:
            reason = world_skip_reason(world, backend, devices)
            if reason:
                skipped.append(f"world {world} {backend}: {reason}")
                continue
            try:
                plan = plan_cases(spec, world, backend)
            except UsageError as exc:
                skipped.append(f"world {world} {backend}: {exc}")
                continue
            tag = f"world{world}-{backend}"
            launches.append(Launch(world, backend, plan, out / f"{tag}.jsonl", out / f"{tag}.log"))
    return launches, skipped


class _Interrupt:
    """SIGINT/SIGTERM while a launch runs: forward to its process group, remember, finish merging."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.proc: subprocess.Popen | ForkedProcess | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.signum = signum
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def launch_flags(args: argparse.Namespace) -> list[str]:
    """The matrix's flags that each ``clipcheck run`` launch takes as they are."""
    return ["--timeout", str(args.timeout), "--blame", args.blame] + (
        ["--spawn-ranks"] if args.spawn_ranks else [])


def _run(launch: Launch, spec_path: Path, flags: list[str], forked: bool, interrupt: _Interrupt) -> None:
    argv = ["--nproc", str(launch.world_size), "--backend", launch.backend, "--matrix", str(spec_path),
            "--json", str(launch.jsonl), "--no-progress", *flags]
    print(f"launch: {launch.tag}: {len(launch.plan.cases)} cases ...", end="", flush=True)
    name_rank_threads(os.environ)
    start = time.perf_counter()
    ours = descendants()
    with open(launch.log, "w") as log:
        proc: subprocess.Popen | ForkedProcess
        if forked:  # the launcher starts from this process's imports and plan
            proc = ForkedProcess(launcher_main, (argv, launch.plan), log)
        else:  # it dies with this process (``family``), though in a session of its own
            proc = subprocess.Popen([sys.executable, "-m", "harness", "run", *argv], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env=dict(os.environ, **{PARENT_PID_ENV: str(os.getpid())}))
        interrupt.proc = proc
        try:
            while True:
                try:
                    proc.wait(timeout=STOP_GRACE_S if interrupt.signum else None)
                    break
                except subprocess.TimeoutExpired:  # stopped, and still not gone: end it
                    os.killpg(proc.pid, signal.SIGKILL)
        finally:
            interrupt.proc = None
            end_descendants(spare=ours)  # what the launch left behind, adopted here
    launch.returncode, launch.seconds = proc.returncode, time.perf_counter() - start
    launch.records = _launch_records(launch)
    judged = sum(1 for r in launch.records if r["type"] == "case" and not is_unjudged(r))
    c = count(launch.records)
    state = "interrupted" if interrupt.signum else f"CRASHED (exit {launch.returncode})" if launch.crashed else \
        "RESULTS NOT WRITTEN" if launch.returncode == EXIT_OUTPUT else c.word
    print(f" {judged}/{len(launch.plan.cases)} judged, {state} in {launch.seconds:.1f} s (log {launch.log})",
          flush=True)


def _launch_records(launch: Launch) -> list[CaseRecord]:
    """The launch's case records, and an ERROR for every planned case it has no record of."""
    found: dict[int, CaseRecord] = {}
    if launch.jsonl.exists():
        found = {r["index"]: r for r in case_records(read_records(str(launch.jsonl)))}
    cause = (f"the launch of {launch.tag} ended (exit status {launch.returncode}) before judging this case; "
             f"see {launch.log}")
    out = []
    for case in launch.plan.cases:
        rec = found.get(case.index)
        if rec is None:
            rec = case_json(unjudged_result(case, "not_run", cause, launch.world_size), launch.world_size,
                            launch.backend)
        out.append(rec)
    return out


def matrix_spec(args: argparse.Namespace, project: ProjectDefaults) -> MatrixSpec:
    """The matrix's spec: the default matrix (unless ``--matrix`` names one), ``[tool.clipcheck]``, the
    ``--matrix`` file, the flags. ``[tool.clipcheck]``'s ``worlds`` is the default ``--nproc-list``
    (set here); a ``--nproc-list`` or ``NPROC_LIST`` given replaces it."""
    if args.nproc_list is None:
        args.nproc_list = ",".join(map(str, project.worlds)) or DEFAULT_WORLDS
        keys_off: tuple[str, ...] = ()
    else:
        keys_off = ("worlds",)
    return spec_from_args(args, project, base_matrix=None if args.matrix else default_matrix_path(),
                          project_keys_off=keys_off)


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    try:
        if out.exists() and not out.is_dir():
            raise ClipcheckInputError(f"--out {args.out}: not a directory")
        project = project_defaults()
        resolve_timeout(args, project)
        spec = matrix_spec(args, project)
        launches, skipped = plan_launches(args, out, spec)
        if not launches:
            raise ClipcheckInputError("nothing to launch" + "".join(f"; {line}" for line in skipped))
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK):
            raise ClipcheckInputError(f"--out {args.out}: not writable")
        claim = OutputClaim(out, "--out")
    except (ClipcheckInputError, OSError) as exc:
        print_error(exc)
        return EXIT_USAGE
    with claim:
        return _run_all(args, out, launches, skipped, spec)


def _run_all(args: argparse.Namespace, out: Path, launches: list[Launch], skipped: list[str],
             spec: MatrixSpec) -> int:
    for line in skipped:
        print(f"skipped: {line}", flush=True)
    for line in emptied_across_worlds([entry for launch in launches for entry in launch.plan.emptied]):
        print(f"note: {line}", flush=True)
    spec_path = out / "matrix.json"
    spec_path.write_text(json.dumps(spec.to_mapping(), indent=1))

    flags = launch_flags(args)
    # whether each launch's launcher (and so its ranks) is forked from this process
    forked = {launch.tag: fork_problem(launch.backend, args.spawn_ranks) is None for launch in launches}
    for launch in launches:
        if forked[launch.tag]:
            preload_frameworks(launch.plan, str(out / "preload.log"))  # once here, not in every launcher
    interrupt = _Interrupt()
    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for launch in launches:
            if interrupt.signum:
                break
            _run(launch, spec_path, flags, forked[launch.tag], interrupt)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    status = merge(launches, out, args.verbose)
    if interrupt.signum:
        print(f"matrix: interrupted by {signal.Signals(interrupt.signum).name}; merged what finished", flush=True)
        return 128 + interrupt.signum
    return status


def merge(launches: list[Launch], out: Path, verbose: bool) -> int:
    """One results.jsonl, junit.xml and report.html over every launch that ran; the exit status."""
    ran = [launch for launch in launches if launch.returncode is not None]
    done = finish_run([(launch.records, launch.backend) for launch in ran], str(out / "results.jsonl"),
                      str(out / "junit.xml"), html=out / "report.html")
    print("\n" + "\n".join(compact_summary(done.records)))
    print_merged([r for launch in ran for r in launch.records], done.groups, ran, verbose)
    crashed = [launch for launch in ran if launch.crashed]
    unwritten = [launch for launch in ran if launch.returncode == EXIT_OUTPUT]
    print()
    if done.counting is not None:
        print(done.counting)
    print(f"matrix: {len(ran)} launches, {done.counts.line()}; {len(crashed)} launches crashed")
    print(f"merged: {out / 'results.jsonl'}, {out / 'junit.xml'}")
    print(f"report: {done.page}", flush=True)
    return done.exit_status(EXIT_BROKEN if crashed else 0, EXIT_OUTPUT if unwritten else 0)


def print_merged(cases: list[CaseRecord], groups: list[MetamorphicRecord], ran: list[Launch],
                 verbose: bool) -> None:
    if verbose:
        print(f"\n{'world':<6}{'backend':<8}{'scenario':<17}{'layout':<52}{'target':<28}{'norm':<6}{'dtype':<6}"
              f"{'ratio':<10}verdict")
        for r in cases:
            print(f"{r['world_size']:<6}{r['backend']:<8}{one_line(r['scenario']):<17}{one_line(r['layout']):<52}"
                  f"{one_line(r['target']):<28}{r['norm']:<6}{r['dtype']:<6}{format_ratio(r['ratio']):<10}"
                  f"{r['verdict']}")
    # every failure with --verbose; without it only what was not judged (the summary counts the rest)
    failed = [r for r in cases if r["verdict"] == "ERROR" or (verbose and r["verdict"] == "FAIL")]
    if failed:
        print("\nfailures:" if verbose else "\nnot judged (errors):")
        for r in failed:
            checks = ", ".join(n for n, c in r["checks"].items() if not c["passed"])
            sig = f"  [{r['signature'][0]}]" if r["signature"] else ""
            print(one_line(f"  world {r['world_size']} {r['scenario']} {r['layout']} {r['target']} {r['norm']} "
                           f"{r['dtype']}: {checks}{sig}"))
    for m in groups if verbose else ():
        if not m["passed"]:
            print(one_line(f"  metamorphic world {m['world_size']} {m['scenario']} {m['target']} {m['norm']} "
                           f"{m['dtype']}: coefficient gap {m['gap']:.7f}"))
    for launch in ran:
        if launch.crashed:
            print(f"  launch {launch.tag} crashed (exit {launch.returncode}); see {launch.log}")
        elif launch.returncode == EXIT_OUTPUT:
            print(f"  launch {launch.tag} could not write its results; see {launch.log}")
    for reason in sorted({r["skip_reason"] or "skipped" for r in cases if r["verdict"] == "SKIP"}):
        print(f"  skipped: {one_line(reason)}")
