"""Scenarios whose own work hangs or dies on rank 1 (the harness's phases, not the function under test):
the case must end as a hang that names the phase and the rank's stack, within the case's bound, or as a
crash that names the phase the rank died in.

``HANG_ONCE_ENV`` names a file: the first rank 1 to reach the phase creates it and hangs; later
launches find it and go on (a hang the relaunch gets past). Without it, every launch hangs there.
``HANG_NATIVE_ENV`` set: the hang is a native wait that holds no Python frame of its own (a C-level
lock, as a deadlocked thread pool is), else a plain sleep."""

from __future__ import annotations

import os
import signal
import threading
import time

import harness.targets.builtin_scenarios  # noqa: F401  (maps harness.scenarios in a checkout)
from harness.scenarios.dense_dp import DenseDP

HANG_ONCE_ENV = "CLIPCHECK_TEST_HANG_ONCE"
HANG_NATIVE_ENV = "CLIPCHECK_TEST_HANG_NATIVE"


def _hang_on_rank_one(rank: int) -> None:
    if rank != 1:
        return
    once = os.environ.get(HANG_ONCE_ENV)
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL))
        except FileExistsError:  # an earlier launch hung here: this one goes on
            return
    if os.environ.get(HANG_NATIVE_ENV):
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # never released: blocked in C, the GIL released, as a deadlock in a library is
    while True:
        time.sleep(3600)


class HangInBuild(DenseDP):
    name = "hang_in_build"

    def build_model(self, variant, rank, device, mesh):
        _hang_on_rank_one(rank)
        return super().build_model(variant, rank, device, mesh)


class HangInInject(DenseDP):
    name = "hang_in_inject"

    def inject(self, model, variant, rank):
        _hang_on_rank_one(rank)
        super().inject(model, variant, rank)


class DieInBuild(DenseDP):
    name = "die_in_build"

    def build_model(self, variant, rank, device, mesh):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().build_model(variant, rank, device, mesh)
