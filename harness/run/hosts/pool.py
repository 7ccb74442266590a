"""A warm world: persistent rank processes with live process groups, running tasks sent from a parent.

torchrun costs seconds per launch; a test suite, a fuzzer or a benchmark that needs thousands of
small distributed runs cannot pay that each time. ``RankPool`` starts ``world_size`` processes once
(forkserver with torch preloaded, so a start is a fraction of a second), each joins a process group
through a store the parent hosts, and then every ``run(fn, ...)`` calls ``fn`` on all ranks and
returns each rank's outcome.

Failure handling, in the parent's terms:

* a task raises on some rank: that rank abandons its groups (peers blocked on it fail fast), every
  rank reports, and the pool builds a fresh generation of groups before the next task;
* a rank does not answer within the timeout: its Python stack is dumped (faulthandler), the whole
  pool is killed and restarted on the next task, and the task's result says which rank hung where;
* a rank process dies: the same, with its exit code, at once: the peers still blocked on it are not
  waited for (they are killed with the pool and reported as collateral).

The store the ranks rendezvous through listens on the loopback interface only (a socket bound to
127.0.0.1 handed to the TCPStore), and every rank process dies with its parent (PR_SET_PDEATHSIG),
so an interrupted test run or fuzzer leaves no orphan ranks.

Tasks and their arguments are pickled; functions travel by reference, so they must be importable
(module-level) in the workers, which are given the parent's ``sys.path``.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import types
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator, cast

import torch
import torch.distributed as dist

from harness.run.guards.family import children_die_with_this_process, die_with_parent
from harness.run.world.startup import share_the_cores
from harness.run.world.openmp import rank_threads
from harness.run.world.torch_compat import LISTEN_FD_ON_LIBUV
from harness.plan.project import timeout_problem
from harness.run.world.dist_world import DistWorld
from harness.errors import ClipcheckError
from harness.run.case.launch_state import LaunchState

_WORLD: DistWorld | None = None
_LAUNCH = LaunchState()


def current_world() -> DistWorld:
    """The DistWorld of the rank process running the current task."""
    if _WORLD is None:
        raise RuntimeError("current_world() is only available inside a RankPool task")
    return _WORLD


def current_launch() -> LaunchState:
    """What the rank process running the current task keeps from case to case (the pool owns it: it
    lives as long as the rank's world)."""
    return _LAUNCH


@dataclass
class RankResult:
    rank: int
    status: str  # "ok" | "error" | "skip" | "hung" | "died" | "collateral" (stuck on a dead or hung peer)
    value: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class PoolBroken(ClipcheckError, RuntimeError):
    """The pool could not be started (a rank failed to join in time). Under the one root (``except
    ClipcheckError`` catches it), and still a RuntimeError for older handlers."""


FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
                      "harness.run.hosts.pool", "harness.run.hosts.pool_cases", "harness.scenarios")
"""Imported once by the fork server every rank is forked from: what the first task would otherwise
import in every rank (the first DTensor imports torch._dynamo, paid by every rank: docs/performance.md,
"Figures cited by the code"; the registry imports every scenario module). Import errors are ignored
there (the rank imports what it needs)."""

CLOSE_GRACE_S = 10.0
"""How long ``RankPool.close`` waits for idle ranks to stop on their own, all of them together."""

PEER_GRACE_S = 2.0
"""After a rank dies or reports a hang, how long the others get to answer before they are taken to
be stuck on it."""


def loopback_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server reachable from this machine only: TCPStore itself binds every interface, so
    it is handed a socket already bound to 127.0.0.1 (the store owns and closes that descriptor)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    fd = sock.detach()
    try:
        return dist.TCPStore("127.0.0.1", port, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False, master_listen_fd=fd, use_libuv=LISTEN_FD_ON_LIBUV)
    except Exception:
        os.close(fd)
        raise


