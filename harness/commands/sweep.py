"""``clipcheck compat --sweep FRAMEWORK``: one framework's adapters over a list of its releases, and
which release has which finding.

Each release is installed into a venv of its own that sees this environment's packages behind it
(a ``.pth`` line to this environment's site-packages and to the running harness), so only the swept
distribution (and what its recipe adds) differs from the environment the sweep runs in; the venvs
are kept in ``--cache`` and reused. Each release then runs ``clipcheck matrix`` on the framework's
own targets and scenarios (``--nproc-list``, fp32 by default) in a child process of that venv, and
the per-release results are merged into one table: a row per finding (with who reaches it), a column
per release, the number of FAIL rows that show it; a release that does not install or import says why.

    clipcheck compat --sweep deepspeed                       # every release in its RELEASES list
    clipcheck compat --sweep megatron-core --releases 0.16.1,0.19.2 --nproc-list 2,4
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import harness
from harness.errors import ClipcheckInputError
from harness.judge.records import CaseRecord, case_records, read_records
from harness.judge.verdicts import count
from harness.report.compat import filed_findings, finding_record, registered_findings
from harness.targets.builtin_scenarios import scenarios_package
from harness.cases.frameworks import Framework
from harness.cases.target import Target

COMPLETE = ".clipcheck-sweep-complete"


@dataclass
class ReleaseRun:
    """One release of the sweep: installed or not (why), and the records its matrix wrote."""

    release: str
    problem: str | None = None
    records: list[CaseRecord] = field(default_factory=list)
    status: int | None = None


def framework_named(name: str) -> tuple[Framework, list[Target]]:
    """The built-in framework called ``name`` (its name or distribution) and its adapter targets."""
    package = scenarios_package()
    for framework in package.FRAMEWORKS:
        if name in (framework.name, framework.distribution):
            targets = [t for t in package.ADAPTER_TARGETS if t.requires is framework]
            return framework, targets
    known = ", ".join(sorted(f.name for f in package.FRAMEWORKS))
    raise ClipcheckInputError(f"--sweep: unknown framework {name!r} (known: {known})")


def parse_releases(text: str | None, framework: Framework) -> list[str]:
    releases = [r.strip() for r in text.split(",") if r.strip()] if text else list(framework.releases)
    if not releases:
        raise ClipcheckInputError(f"--sweep {framework.name}: no releases recorded for it; give --releases")
    if framework.distribution is None:
        raise ClipcheckInputError(f"--sweep {framework.name}: it is not on the package index ({framework.install})")
    return releases


def pip_lines(framework: Framework, release: str) -> list[tuple[dict[str, str], list[str]]]:
    """The release's recipe as (environment, ``pip install`` arguments) pairs: an assignment in front
    of a line (``DS_BUILD_OPS=0 pip install ...``) goes into that command's environment."""
    lines = []
    for line in framework.recipe_for(release):
        words = shlex.split(line)
        env: dict[str, str] = {}
        while words and "=" in words[0] and not words[0].startswith("-"):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        if words[:2] != ["pip", "install"]:
            raise ClipcheckInputError(f"{framework.name} {release}: a recipe line must be 'pip install ...': {line}")
        lines.append((env, words[2:]))
    return lines


def release_venv(framework: Framework, release: str, cache: Path) -> tuple[Path | None, str | None]:
    """A venv with ``release`` installed over this environment (made once, kept in ``cache``):
    its python, or None and the last lines of what failed."""
    import torch

    venv = cache / f"{framework.distribution}-{release}"
    python = venv / "bin" / "python"
    marker = venv / COMPLETE
    recipe = "\n".join(framework.recipe_for(release))
    if marker.is_file() and marker.read_text() == recipe:
        return python, None
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    here = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    harness_root = str(Path(harness.__file__).resolve().parents[1])
    (site / "zz-clipcheck-parent.pth").write_text("\n".join([harness_root, *sorted(here)]) + "\n")
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"  # held, as .ci/install-frameworks holds it
    for env, args in pip_lines(framework, release):
        proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                               "--disable-pip-version-check", *args, torch_pin],
                              env={**os.environ, **env}, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return None, f"pip install {' '.join(args)} failed: {' | '.join(tail)}"
    marker.write_text(recipe)
    return python, None


