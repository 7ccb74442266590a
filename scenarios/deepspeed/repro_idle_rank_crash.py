"""DeepSpeed's fp32 ``clip_grad_norm_`` on a rank that holds no gradient at all.

A custom training loop (no engine) clips with ``deepspeed.runtime.utils.clip_grad_norm_`` (mpu=None).
Every rank owns its experts (marked the way ``deepspeed.moe`` marks them), the dense part is frozen,
and the experts of the last rank got no tokens this step, so none of its parameters has a gradient:

* L2: the idle rank all-reduces a zero norm with the others (the mean of per-rank norms) and then
  raises ``IndexError`` at ``parameters[0].device``; the healthy ranks return the mean of norms with a
  zero in it (at world 2, half the true norm) and carry on, one collective ahead of the idle rank;
* inf: the idle rank raises ``RuntimeError`` at ``torch.stack`` of an empty list before the all-reduce;
  the healthy ranks block in that all-reduce for as long as the idle rank's process lives, up to the
  timeout of DeepSpeed's data-parallel group (a clone of the world group made by ``new_group`` without
  a timeout: torch's default, 30 minutes, whatever ``init_distributed`` was given). Here the idle rank
  lives on until rank 0 has waited ``WAIT_S`` seconds; where the error ends its process instead, its
  exit closes the gloo connections and the healthy ranks raise at once (torchrun then stops the job).

Who reaches it: direct-call only. ``DeepSpeedEngine``'s backward gives every trainable parameter without
a gradient a zero one before its clip, so the engine's own path never meets an empty list.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 scenarios/deepspeed/repro_idle_rank_crash.py

Last line on rank 0: ``l2_idle=<what the idle rank raised> l2_ratio=<healthy rank's norm / true>
inf_idle=<what the idle rank raised> inf_healthy=<blocked>=5s, or what rank 0 met>``.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import tempfile
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

NUM_LOCAL_EXPERTS, WIDTH, WAIT_S = 2, 8, 5


def attempt(fn: Callable[[], object]) -> str:
    try:
        fn()
        return "returned"
    except Exception as exc:  # what DeepSpeed raised is the outcome
        return type(exc).__name__


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    importlib.import_module("deepspeed.comm.torch")
    # DeepSpeed's CPU shared-memory comm op (a fast path this script does not use) would be JIT-built first
    setattr(sys.modules["deepspeed.comm.torch"], "build_shm_op", lambda: None)
    import deepspeed
    from deepspeed.runtime.utils import clip_grad_norm_
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # outcomes travel through a file store: the process group itself is broken after the inf case
    path = [os.path.join(tempfile.gettempdir(), f"ds-idle-rank-{os.getpid()}-{time.time_ns()}")]
    dist.broadcast_object_list(path, src=0)
    store = dist.FileStore(path[0], world)
    groups._get_data_parallel_group()  # built on first use (a collective); the engine builds it at init too
    idle = rank == world - 1

    dense = nn.Linear(WIDTH, WIDTH, bias=False).requires_grad_(False)  # frozen
    experts = [nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(NUM_LOCAL_EXPERTS)]
    for expert in experts:
        for p in expert.parameters():  # as deepspeed.moe.experts.Experts marks them
            p.allreduce = False  # type: ignore[attr-defined]
            p.group_name = f"ep_size_{world}"  # type: ignore[attr-defined]
    params = list(dense.parameters()) + [p for e in experts for p in e.parameters()]

    def backward() -> None:
        for p in params:
            p.grad = None
        if not idle:  # the idle rank's experts got no tokens: nothing ran, nothing has a gradient
            torch.manual_seed(rank)
            x = dense(torch.randn(4, WIDTH))
            sum(e(x).pow(2).sum() for e in experts).backward()

    backward()
    true = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None))
    reported: list[float] = []
    l2 = attempt(lambda: reported.append(float(clip_grad_norm_(params, max_norm=1.0, norm_type=2))))
    store.set(f"l2-{rank}", f"{l2} {reported[0] if reported else 'nan'} {true}")

    backward()
    outcome_inf: list[str] = []
    call = threading.Thread(daemon=True, target=lambda: outcome_inf.append(
        attempt(lambda: clip_grad_norm_(params, max_norm=1.0, norm_type=float("inf")))))
    call.start()
    call.join(WAIT_S)
    inf = outcome_inf[0] if outcome_inf else f"blocked>={WAIT_S}s"
    store.set(f"inf-{rank}", inf)
    print(f"rank {rank}{' (idle)' if idle else ''}: L2 -> {l2}, inf -> {inf}", flush=True)
    if idle:  # a process that lives on after the error (its exit would close the connections at once)
        store.get("inf-0")
        store.set("idle-done", "1")
    if rank == 0:
        outcome = {r: store.get(f"l2-{r}").decode().split() for r in range(world)}
        trues = [float(outcome[r][2]) for r in range(world)]  # each rank's own experts, counted once
        l2_ratio = float(outcome[0][1]) / math.sqrt(sum(t * t for t in trues))
        idle_inf = store.get(f"inf-{world - 1}").decode()
        print(f"l2_idle={outcome[world - 1][0]} l2_ratio={l2_ratio:.6f} inf_idle={idle_inf} inf_healthy={inf}",
              flush=True)
        store.get("idle-done")
        os.remove(path[0])
    os._exit(0)  # the process group is broken after the inf case: leave without tearing it down


if __name__ == "__main__":
    main()
