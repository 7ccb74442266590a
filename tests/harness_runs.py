"""Run ``python -m harness`` under torchrun from a test and read back what it wrote."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repro_runs import torchrun_command

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
    proc = harness_process(cmd, env, timeout)
    records = []
    if out.exists():
        records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return HarnessRun(proc.returncode, proc.stdout, proc.stderr, records)


class LaunchServer:
    """This test process's ``tests/launch_server.py``: ``python -m harness ARGS`` forked from a process that
    imported torch, the harness and the frameworks once. Started on first use; set CLIPCHECK_TEST_FRESH=1
    for fresh interpreters instead."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.path = ""

    def _start(self) -> None:
        folder = tempfile.mkdtemp(prefix="clipcheck-launch-")
        self.path = os.path.join(folder, "socket")
        with open(os.path.join(folder, "server.log"), "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "launch_server.py"), self.path],
                                         cwd=ROOT, env=harness_env(), stdout=subprocess.PIPE, stderr=log, text=True)
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline().strip()
        assert ready == "ready", f"the launch server did not start (see {folder}/server.log)"

    def run(self, argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        with tempfile.TemporaryDirectory(prefix="clipcheck-out-") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            request = {"argv": argv, "cwd": str(cwd), "env": env, "out": str(out), "err": str(err)}
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(self.path)
                stream = conn.makefile("rwb")
                stream.write(json.dumps(request).encode() + b"\n")
                stream.flush()
                pid = json.loads(stream.readline())["pid"]
                conn.settimeout(timeout)
                try:
                    status = json.loads(stream.readline())["status"]
                except (socket.timeout, TimeoutError):
                    os.killpg(pid, signal.SIGKILL)
                    raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text()) from None
            return subprocess.CompletedProcess(argv, status, out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))


_SERVER = LaunchServer()


def harness_process(cmd: list[str], env: dict[str, str], timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``cmd`` run to its end, output captured: a ``python -m harness ARGS`` through this process's launch
    server (tests/launch_server.py), anything else (torchrun) as a process of its own."""
    if cmd[:3] == [sys.executable, "-m", "harness"] and not os.environ.get("CLIPCHECK_TEST_FRESH"):
        return _SERVER.run(cmd[3:], env, cwd, timeout)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun_harness(nproc: int) -> list[str]:
    """``torchrun --standalone --nproc_per_node=nproc -m harness``: a free port per run, so runs can go in
    parallel."""
    return [*torchrun_command(nproc, torchrun=True), "-m", "harness"]


def run_harness(nproc: int, args: list[str], tmp_path: Path, timeout: float = 300) -> HarnessRun:
    """torchrun (``torchrun_harness``) on this checkout."""
    return _run_and_read(torchrun_harness(nproc), args, tmp_path / f"results-{nproc}-{abs(hash(tuple(args)))}.jsonl", timeout)


def run_clipcheck(nproc: int, args: list[str], tmp_path: Path, timeout: float = 300) -> HarnessRun:
    """``clipcheck run --nproc N`` (our launcher: our output, our exit status) on this checkout."""
    launcher = [sys.executable, "-m", "harness", "run", "--nproc", str(nproc)]
    return _run_and_read(launcher, args, tmp_path / f"run-{nproc}-{abs(hash(tuple(args)))}.jsonl", timeout)


def run_cli(args: list[str], env_extra: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m harness`` without a launcher (world size from the environment, 1 by default)."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.update(env_extra or {})
    return harness_process([sys.executable, "-m", "harness", *args], env, timeout)


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
    from harness.run.guards.family import descendants as of

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


def threads_of(pid: int) -> dict[str, int]:
    """A process's threads by name (``/proc/PID/task/*/comm``); {} once it is gone."""
    names: dict[str, int] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return names
    for task in tasks:
        try:
            name = Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
        except OSError:
            continue
        names[name] = names.get(name, 0) + 1
    return names


def most_threads(pid: int, every_s: float = 0.1) -> tuple[int, dict[str, int]]:
    """While ``pid`` runs, the most threads any of its descendants held at one time, and their names then
    (sampled every ``every_s``); returns when it has exited (the caller reaps it)."""
    most, names = 0, {}
    while alive({pid}):
        for child in descendants(pid):
            seen = threads_of(child)
            if sum(seen.values()) > most:
                most, names = sum(seen.values()), seen
        time.sleep(every_s)
    return most, names


def gloo_groups_held() -> tuple[int, int]:
    """A ``RankPool`` task: this rank's member groups in its current generation, and the gloo groups alive
    in the process (one ``gloo_tcp_loop`` thread each): equal when nothing keeps a dropped group alive."""
    from harness.run.hosts.pool import current_world

    return current_world().groups_alive(), threads_of(os.getpid()).get("gloo_tcp_loop", 0)
