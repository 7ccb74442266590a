"""Run ``python -m harness`` under torchrun from a test and read back what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class HarnessRun:
    returncode: int
    stdout: str
    stderr: str
    records: list[dict[str, Any]]

    def cases(self, **match: Any) -> list[dict[str, Any]]:
        """Case records whose fields equal ``match``; ``layout_has`` matches part of the layout label."""
        out = []
        for rec in self.records:
            if rec.get("type") != "case":
                continue
            ok = True
            for key, value in match.items():
                if key == "layout_has":
                    ok &= value in rec["layout"]
                else:
                    ok &= rec.get(key) == value
            if ok:
                out.append(rec)
        return out

    def one(self, **match: Any) -> dict[str, Any]:
        found = self.cases(**match)
        assert len(found) == 1, f"expected one case matching {match}, found {len(found)}"
        return found[0]

    @property
    def summary(self) -> dict[str, Any]:
        return next(r for r in self.records if r.get("type") == "summary")

    def metamorphic(self, **match: Any) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("type") == "metamorphic"
                and all(r.get(k) == v for k, v in match.items())]


def _run_and_read(launcher: list[str], args: list[str], out: Path, timeout: float) -> HarnessRun:
    cmd = [*launcher, *args, "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    records = []
    if out.exists():
        records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return HarnessRun(proc.returncode, proc.stdout, proc.stderr, records)


def run_harness(nproc: int, args: list[str], tmp_path: Path, timeout: float = 300) -> HarnessRun:
    """torchrun --standalone (a free port per run, so runs can go in parallel) on this checkout."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                "-m", "harness"]
    return _run_and_read(launcher, args, tmp_path / f"results-{nproc}-{abs(hash(tuple(args)))}.jsonl", timeout)


def run_clipcheck(nproc: int, args: list[str], tmp_path: Path, timeout: float = 300) -> HarnessRun:
    """``clipcheck run --nproc N`` (our launcher: our output, our exit status) on this checkout."""
    launcher = [sys.executable, "-m", "harness", "run", "--nproc", str(nproc)]
    return _run_and_read(launcher, args, tmp_path / f"run-{nproc}-{abs(hash(tuple(args)))}.jsonl", timeout)


def run_cli(args: list[str], env_extra: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m harness`` without a launcher (world size from the environment, 1 by default)."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def failed(case: dict[str, Any]) -> set[str]:
    """The names of a case record's failed checks."""
    return {name for name, check in case["checks"].items() if not check["passed"]}


def expect_skips(run: HarnessRun, framework: Any, *targets: str) -> None:
    """Where ``framework`` is not installed: every case of each target is a SKIP whose reason carries
    its install hint (never a failure), and the summary counts them."""
    total = 0
    for target in targets:
        cases = run.cases(target=target)
        assert cases and all(c["verdict"] == "SKIP" for c in cases), target
        assert all(framework.install in c["skip_reason"] for c in cases), target
        total += len(cases)
    assert run.summary["skipped"] >= total


def descendants(pid: int) -> set[int]:
    """Every live process whose ancestry reaches pid (read from /proc)."""
    from harness.run.family import descendants as of

    return of(pid)


def alive(pids: set[int]) -> list[int]:
    """Those of ``pids`` that still run (zombies excepted)."""
    out = []
    for pid in sorted(pids):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def harness_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                **extra)


def start_harness(args: list[str], launcher: list[str] | None = None, **env: str) -> subprocess.Popen:
    """``python -m harness ARGS`` (or ``LAUNCHER ARGS``) in the background, output captured; the caller
    waits for it (``communicate`` with a timeout) or kills it."""
    return subprocess.Popen([*(launcher or [sys.executable, "-m", "harness"]), *args], cwd=ROOT, env=harness_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until(condition: Any, timeout: float, what: str) -> None:
    """Poll ``condition()`` every half second; fail the test with ``what`` if it never holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


def jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON Lines file, [] if there is none yet."""
    if not path.exists():
        return []
    from harness.judge.records import read_records

    return list(read_records(str(path)))  # type: ignore[arg-type]


def listening_addresses(pids: set[int]) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} writes them) of every listening TCP socket the
    processes ``pids`` hold: 0100007F is 127.0.0.1; 00000000 or all zeros the wildcard."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                found.append(fields[1].rsplit(":", 1)[0])
    return found
