"""What a rank does once before its cases (harness.run.world.startup): ranks that outnumber the cores run
under SCHED_BATCH, ranks that fit keep the default policy. Each check runs in a child process, so the
test process keeps its own policy."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from harness.run.world.devices import usable_cores
from harness.run.world.startup import share_the_cores

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux only")


def _policy_after(local_ranks: int, answer: "mp.Queue[tuple[bool, int]]") -> None:
    changed = share_the_cores(local_ranks)
    answer.put((changed, os.sched_getscheduler(0)))


def _in_a_child(local_ranks: int) -> tuple[bool, int]:
    ctx = mp.get_context("fork")
    answer: "mp.Queue[tuple[bool, int]]" = ctx.Queue()
    child = ctx.Process(target=_policy_after, args=(local_ranks, answer))
    child.start()
    result = answer.get(timeout=30)
    child.join(timeout=30)
    return result


def test_ranks_that_outnumber_the_cores_run_under_sched_batch():
    cores = usable_cores()
    assert _in_a_child(cores + 1) == (True, os.SCHED_BATCH)


@pytest.mark.parametrize("spare", [0, 1])
def test_ranks_that_fit_the_cores_keep_the_default_policy(spare):
    cores = usable_cores()
    if cores - spare < 1:
        pytest.skip("one core: no world fits with a core to spare")
    assert _in_a_child(cores - spare) == (False, os.sched_getscheduler(0))
