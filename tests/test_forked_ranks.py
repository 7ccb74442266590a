"""`clipcheck run` forks its ranks from the launcher on CPU/gloo (harness.commands.forked): the verdicts are
those of ranks started fresh (`--spawn-ranks`, as torchrun starts them), a rank whose target raised does
not cut the launcher's own connections, and a forked rank handles signals like a fresh one (that no rank
outlives a launcher killed outright: tests/test_processes.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time

import pytest

from harness.commands.forked import like_a_fresh_rank, fork_problem
from harness_runs import failed, run_clipcheck

BROKEN = "tests/broken_targets.py"
ONE_CASE = ["--scenario", "dense_dp", "--dtype", "fp32", "--norm-type", "2", "--clip-ratio", "0.5"]


def test_ranks_are_forked_on_cpu_gloo_only_and_never_when_asked_not_to():
    assert fork_problem("gloo", spawn_requested=False) is None  # this machine: Linux, no CUDA
    assert "--spawn-ranks" in (fork_problem("gloo", spawn_requested=True) or "")
    assert "nccl" in (fork_problem("nccl", spawn_requested=False) or "")


def _dispositions_after_reset(queue: mp.SimpleQueue) -> None:
    signal.signal(signal.SIGTERM, lambda *_: None)  # what the elastic agent installs in the launcher
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    journal, _ = socket.socketpair()  # a launcher whose output goes to a socket (journald's way)
    os.dup2(journal.fileno(), 2)
    like_a_fresh_rank()
    inherited = listening.fileno()
    still_a_socket = os.readlink(f"/proc/self/fd/{inherited}").startswith("socket:[")
    # the number stays taken (its owner, copied from the launcher, may close it once more later)
    number_reused = any(socket.socket().fileno() == inherited for _ in range(8))
    output_kept = os.readlink("/proc/self/fd/2").startswith("socket:[")
    queue.put((signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
               signal.getsignal(signal.SIGINT) is signal.default_int_handler, still_a_socket, number_reused,
               output_kept))


def test_a_forked_rank_drops_the_launchers_signal_handlers_and_sockets():
    context = mp.get_context("fork")
    queue = context.SimpleQueue()
    child = context.Process(target=_dispositions_after_reset, args=(queue,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert queue.get() == (True, True, False, False, True)


@pytest.mark.distributed
def test_forked_and_fresh_ranks_give_the_same_verdicts_and_a_raising_rank_leaves_the_launch_alive(tmp_path):
    """A rank whose target raised abandons its groups by shutting down its TCP connections. Forked with
    the launcher's sockets still open, such a rank once cut the agent's own store connection (seen at
    world 8 on torchtitan_ep: "TCPStore sendBytes failed ... Broken pipe", every later case lost); the
    test above pins that the sockets are detached, this one that the verdicts through raising targets are
    a fresh rank's."""
    args = [*ONE_CASE, "--variant", "replicated", "--target",
            f"{BROKEN}:raise_on_rank1,reference,{BROKEN}:raise_everywhere,reference", "--timeout", "10"]
    forked = run_clipcheck(2, args, tmp_path)
    fresh = run_clipcheck(2, [*args, "--spawn-ranks"], tmp_path)
    verdicts = [(c["target"], c["verdict"], sorted(failed(c))) for c in forked.cases()]
    assert verdicts == [(c["target"], c["verdict"], sorted(failed(c))) for c in fresh.cases()]
    assert [v[:2] for v in verdicts] == [(f"{BROKEN}:raise_on_rank1", "FAIL"), ("reference", "PASS"),
                                         (f"{BROKEN}:raise_everywhere", "FAIL"), ("reference", "PASS")]
    assert forked.returncode == fresh.returncode == 1, forked.stderr
