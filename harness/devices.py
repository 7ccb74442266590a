"""Which accelerator a world may use: the decisions, kept apart from torch so they can be tested on
machines without GPUs (every CI runner here) and shared by the matrix, fuzz, ``check`` and the plugin.

* a world of N ranks on nccl needs N visible GPUs (one per rank): fewer is a skip with that reason,
  never a hang or a crash halfway through a launch;
* nccl without CUDA is a skip (the plugin, the matrix) or bad input (a single run asked for it);
* under pytest-xdist each worker gets its own slice of the GPUs (``CUDA_VISIBLE_DEVICES``), as
  DeepSpeed's test suite does, so two workers' worlds never share a device.
"""

from __future__ import annotations

import os
from typing import Any


def accelerator_for(device: Any) -> str:
    """"cuda" or "cpu": what a framework adapter must allocate on, decided by the world's device (the
    one the gradients live on), never by ``torch.cuda.is_available()``: a gloo world on a GPU machine
    has CPU gradients."""
    return "cuda" if getattr(device, "type", str(device)) == "cuda" else "cpu"


def cuda_device_count() -> int:
    """Visible CUDA devices (0 without CUDA); imports torch only when asked."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def world_skip_reason(world_size: int, backend: str, devices: int) -> str | None:
    """Why a world of ``world_size`` ranks cannot run on ``backend`` with ``devices`` GPUs, or None."""
    if backend != "nccl":
        return None
    if devices == 0:
        return "backend nccl needs CUDA, and no CUDA device is visible here"
    if world_size > devices:
        return f"world size {world_size} on nccl needs {world_size} GPUs (one per rank), {devices} visible"
    return None


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
