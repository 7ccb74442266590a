"""A job over two nodes (two torchrun agents on this machine, c10d rendezvous on loopback) ends the same
way on both, in bounded time, with rank 0's exit status.

Every rank leaves with rank 0's status (``DistWorld.leave_together``). Without it, rank 0's node judges
the matrix and exits 1 while the other node's ranks exit 0: that node's agent then waits 300 s in
torchelastic's exit barrier for a store that has gone with the first agent, and aborts, or exits 0, a
success on a failing job (the rendezvous, not ``--node_rank``, decides which node holds global rank 0)."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from harness_runs import jsonl, start_harness

pytestmark = pytest.mark.distributed

BROKEN = "tests/broken_targets.py"
ONE_CASE = ["--scenario", "dense_dp", "--dtype", "fp32", "--norm-type", "2", "--clip-ratio", "0.5", "--variant",
            "replicated"]
BOUND_S = 240  # well short of torchelastic's 300 s exit barrier


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(targets: str, results) -> list[tuple[int, float, str]]:
    port = _free_port()
    nodes = []
    for node in (0, 1):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                    "--nproc_per_node=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                    "--max_restarts=0", "-m", "harness"]
        nodes.append(start_harness([*ONE_CASE, "--target", targets, "--timeout", "30", "--json", str(results)],
                                   launcher))
    start, ended = time.monotonic(), []
    try:
        for proc in nodes:
            out, err = proc.communicate(timeout=BOUND_S + 120)
            ended.append((proc.returncode, time.monotonic() - start, out + err[-3000:]))
    finally:
        for proc in nodes:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    return ended


@pytest.mark.parametrize("targets, fails", [(f"reference,{BROKEN}:norm_off", True), ("reference", False)])
def test_both_nodes_of_a_job_end_alike_and_in_bounded_time(tmp_path, targets, fails):
    results = tmp_path / "results.jsonl"
    ended = _two_nodes(targets, results)
    codes = [code for code, _, _ in ended]
    assert all(seconds < BOUND_S for _, seconds, _ in ended), [(c, s) for c, s, _ in ended]
    if fails:
        assert all(code != 0 for code in codes), ended
    else:
        assert codes == [0, 0], ended
    records = jsonl(results)
    summary = records[-1]
    assert summary["type"] == "summary" and summary["cases"] == len(targets.split(","))
    assert summary["status"] == (1 if fails else 0)