def run_release(framework: Framework, targets: list[Target], release: str, args: argparse.Namespace,
                extra: Sequence[str]) -> ReleaseRun:
    run = ReleaseRun(release)
    python, run.problem = release_venv(framework, release, Path(args.cache))
    if python is None:
        return run
    probe = subprocess.run([str(python), "-c", f"import importlib.metadata as m, {framework.probe}; "
                            f"print(m.version({framework.distribution!r}))"],
                           capture_output=True, text=True, cwd=args.out)
    printed = probe.stdout.strip().splitlines()  # a framework may print banners before the version
    if probe.returncode != 0 or not printed or printed[-1] != release:
        why = (probe.stderr.strip().splitlines() or printed or ["nothing printed"])[-1]
        run.problem = f"{framework.probe} does not import as release {release}: {why}"
        return run
    out = Path(args.out) / release
    scenarios = sorted({s for t in targets for s in (t.scenarios or ())})
    command = [str(python), "-m", "harness", "matrix", "--nproc-list", args.nproc_list, "--out", str(out),
               "--targets", ",".join(t.name for t in targets), "--scenario", ",".join(scenarios), *extra]
    print(f"clipcheck compat --sweep: {framework.name} {release}: {' '.join(command[1:])}", flush=True)
    proc = subprocess.run(command, cwd=args.out, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run.status = proc.returncode
    results = out / "results.jsonl"
    if not results.is_file():
        run.problem = f"the matrix wrote no results (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"
        return run
    run.records = case_records(read_records(str(results)))
    return run


def sweep_table(framework: Framework, runs: list[ReleaseRun]) -> str:
    """Markdown: a row per finding (and per unexplained failure), a column per release."""
    head = ["finding", "reach", *[r.release for r in runs]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    counts = [count(r.records) for r in runs]
    lines.append("| cases: passed / failed / errors / skipped | - | " + " | ".join(
        (f"{c.passed} / {c.failed} / {c.errors} / {c.skipped}" if r.problem is None else f"not run: {r.problem}")
        for r, c in zip(runs, counts)) + " |")
    rows: dict[tuple[str, str], dict[str, int]] = {}  # (finding, reach) -> release -> FAIL rows
    registered = registered_findings()
    for run in runs:
        for filed in filed_findings(run.records):
            key = (filed.finding["text"], filed.finding["reach"])
            rows.setdefault(key, {})[run.release] = rows.get(key, {}).get(run.release, 0) + filed.rows
        unexplained = sum(1 for rec in run.records
                          if rec["verdict"] == "FAIL" and finding_record(rec, registered) is None)
        if unexplained:
            rows.setdefault(("unexplained FAIL rows", "?"), {})[run.release] = unexplained
    for (text, reach), per_release in rows.items():
        cells = [str(per_release.get(r.release, "-")) for r in runs]
        lines.append(f"| {text} | {reach} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="clipcheck compat --sweep", allow_abbrev=False,
                                description="One framework's adapters over its releases: which has which finding.")
    p.add_argument("--sweep", required=True, metavar="FRAMEWORK", help="framework name or distribution")
    p.add_argument("--releases", default=None, help="comma separated (default: the framework's recorded list)")
    p.add_argument("--nproc-list", default="2", help="world sizes of each release's matrix (default 2)")
    p.add_argument("--cache", default=str(Path.home() / ".cache" / "clipcheck" / "sweep"),
                   help="where the per-release venvs are kept (default ~/.cache/clipcheck/sweep)")
    p.add_argument("--out", default="sweep", help="folder for each release's results (default ./sweep)")
    args, extra = p.parse_known_args(argv)
    framework, targets = framework_named(args.sweep)
    releases = parse_releases(args.releases, framework)
    if not any(flag.startswith("--dtype") for flag in extra):
        extra = [*extra, "--dtype", "fp32"]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    args.out = str(Path(args.out).resolve())
    runs = [run_release(framework, targets, release, args, extra) for release in releases]
    table = sweep_table(framework, runs)
    print(f"\n{framework.name}: {', '.join(t.name for t in targets)} over releases {', '.join(releases)} "
          f"(worlds {args.nproc_list})\n")
    print(table)
    (Path(args.out) / "sweep.md").write_text(table + "\n")
    (Path(args.out) / "sweep.json").write_text(json.dumps(
        [{"release": r.release, "problem": r.problem, "status": r.status, "records": r.records} for r in runs]) + "\n")
    return 0 if all(r.problem is None for r in runs) else 1
