"""What a rank does once, before its first case, however it was started (a fresh interpreter under
torchrun, or forked from ``clipcheck run``'s launcher: ``commands.forked``)."""

from __future__ import annotations

import gc
import importlib
import os
import sys

import torch

from harness.run.world.devices import usable_cores
from harness.run.world.openmp import rank_threads
from harness.plan.planner import Plan


def share_the_cores(local_ranks: int) -> bool:
    """With more ranks on this machine than cores it may use, put this rank under ``SCHED_BATCH``
    (Linux): the scheduler then lets a running rank finish its time slice instead of switching to
    every rank a message wakes. Cases on oversubscribed cores are a sequence of short collectives
    and store rounds that wake several ranks each; the switches were what was left to cut. It pays
    only when ranks outnumber the cores, so a world that fits the cores keeps the default policy
    (docs/performance.md, "Where it stands", item 6). Nothing the clip function computes depends on
    it. Returns whether the policy was set."""
    if local_ranks <= usable_cores() or not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError:  # a sandbox that forbids it: the default policy is only slower
        return False
    return True


def settle_startup(plan: Plan) -> None:
    """Before the first case: the intra-op thread count ``OMP_NUM_THREADS`` asks for (``openmp.rank_threads``,
    however the rank was started), import the plan's frameworks (a no-op in a rank forked from a launcher
    that preloaded them), then move every object alive now (torch, the frameworks, the plan) into the
    collector's permanent generation. A full collection walks every tracked object, and with the
    frameworks loaded those are many: each rank pays that walk whenever Python's own schedule or a
    framework (ColossalAI's plugin destructor) asks for a collection; after the freeze it walks only
    what the cases allocate (the object count and the cost of one collection: docs/performance.md,
    "Where it stands", item 2). Those objects live as long as the process anyway."""
    torch.set_num_threads(rank_threads(os.environ))  # a forked rank has its launcher's count otherwise
    preload_frameworks(plan)
    gc.freeze()


def preload_frameworks(plan: Plan, log: str | None = None) -> None:
    """Import torch._dynamo and the framework of every planned target that needs one (and is installed):
    in a launcher, so that the forked ranks share the import instead of each repeating it in its first call. A
    framework whose import fails is left to the ranks, where the failure is the case's own. ``log``:
    a file for what the imports print (warnings, banners), instead of this process's output."""
    if log is None:
        _import_frameworks(plan)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(log, "a", encoding="utf-8") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            try:
                _import_frameworks(plan)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _import_frameworks(plan: Plan) -> None:
    try:  # the first DTensor a rank builds imports torch._dynamo: once, before the forks (its cost:
        # docs/performance.md, "Figures cited by the code")
        importlib.import_module("torch._dynamo")
    except Exception:  # noqa: BLE001 - a rank imports it again where it needs it, and reports what happens
        pass
    for target in plan.targets.values():
        framework = target.requires
        if framework is None or framework.unavailable() is not None:
            continue
        try:
            importlib.import_module(framework.probe)
        except Exception:  # noqa: BLE001 - the ranks import it again and report what happens there
            pass
