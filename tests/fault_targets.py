"""Clip functions that break the run around them, not the clip: each is the reference clip plus one
fault around the clip that the harness must survive and blame on the right case: child processes,
leaked threads, hangs, exits (tests/test_processes.py, tests/test_never_lie.py and others use them)."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

from harness.reference import clip_grad_norm as reference
from harness.cases.variant import Variant, declared_from_layout
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, Shard, param
from harness.cases.scenario import Scenario, ScenarioOptions
from harness.cases.frameworks import Framework
from harness.cases.target import Target


def half_norm(model, *, max_norm, norm_type=2.0):
    """norm: clips as if the norm were half its size, and reports that half."""
    return reference(model, max_norm=2 * max_norm, norm_type=norm_type) / 2


def slow_reference(model, *, max_norm, norm_type=2.0):
    """The reference after a few seconds' sleep: a run that is still going when a second one starts."""
    time.sleep(float(os.environ.get("CLIPCHECK_TEST_SLEEP", "4")))
    return reference(model, max_norm=max_norm, norm_type=norm_type)


def _sleep_forever() -> None:
    time.sleep(400)


def forks_a_sleeper(model, *, max_norm, norm_type=2.0):
    """contract: forks a child that sleeps 400 s (it holds whatever the rank's parent waits on)."""
    mp.get_context("fork").Process(target=_sleep_forever, daemon=False).start()
    return reference(model, max_norm=max_norm, norm_type=norm_type)


SLEEPER_SECONDS = "400.25"  # an argument no other process on the machine passes: the test looks for exactly it


def spawns_a_sleeper(model, *, max_norm, norm_type=2.0):
    """contract: starts a 400 s `sleep` through subprocess and returns without waiting for it."""
    subprocess.Popen(["sleep", SLEEPER_SECONDS], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return reference(model, max_norm=max_norm, norm_type=norm_type)


def _collectives_in_a_child() -> None:
    for _ in range(3):
        dist.all_reduce(torch.ones(4))
    time.sleep(400)


def forked_child_runs_collectives(model, *, max_norm, norm_type=2.0):
    """contract: forks a child that runs all-reduces on the default group it inherited, then sleeps."""
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    mp.get_context("fork").Process(target=_collectives_in_a_child, daemon=False).start()
    return total


def _leaked_collectives(rounds: int, pause: float) -> None:
    for _ in range(rounds):
        time.sleep(pause)
        try:
            dist.all_reduce(torch.ones(8))
        except Exception:  # noqa: BLE001 - its group may be gone by then; it tries the next one
            pass


def leaks_a_collective_thread(model, *, max_norm, norm_type=2.0):
    """contract: clips right, then leaves a thread that keeps all-reducing on the default group."""
    total = reference(model, max_norm=max_norm, norm_type=norm_type)
    threading.Thread(target=_leaked_collectives, args=(40, 0.25), name="leaked-allreduce", daemon=True).start()
    return total


def raise_on_rank1_while_rank0_waits(model, *, max_norm, norm_type=2.0):
    """hang: rank 1 raises; rank 0 enters a collective that cannot complete without it (a new group,
    which every rank must create), and waits there past every deadline."""
    if dist.get_rank() == 1:
        raise IndexError("no gradient on this rank (as DeepSpeed 0.19.8's inf branch)")
    dist.new_group()
    return reference(model, max_norm=max_norm, norm_type=norm_type)


def exit_on_rank0(model, *, max_norm, norm_type=2.0):
    """crash: the process of rank 0 vanishes mid-case (as a gloo abort does), leaving no reporter."""
    if dist.get_rank() == 0:
        sys.stdout.flush()
        os._exit(134)
    return reference(model, max_norm=max_norm, norm_type=norm_type)


def sleep_forever_on_rank1(model, *, max_norm, norm_type=2.0):
    """hang: rank 1 sleeps (in Python) past every deadline: a run that is busy when it is stopped. With
    CLIPCHECK_TEST_MARKER set, each rank first creates that path plus its rank: it has reached the case."""
    marker = os.environ.get("CLIPCHECK_TEST_MARKER")
    if marker:
        open(f"{marker}{dist.get_rank()}", "w").close()
    if dist.get_rank() == 1:
        time.sleep(3600)
    return reference(model, max_norm=max_norm, norm_type=norm_type)


# -- a scenario whose every case is a SKIP: its one target needs a framework that is never installed ------
NEVER_INSTALLED = Framework("absentfw", "clipcheck_no_such_module_anywhere", None,
                            "it exists only to be missing (tests/fault_targets.py)")


class AbsentFramework(Scenario):
    """One layout, one target, which needs NEVER_INSTALLED: every case a SKIP, nothing judged."""

    name = "absent_fw"
    summary = "a framework that is never installed"
    default_targets = ("absent-clip",)
    targets = {"absent-clip": Target("absent-clip", reference, "needs a framework that is never installed",
                                     origin="tests/fault_targets.py", requires=NEVER_INSTALLED)}

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        layout = Layout(MeshSpec.of(dp=world_size), (param("w", (2 * world_size,), dp=Shard(0)),))
        return [Variant(f"dp={world_size}", layout, Injection(seed=options.seed, dtype=options.dtype),
                        declared_from_layout(layout))]
