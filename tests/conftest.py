"""Fixtures shared by the test modules: torchrun launches that several modules read."""

import os

import pytest

# one intra-op thread in every process the suite starts (the warm pools' ranks, the launches' ranks): it
# runs dozens of rank processes on a few cores, where OpenMP's spinning threads only take turns from them
os.environ.setdefault("OMP_NUM_THREADS", "1")

from harness_runs import run_clipcheck
from process_guard import _failed_tests_leave_no_process, pytest_runtest_makereport  # noqa: F401  (registered here)


@pytest.fixture(scope="session")
def deepspeed_world2(tmp_path_factory):
    """The deepspeed_autoep scenario at world 2, fp32 and bf16, with every default target: the
    DeepSpeed-style models, the repair, the real DeepSpeed (where installed) and the reference."""
    return run_clipcheck(2, ["--scenario", "deepspeed_autoep", "--dtype", "fp32,bf16"], tmp_path_factory.mktemp("ds"))


@pytest.fixture(scope="session")
def world4(request):
    """A warm world of 4 ranks for the fuzz, catalogue and blame tests (one start for all of them)."""
    from harness.run.hosts.pool import RankPool

    pool = RankPool(4, timeout_s=30)
    request.addfinalizer(pool.close)
    return pool
