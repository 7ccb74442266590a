"""Ranks forked from ``clipcheck run``'s launcher instead of started as fresh interpreters.

Why: a fresh rank imports torch and the harness, plans the whole matrix again (the bounds are
ratios of every variant's constructive norm) and imports each framework its cases call, all before
or during its first cases. Where ranks outnumber the cores, they pay that many times over on the
same cores, and a short launch is mostly start-up. Forked from the launcher, which has already
imported, planned and preloaded the plan's frameworks, a rank starts with all of it in copy-on-write
memory (the figures: docs/performance.md, "Where it stands", item 1, and "Figures cited by the code";
``bench/overhead_bench.py`` measures the default matrix).

torchrun's elastic agent still runs the ranks (a function entry point, ``start_method="fork"``), so
how a rank's death, a hang or SIGTERM is handled is unchanged. What a fork would carry over from the
launcher and a fresh process would not have, ``like_a_fresh_rank`` undoes:

* the launcher's sockets (the agent's store): a rank whose target raised shuts down every TCP
  connection it holds (``run.release``), and would cut the agent's as well; they are detached,
  their descriptor numbers kept out of reuse (``_detach_inherited_sockets``);
* the agent's signal handlers (SIGTERM raises an exception in the agent; a rank must die of it, or
  rank 0 record it, exactly as a fresh process does);
* the launcher's OpenMP thread pool, released before each fork (``openmp``: a pool inherited through a
  fork hangs the child's first parallel region); the rank's own thread count is set before its first
  case, as in a fresh rank (``startup.settle_startup``);
* life after the launcher: a rank dies with it (PR_SET_PDEATHSIG), so nothing is left behind.

Where ranks start fresh (``fork_problem``): nccl or any machine with CUDA (a CUDA context does not
survive a fork), no /proc to find inherited sockets, or ``--spawn-ranks``: a user target whose
import differs per rank (it reads RANK at import time) is imported once, in the launcher, when forked.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
from typing import IO, Any, Callable, Sequence

import torch

from harness.run.guards.family import die_with_parent, end_descendants, keep_together
from harness.plan.planner import Plan


def fork_problem(backend: str, spawn_requested: bool) -> str | None:
    """Why the ranks of this launch must start as fresh processes; None when they can be forked."""
    if spawn_requested:
        return "--spawn-ranks"
    if backend != "gloo":
        return f"the {backend} backend (CUDA does not survive a fork)"
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc/self/fd"):
        return "not Linux (inherited sockets are found through /proc)"
    if torch.cuda.is_available():
        return "CUDA is available (a CUDA context does not survive a fork)"
    return None


def _detach_inherited_sockets() -> None:
    """Point every inherited socket descriptor at /dev/null instead of closing it: the launcher's
    objects that own those numbers (the agent's store, its sockets) were copied into this process
    too, and one that is freed here would close its number again; had the number been freed, it
    could by then belong to one of this rank's gloo sockets or event loops (a gloo transport abort,
    ``loop.cc ... nfds != -1``: docs/performance.md, "Where it stands", item 1). Held by /dev/null,
    the number is never reused, and the rank holds no reference to the launcher's connections for
    ``run.world.release`` to cut.
    Standard input and output stay as they are, sockets or not: they are the rank's, shared on purpose."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                if int(fd) > 2 and int(fd) != null and os.readlink(f"/proc/self/fd/{fd}").startswith("socket:["):
                    os.dup2(null, int(fd))
            except OSError:  # the descriptor of the listing itself is gone by now
                pass
    finally:
        os.close(null)


def like_a_fresh_rank() -> None:
    """What a rank forked from a launcher does first, so that it behaves as one started afresh (the
    module docstring's list): any function entry point run by the elastic agent with ``fork``."""
    die_with_parent()
    _detach_inherited_sockets()
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def forked_rank(plan: Plan, argv: Sequence[str]) -> None:
    """A forked rank's entry point (the elastic agent calls it with RANK, WORLD_SIZE, ... set): the
    launcher's plan, the run of ``python -m harness`` otherwise; exits with its status."""
    like_a_fresh_rank()
    from harness.commands.run import run_main

    keep_together()
    try:
        status = run_main(argv, plan=plan)
    finally:
        end_descendants()
    if status:
        sys.exit(status)


class ForkedProcess:
    """``subprocess.Popen``'s face (``pid``, ``poll``, ``wait``, ``returncode``) over ``fn(*args)`` run
    in a forked child: in a process group of its own (a signal can go to all it starts), stdout and
    stderr to ``log``, exit status ``fn``'s return value, dying with its parent. ``clipcheck matrix``
    runs each ``clipcheck run`` launcher this way where ranks are forked anyway, so a launch starts
    with the matrix's imports, plans and preloaded frameworks instead of making its own."""

    def __init__(self, fn: Callable[..., int], args: tuple[Any, ...], log: IO[str]) -> None:
        sys.stdout.flush()  # what is buffered here would be written again by the child
        sys.stderr.flush()
        self._process = mp.get_context("fork").Process(target=_in_own_group,
                                                       args=(fn, args, log.fileno(), os.getpid()))
        self._process.start()
        assert self._process.pid is not None
        self.pid: int = self._process.pid
        try:  # here as well as in the child: the group exists when start() returns, whoever runs first
            os.setpgid(self.pid, self.pid)
        except OSError:  # the child got there first (or already ended)
            pass
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self._process.join()
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("clipcheck run (forked)", timeout or 0.0)
        self.returncode = self._process.exitcode
        return self.returncode


def _in_own_group(fn: Callable[..., int], args: tuple[Any, ...], log_fd: int, parent_pid: int) -> None:
    try:
        os.setpgid(0, 0)
    except OSError:  # the parent got there first
        pass
    die_with_parent(parent_pid)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the matrix's own handlers
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(fn(*args))