def _worker(rank: int, world_size: int, port: int, backend: str | None, timeout_s: float,
            conn: Connection, path: list[str], stack_dir: str) -> None:
    global _WORLD
    die_with_parent()
    children_die_with_this_process()  # a child a task forks must not hold this rank's pipe open
    # Ctrl-C reaches the whole foreground group: the parent decides (it stops or kills the pool), a
    # rank printing its own KeyboardInterrupt traceback would only bury the parent's one line
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.path[:] = path
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
    )
    share_the_cores(world_size)
    torch.set_num_threads(rank_threads(os.environ))  # the fork server released its OpenMP pool (``openmp``)
    stack_file = open(os.path.join(stack_dir, f"rank{rank}.stack"), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    _WORLD = DistWorld(backend, timeout_s)
    gc.freeze()  # what the fork server preloaded, out of every later full collection (``startup.settle_startup``)
    # a hung task: the watchdog thread tells the parent at once (the main thread is stuck), then waits
    def hang_handler(message: str) -> None:
        conn.send(("hung", message))
        time.sleep(3600)

    _WORLD.hang_handler = hang_handler
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        kind = message[0]
        if kind == "stop":
            break
        if kind == "regenerate":
            _WORLD.regenerate()
            conn.send(("ok", None))
            continue
        _, fn, args, kwargs, new_path = message
        sys.path[:] = new_path
        try:
            conn.send(("ok", fn(*args, **kwargs), _WORLD.stop_reason))
        except BaseException as exc:  # noqa: BLE001 - report anything, including pytest outcomes
            if type(exc).__name__ == "Skipped":
                conn.send(("skip", str(exc)))
                continue
            text = "".join(traceback.format_exception(exc)).rstrip()
            if dist.is_initialized():
                _WORLD.abandon()
            conn.send(("error", text, _WORLD.stop_reason))
        if _WORLD.stop_reason is not None:  # the task left something running: the parent restarts us
            break
    _WORLD.close()


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start processes that do not import this process's ``__main__``: multiprocessing has each new
    process run the main script again (as ``__mp_main__``), so a script calling ``harness.check`` at
    its top level, without an ``if __name__ == "__main__":`` guard, had every rank call it again and
    die ("PoolBroken ... rank 0 died", no reason given). Tasks of the harness's own never need it."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")  # no __file__, no __spec__: nothing to import
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class RankPool:
    """``world_size`` persistent ranks on this machine; ``run`` calls a function on all of them.
    ``import_main=False``: the ranks do not import the parent's main script (``harness.check``'s
    pools, whose tasks are the harness's own; a task defined in the script itself then cannot run)."""

    def __init__(self, world_size: int, backend: str | None = None, timeout_s: float = 60.0,
                 start_method: str = "forkserver", start_timeout_s: float = 120.0, import_main: bool = True) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be positive, got {world_size}")
        problem = timeout_problem(timeout_s, "timeout_s")
        if problem:
            raise ValueError(problem)
        self.import_main = import_main
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.start_method = start_method
        self.start_timeout_s = start_timeout_s
        self.starts = 0
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._store: dist.TCPStore | None = None
        self._stack_dir: str | None = None  # where a silent rank dumps its stack; made by start()
        self._needs_regenerate = False
        self._must_restart = False  # a rank's world was stopped by the last task (``leftovers``)
        self._in_flight = False  # a task was sent and its results not all collected (an interruption cut it short)

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        self.kill()
        if self._stack_dir is None:
            self._stack_dir = tempfile.mkdtemp(prefix="clipcheck-stacks-")
        self._store = loopback_store(self.world_size + 1, max(self.timeout_s * 4, 120))
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(  # type: ignore[attr-defined]  # typeshed: get_context(str) -> BaseContext
                target=_worker,
                args=(rank, self.world_size, self._store.port, self.backend, self.timeout_s, child_end,
                      list(sys.path), self._stack_dir),
                daemon=True,
                name=f"clipcheck-rank{rank}",
            )
            with (nullcontext() if self.import_main else _main_module_hidden()):
                proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        results = self._collect(self.start_timeout_s)
        if not all(r.status == "ready" for r in results):
            problems = "; ".join(f"rank {r.rank}: {r.status} {r.error or ''}".strip() for r in results
                                 if r.status != "ready")
            self.kill()
            raise PoolBroken(f"a world of {self.world_size} ranks did not start: {problems}")
        self.starts += 1
        self._needs_regenerate = False

    def close(self) -> None:
        """Stop the ranks: asked to, when they are idle (they close their groups), within
        ``CLOSE_GRACE_S`` for all of them; killed at once when a task is still running on them (an
        interruption cut it short: they would finish it first) or past the grace."""
        if not self._in_flight:
            for conn in self._conns:
                try:
                    conn.send(("stop",))
                except (OSError, BrokenPipeError):
                    pass
            deadline = time.monotonic() + CLOSE_GRACE_S
            for proc in self._procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()
        if self._stack_dir is not None:  # a pool closed between test sessions must not leave it behind
            shutil.rmtree(self._stack_dir, ignore_errors=True)
            self._stack_dir = None

    def kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self._store = None
        self._must_restart = False
        self._in_flight = False

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- tasks -----------------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
            **kwargs: Any) -> list[RankResult]:
        """Call ``fn(*args, **kwargs)`` on every rank; one RankResult per rank, in rank order."""
        if not self.alive:
            self.start()
        elif self._needs_regenerate:
            self._regenerate()
        self._in_flight = True
        for conn in self._conns:  # pickled for each rank: a CPU tensor travels as a handle only one can claim
            conn.send(("call", fn, args, kwargs, list(sys.path)))
        results = self._collect(timeout_s if timeout_s is not None else 2 * self.timeout_s + 30)
        self._in_flight = False
        if self._must_restart or any(r.status in ("hung", "died", "collateral") for r in results):
            self.kill()
        elif any(r.status != "ok" for r in results):
            self._needs_regenerate = True
        return results

    def _regenerate(self) -> None:
        for conn in self._conns:
            conn.send(("regenerate",))
        results = self._collect(2 * self.timeout_s + 30)
        if not all(r.ok for r in results):
            self.kill()
            self.start()
        self._needs_regenerate = False

    def _collect(self, timeout_s: float) -> list[RankResult]:
        results: dict[int, RankResult] = {}
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
        deadline = time.monotonic() + timeout_s
        broken = False
        while waiting:
            ready = cast(list[Connection], wait(list(waiting), timeout=max(0.0, deadline - time.monotonic())))
            if not ready:
                break
            for conn in ready:
                rank = waiting.pop(conn)
                try:
                    status, payload, *stop = conn.recv()
                    self._must_restart = self._must_restart or any(stop)
                except (EOFError, OSError):
                    self._procs[rank].join(timeout=5)
                    code = self._procs[rank].exitcode
                    results[rank] = RankResult(rank, "died", error=f"rank {rank} died (exit code {code})")
                    status = "died"
                else:
                    error = payload if status in ("error", "skip", "hung") else None
                    results[rank] = RankResult(rank, status, None if error else payload, error)
                if status in ("died", "hung") and not broken:  # the others may be stuck on it: not long
                    broken = True
                    deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
        for rank in waiting.values():
            if broken:
                results[rank] = RankResult(rank, "collateral", error=f"rank {rank} did not answer after a peer "
                                           "died or hung (stopped with the pool)")
            else:
                results[rank] = RankResult(rank, "hung", error=self._stack_of(rank, timeout_s))
        return [results[r] for r in range(len(self._conns))]

    def _stack_of(self, rank: int, timeout_s: float) -> str:
        """Ask a silent rank for its Python stack, so a hang is reported with where it hangs."""
        proc = self._procs[rank]
        assert self._stack_dir is not None  # a started pool has one
        path = os.path.join(self._stack_dir, f"rank{rank}.stack")
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.5)
        try:
            with open(path) as f:
                stack = f.read().strip()
        except OSError:
            stack = ""
        where = f"\n{stack}" if stack else ""
        return f"rank {rank} gave no answer within {timeout_s:.0f} s (hung){where}"

