"""The failure path on nccl, on real GPUs (``-m gpu``; skipped with the reason elsewhere).

Each of these is the nccl twin of a gloo test in test_robustness.py: a fault in the function under
test fails its own case, naming the rank, in bounded time, and the next case runs. On nccl they
exercise what CPU cannot: errors raised synchronously by ``TORCH_NCCL_BLOCKING_WAIT``, the abort of
every communicator and a fresh generation, and a kernel left in flight caught at the device settle
(harness/run/world/devices.py). ``bench/gpu_check.sh`` runs them.
"""

from __future__ import annotations

import time

import pytest

from harness.run.world.devices import cuda_device_count
from harness_runs import run_clipcheck

BROKEN = "tests/broken_targets.py"
ONE_CASE = ["--scenario", "dense_dp", "--dtype", "fp32", "--norm-type", "2", "--clip-ratio", "0.5",
            "--variant", "replicated", "--backend", "nccl", "--timeout", "5"]

pytestmark = [pytest.mark.gpu, pytest.mark.distributed,
              pytest.mark.skipif(cuda_device_count() < 2, reason="needs 2 CUDA devices (nccl failure path)")]


@pytest.mark.parametrize("name, check, rank, status", [
    ("raise_on_rank1", "raised", 1, 1),             # rank 0 in the all-reduce raises at its timeout
    ("skip_collective_on_rank1", "raised", 0, 1),   # nobody raises at once: the blocking wait does
    ("unwaited_collective_on_rank0", "hang", 0, 3),  # a kernel in flight: caught at the settle
    ("exit_on_rank1", "crash", 1, 3),
])
def test_a_fault_on_nccl_fails_its_own_case_and_the_next_case_runs(tmp_path, name, check, rank, status):
    start = time.monotonic()
    run = run_clipcheck(2, [*ONE_CASE, "--target", f"{BROKEN}:{name},reference"], tmp_path, timeout=240)
    broken, after = run.cases()
    failed = {n for n, c in broken["checks"].items() if not c["passed"]}
    assert check in failed, broken["checks"]
    assert f"rank {rank}" in broken["checks"][check]["detail"] or check == "raised", broken["checks"][check]
    assert after["verdict"] == "PASS", after["checks"]  # a fresh generation (or launch) on nccl
    assert run.returncode == status, run.stderr[-2000:]
    assert time.monotonic() - start < 120
