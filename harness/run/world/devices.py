"""Which accelerator a world may use: the decisions, kept apart from torch so they can be tested on
machines without GPUs (every CI runner here) and shared by the matrix, fuzz, ``check`` and the plugin.

* a world of N ranks on nccl needs N visible GPUs (one per rank): fewer is a skip with that reason,
  never a hang or a crash halfway through a launch;
* nccl without CUDA is a skip (the plugin, the matrix) or bad input (a single run asked for it);
* under pytest-xdist each worker gets its own slice of the GPUs (``CUDA_VISIBLE_DEVICES``), as
  DeepSpeed's test suite does, so two workers' worlds never share a device;
* NCCL's errors are made synchronous, and GPU work is settled inside the guard (see below), so the
  failure path built for gloo (abandon, agree through the store, a fresh generation) holds on nccl.

How a failure travels on nccl. NCCL reports errors asynchronously: a collective returns at once,
and by default a watchdog thread finds a timed-out one later and kills the process (torch's
``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``), which would turn one broken case into a dead rank with no
report. The harness therefore sets, before its first NCCL group:

* ``TORCH_NCCL_BLOCKING_WAIT=1``: every ``wait()`` (each synchronous collective, each functional
  collective's ``wait_tensor``) blocks the CPU, and on the group's timeout aborts that communicator
  and raises in the caller: the same per-case exception gloo raises, caught by the guard, so the
  rank abandons its groups (``ncclCommAbort`` of every group) and every rank builds a fresh
  generation (new communicators on a new store prefix) for the next case;
* ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up only): should a watchdog run anyway, it may abort
  communicators but never kill the process, so our reporter lives to write the record;
* ``settle``: after the target returns, still inside the watched guard, the harness waits for the
  GPU work it queued (``torch.cuda.synchronize``). Work the target never waited for (``async_op=True``,
  a kernel behind an unmatched collective) is thus attributed to the target's case: it finishes, or
  raises there, or blocks until the watchdog reports a hang naming the rank and this stack; a hang
  ends the launch (a stuck kernel cannot be cancelled) and ``clipcheck run`` / ``matrix`` resume
  with a fresh one at the next case, exactly as for a Python-level hang on gloo.

Agreement on what went wrong never uses NCCL: it goes through the rendezvous store (TCP), on both
backends. Peers blocked in a collective with a rank that raised are not released at once as on gloo
(where the harness shuts the rank's TCP connections): they raise at their group timeout.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

NCCL_ERROR_SETTINGS: dict[str, str] = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
"""What the failure path needs of ProcessGroupNCCL (read when a group is created): errors raised
synchronously in the caller, and a process never killed by NCCL's watchdog. They override a user's
own values: the judge's failure path depends on them, a clip function's correctness does not."""


def accelerator_for(device: Any) -> str:
    """"cuda" or "cpu": what a framework adapter must allocate on, decided by the world's device (the
    one the gradients live on), never by ``torch.cuda.is_available()``: a gloo world on a GPU machine
    has CPU gradients."""
    return "cuda" if getattr(device, "type", str(device)) == "cuda" else "cpu"


def cuda_device_count() -> int:
    """Visible CUDA devices (0 without CUDA); imports torch only when asked."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


RANKS_PER_CORE = 4
MAX_LOCAL_RANKS = 64


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def max_local_ranks(cores: int) -> int:
    """How many ranks one machine with ``cores`` usable cores is asked to run at most: four per core
    (``RANKS_PER_CORE``), never fewer than 8 nor more than 64. Every rank is a process that takes its
    turn on the cores in each collective, so past a few per core a launch only thrashes (what ran and
    what did not: docs/performance.md, "Figures cited by the code")."""
    return min(MAX_LOCAL_RANKS, max(8, RANKS_PER_CORE * cores))


def world_skip_reason(world_size: int, backend: str, devices: int, cores: int | None = None) -> str | None:
    """Why a world of ``world_size`` ranks on this machine cannot run on ``backend`` with ``devices``
    GPUs and ``cores`` usable cores (this process's, by default), or None."""
    cap = max_local_ranks(usable_cores() if cores is None else cores)
    if world_size > cap:
        return (f"world size {world_size}: this machine runs at most {cap} ranks ({RANKS_PER_CORE} per usable core, "
                f"at least 8, at most {MAX_LOCAL_RANKS})")
    if backend != "nccl":
        return None
    if devices == 0:
        return "backend nccl needs CUDA, and no CUDA device is visible here"
    if world_size > devices:
        return f"world size {world_size} on nccl needs {world_size} GPUs (one per rank), {devices} visible"
    return None


def world_problem(world_size: int, backend: str) -> str | None:
    """``world_skip_reason`` on this machine: GPUs are counted (torch imported) only for nccl."""
    return world_skip_reason(world_size, backend, cuda_device_count() if backend == "nccl" else 0)


def nccl_error_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``NCCL_ERROR_SETTINGS`` that ``environ`` lacks or sets otherwise."""
    return {k: v for k, v in NCCL_ERROR_SETTINGS.items() if environ.get(k) != v}


def settle(device: Any) -> None:
    """Wait for the GPU work queued so far on ``device`` (a no-op on CPU). Called inside the target's
    guard, so work the target left in flight fails, or hangs, in the target's own case."""
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize(device)


def worker_visible_devices(worker: int, workers: int, devices: int, visible: str | None = None) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for xdist worker ``worker`` of ``workers``: a contiguous, disjoint
    share of the ``devices`` visible GPUs (of the ids in ``visible`` when that is already set); None
    when there is nothing to split. With more workers than GPUs, workers share GPUs round-robin."""
    if devices <= 0 or workers <= 1:
        return None
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(devices)]
    ids = ids[:devices]
    share = max(1, len(ids) // workers)
    start = (worker * share) % len(ids)
    return ",".join(ids[(start + i) % len(ids)] for i in range(share))


def xdist_worker() -> tuple[int, int] | None:
    """(index, count) of this pytest-xdist worker, from the environment xdist sets; None outside xdist."""
    name, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (name.startswith("gw") and name[2:].isdigit() and count.isdigit()):
        return None
    return int(name[2:]), int(count)
