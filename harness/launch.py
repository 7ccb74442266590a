"""``python -m harness matrix``: the matrix over several world sizes and backends, one torchrun launch
per (world size, backend), merged into one table, one JSON Lines file and one JUnit file.

    python -m harness matrix --nproc-list 1,2,4,8 --backends gloo --out results
    NPROC_LIST="2 4" ./run_matrix.sh --targets reference

Every launch is planned here first, so bad input and impossible combinations are reported before any
process starts. Each launch runs all of its cases in one process group (cases cost milliseconds);
its rank 0 writes JSON Lines as cases finish, so a launch that crashes keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import torch

from .cli import add_selection_options, spec_from_args
from .junit import write_junit
from .layout import LayoutError
from .loading import LoadError
from .plan import UsageError, plan_cases
from .report import read_records

DEFAULT_MATRIX = "default_matrix.toml"


@dataclass
class Launch:
    world_size: int
    backend: str
    cases: int
    jsonl: Path
    log: Path
    returncode: int | None = None
    seconds: float = 0.0


def default_matrix_path() -> str:
    return str(resources.files("harness").joinpath(DEFAULT_MATRIX))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness matrix",
                                description="Run the matrix at every world size (one torchrun each) and merge.")
    p.add_argument("--nproc-list", default=os.environ.get("NPROC_LIST", "1,2,4,8"),
                   help="world sizes, comma or space separated (env NPROC_LIST; default 1,2,4,8)")
    p.add_argument("--backends", default=os.environ.get("BACKENDS", ""),
                   help="backends (env BACKENDS; default nccl with CUDA, else gloo)")
    p.add_argument("--out", default="results", help="folder for per-launch logs and merged results")
    add_selection_options(p)
    return p


def _split(text: str) -> list[str]:
    return [x for x in text.replace(",", " ").split() if x]


def _passthrough(argv: Sequence[str]) -> list[str]:
    """The selection flags, verbatim, for each torchrun launch (launcher-only flags removed)."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--nproc-list", "--backends", "--out", "--matrix"):
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.matrix is None:
        args.matrix = default_matrix_path()
    try:
        worlds = [int(w) for w in _split(args.nproc_list)]
        if not worlds or min(worlds) < 1:
            raise ValueError("--nproc-list needs positive world sizes")
        spec = spec_from_args(args)
    except (ValueError, LayoutError, LoadError) as exc:
        print(f"clipcheck: error: {exc}", file=sys.stderr)
        return 2
    backends = _split(args.backends) or list(spec.backends) or ["nccl" if torch.cuda.is_available() else "gloo"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    launches, skipped = [], []
    for backend in backends:
        if backend == "nccl" and not torch.cuda.is_available():
            skipped.append("backend nccl: no CUDA device here")
            continue
        for world in worlds:
            if backend == "nccl" and world > torch.cuda.device_count():
                skipped.append(f"world {world} nccl: only {torch.cuda.device_count()} GPU(s)")
                continue
            try:
                plan = plan_cases(spec, world, backend)
            except UsageError as exc:
                skipped.append(f"world {world} {backend}: {exc}")
                continue
            tag = f"world{world}-{backend}"
            launches.append(Launch(world, backend, len(plan.cases), out / f"{tag}.jsonl", out / f"{tag}.log"))
    for line in skipped:
        print(f"skipped: {line}", flush=True)
    if not launches:
        print("clipcheck: error: nothing to launch", file=sys.stderr)
        return 2

    passthrough = _passthrough(argv) + ["--matrix", args.matrix]
    for launch in launches:
        _run(launch, passthrough)
    return _merge(launches, out)


def _run(launch: Launch, passthrough: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={launch.world_size}",
           "-m", "harness", *passthrough, "--backend", launch.backend, "--json", str(launch.jsonl), "--no-progress"]
    print(f"launch: world {launch.world_size} {launch.backend}: {launch.cases} cases ...", end="", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    start = time.perf_counter()
    with open(launch.log, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    launch.returncode, launch.seconds = proc.returncode, time.perf_counter() - start
    done = len(_records(launch.jsonl, "case"))
    state = {0: "all passed", 1: "some failed"}.get(proc.returncode, f"CRASHED (exit {proc.returncode})")
    print(f" {done}/{launch.cases} judged, {state} in {launch.seconds:.1f} s (log {launch.log})", flush=True)


def _records(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    recs = read_records(str(path)) if path.exists() else []
    return [r for r in recs if kind is None or r.get("type") == kind]


def _merge(launches: list[Launch], out: Path) -> int:
    records = [r for launch in launches for r in _records(launch.jsonl) if r.get("type") != "summary"]
    cases = [r for r in records if r["type"] == "case"]
    meta = [r for r in records if r["type"] == "metamorphic"]
    with open(out / "results.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    write_junit(str(out / "junit.xml"), records)

    print(f"\n{'world':<6}{'backend':<8}{'scenario':<17}{'layout':<52}{'target':<28}{'norm':<6}{'dtype':<6}"
          f"{'ratio':<10}verdict")
    for r in cases:
        ratio = "-" if r["ratio"] is None else r["ratio"] if isinstance(r["ratio"], str) else f"{r['ratio']:.6f}"
        print(f"{r['world_size']:<6}{r['backend']:<8}{r['scenario']:<17}{r['layout']:<52}{r['target']:<28}"
              f"{r['norm']:<6}{r['dtype']:<6}{str(ratio):<10}{r['verdict']}")
    failed = [r for r in cases if r["verdict"] in ("FAIL", "ERROR")]
    skipped = sorted({r["skip_reason"] for r in cases if r["verdict"] == "SKIP"})
    meta_failed = [m for m in meta if not m["passed"]]
    crashed = [launch for launch in launches if launch.returncode not in (0, 1)]
    if failed:
        print("\nfailures:")
        for r in failed:
            checks = ", ".join(n for n, c in r["checks"].items() if not c["passed"])
            sig = f"  [{r['signature'][0]}]" if r["signature"] else ""
            print(f"  world {r['world_size']} {r['scenario']} {r['layout']} {r['target']} {r['norm']} "
                  f"{r['dtype']}: {checks}{sig}")
    for m in meta_failed:
        print(f"  metamorphic world {m['world_size']} {m['scenario']} {m['target']} {m['norm']} {m['dtype']}: "
              f"coefficient gap {m['gap']:.7f}")
    for launch in crashed:
        print(f"  launch world {launch.world_size} {launch.backend} crashed (exit {launch.returncode}); "
              f"see {launch.log}")
    for reason in skipped:
        print(f"  skipped: {reason}")
    ok = not failed and not meta_failed and not crashed
    n_skipped = sum(r["verdict"] == "SKIP" for r in cases)
    print(f"\nmatrix: {len(launches)} launches, {len(cases)} cases, {len(cases) - len(failed) - n_skipped} passed, "
          f"{len(failed)} failed, {n_skipped} skipped; metamorphic {len(meta)} groups, {len(meta_failed)} failed; "
          f"{len(crashed)} launches crashed => {'PASS' if ok else 'FAIL'}")
    print(f"merged: {out / 'results.jsonl'}, {out / 'junit.xml'}")
    return 0 if ok else (3 if crashed else 1)
