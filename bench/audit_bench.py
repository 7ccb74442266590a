"""What ``harness.audit`` costs next to one call of the clip it judges, and the memory it takes (issue 31 item 3).

    python bench/audit_bench.py --params 1e9 --world 4         # the issue's size: 1B parameters at world 4
    python bench/audit_bench.py --params 2.5e8 --world 4       # what a shared 2-core machine holds
    python bench/audit_bench.py --job fsdp2 --params 5e7 --world 2   # a user's FSDP2 job, torch's own clip

Starts ``--world`` CPU ranks (torchrun's elastic agent, gloo) holding a model of ``--params`` logical
parameters laid out as a sharded training job holds it: 98% of the parameters sharded (FSDP shards and
EP-local experts: each rank its own quarter, distinct bits) and 2% replicated on every rank (norms, router,
bias-like tensors all-reduced as DDP does: bit-identical copies, which the audit must hash to find), in
tensors of ``--tensor`` elements (fp32). Each rank's gradients are set, then:

* clip: one call of a correct clip (the local sums of squares, by rows of ``ROWS`` elements, with replicas
  weighted 1/world, one all-reduce, ``clip_grads_with_norm_``), the median of ``--repeat`` calls;
* audit: ``harness.audit(model, clip, max_norm=...)`` (no restore: nothing copied), the median of
  ``--repeat`` after a first audit timed apart (it imports the judge and the reporter), and its phases
  (``AuditReport.seconds``); ratio = audit / clip (target: at most 3);
* audit restore: the same with ``restore=True`` (a copy of the gradients kept, the exact coefficient);
* CPU seconds: the same calls in this rank's own CPU time (``time.process_time``), the cost itself on a
  machine whose cores are shared (the wall ratio then measures the scheduler as much as the audit);
* peak memory: each rank's peak resident set during the audit above what it held before it (the
  kernel's high-water mark, reset first through ``/proc/self/clear_refs``), next to its gradients' bytes:
  without ``restore`` well under one copy of the gradients, with it about one copy.

``--job fsdp2`` measures the same on a job as users run it: an MLP of square ``nn.Linear`` layers (width
4096) of ``--params`` parameters, each layer ``fully_shard``-ed over every rank (FSDP2: DTensor
gradients), one real forward and backward (its reduce-scatters), and torch's own
``clip_grad_norm_(model.parameters(), max_norm)`` as the clip.

Rank 0 prints one table and, with ``--json PATH``, writes the figures. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REPLICATED_SHARE = 0.02
ROWS = 1024
"""The clip's norm is taken by rows of this many elements (torch's CPU fp32 norm of one long vector
accumulates sequentially, and at millions of elements it is further off than an fp32 norm may be:
docs/performance.md, "Figures cited by the code"; rows keep it exact)."""


def _rss_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _model(params: float, world: int, rank: int, tensor: int) -> Any:
    import torch
    import torch.nn as nn

    model = nn.Module()
    sharded = int(params * (1 - REPLICATED_SHARE) / world)
    replicated = int(params * REPLICATED_SHARE)
    own = torch.Generator().manual_seed(1000 + rank)
    same = torch.Generator().manual_seed(7)
    for kind, total, generator in (("shard", sharded, own), ("replica", replicated, same)):
        for i in range(math.ceil(total / tensor)):
            n = max(ROWS, min(tensor, total - i * tensor) // ROWS * ROWS)
            p = nn.Parameter(torch.empty(n), requires_grad=True)
            p.grad = torch.randn(n, generator=generator)
            p.replicated = kind == "replica"  # type: ignore[attr-defined]
            model.register_parameter(f"{kind}{i}", p)
    return model


WIDTH = 4096
"""The FSDP2 job's layer width: 16.8M parameters per layer, as a transformer's projections hold them."""


def _fsdp2_job(params: float, world: int) -> Any:
    """A model as an FSDP2 user's job holds it after its backward: square layers sharded over every rank."""
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers = max(1, round(params / (WIDTH * WIDTH + WIDTH)))
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(100 + torch.distributed.get_rank())  # each rank its own batch
    model(torch.randn(8, WIDTH)).pow(2).mean().backward()
    return model


def _torch_clip(model: Any) -> Any:
    import torch

    def clip() -> Any:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 1e30)  # coefficient 1: values unchanged

    return clip


def _clip(model: Any, world: int) -> Any:
    import torch
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.grad is not None]

    weights = torch.tensor([1.0 / world if p.replicated else 1.0 for p in params], dtype=torch.float64)

    def clip() -> float:
        squares = [torch.linalg.vector_norm(p.grad.view(-1, ROWS), dim=1).double().pow(2).sum() for p in params]
        total = (torch.stack(squares) * weights).sum().reshape(1)
        dist.all_reduce(total)
        norm = float(total.sqrt())
        torch.nn.utils.clip_grads_with_norm_(params, 1e30, torch.tensor(norm))  # coefficient 1: values unchanged
        return norm

    return clip


def _timed(fn: Any, repeat: int) -> tuple[float, Any, float, float]:
    """(median wall seconds, the last value, the first call's wall seconds, median CPU seconds of this
    process: what the call itself cost this rank, whatever else the machine's cores were doing)."""
    import torch.distributed as dist

    times, cpu, value = [], [], None
    for _ in range(repeat):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        value = fn()
        cpu.append(time.process_time() - start_cpu)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times), value, times[0], statistics.median(cpu)


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import harness

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    from harness.clipmath import local_tensor

    if args.job == "fsdp2":
        model = _fsdp2_job(args.params, world)
        clip = _torch_clip(model)
    else:
        model = _model(args.params, world, rank, args.tensor)
        clip = _clip(model, world)
    grad_bytes = sum(local_tensor(p.grad).numel() * p.grad.element_size() for p in model.parameters())
    clip_s, _, _, clip_cpu = _timed(clip, args.repeat)
    figures: dict[str, Any] = {"rank": rank, "grad_bytes": grad_bytes, "clip_s": clip_s, "clip_cpu_s": clip_cpu}
    dist.barrier()
    start = time.perf_counter()
    harness.audit(model, clip, max_norm=1e30, blame=False)  # the first of a process imports the judge: apart
    dist.barrier()
    figures["first_s"] = time.perf_counter() - start
    for restore in (False, True):
        key = "restore" if restore else "audit"
        resident = _rss_kib("VmRSS")
        reset = _reset_peak()
        audit_s, report, first_s, audit_cpu = _timed(
            lambda: harness.audit(model, clip, max_norm=1e30, restore=restore, blame=False), args.repeat)
        figures[f"{key}_s"] = audit_s
        figures[f"{key}_first_s"] = first_s
        figures[f"{key}_cpu_s"] = audit_cpu
        figures[f"{key}_peak_extra_bytes"] = (_rss_kib("VmHWM") - resident) * 1024 if reset else None
        figures[f"{key}_phases"] = report.seconds
        figures[f"{key}_verdict"] = report.verdict
        figures[f"{key}_text"] = report.describe()
    every: list[Any] = [None] * world
    dist.all_gather_object(every, figures)
    if rank == 0:
        _report(args, every)
    dist.barrier()
    dist.destroy_process_group()


def _report(args: argparse.Namespace, every: list[dict[str, Any]]) -> None:
    clip_s = max(f["clip_s"] for f in every)
    audit_s = max(f["audit_s"] for f in every)
    restore_s = max(f["restore_s"] for f in every)
    grads = max(f["grad_bytes"] for f in every)
    gib = 1 << 30
    shape = (f"an FSDP2 MLP of width {WIDTH}, torch's clip_grad_norm_" if args.job == "fsdp2" else
             f"tensors of {args.tensor}")
    print(f"audit_bench: {args.params:.3g} parameters at world {args.world} (CPU, gloo, fp32, {shape}); "
          f"gradients per rank {grads / gib:.2f} GiB")
    print(f"  one clip call      {clip_s:8.3f} s")
    first_s = max(f["first_s"] for f in every)
    print(f"  audit              {audit_s:8.3f} s   ratio {audit_s / clip_s:5.2f} (target <= 3)   "
          f"verdict {every[0]['audit_verdict']}; the first audit of the process (imports) {first_s:.3f} s")
    print(f"  audit restore=True {restore_s:8.3f} s   ratio {restore_s / clip_s:5.2f}")
    cpu = {key: statistics.median(f[f"{key}_cpu_s"] for f in every) for key in ("clip", "audit", "restore")}
    print(f"  CPU seconds per rank (median over ranks): clip {cpu['clip']:.3f}, audit {cpu['audit']:.3f} "
          f"(ratio {cpu['audit'] / cpu['clip']:.2f}), restore=True {cpu['restore']:.3f} "
          f"(ratio {cpu['restore'] / cpu['clip']:.2f})")
    for key in ("audit", "restore"):
        if every[0][f"{key}_verdict"] != "PASS":
            print(every[0][f"{key}_text"])
    for key in ("audit", "restore"):
        phases = {k: max(f[f"{key}_phases"].get(k, 0.0) for f in every) for k in every[0][f"{key}_phases"]}
        print(f"  {key} phases (slowest rank, last run): " + ", ".join(f"{k} {v:.3f} s" for k, v in phases.items()))
    for key, what in (("audit", "audit"), ("restore", "audit restore=True")):
        peaks = [f[f"{key}_peak_extra_bytes"] for f in every]
        if all(p is not None for p in peaks):
            worst = max(peaks)
            print(f"  peak memory above the job, {what}: {worst / gib:.3f} GiB per rank "
                  f"({worst / grads:.1%} of its gradients)")
    if args.json:
        Path(args.json).write_text(json.dumps({"params": args.params, "world": args.world, "tensor": args.tensor,
                                               "ranks": every}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=1e9, help="logical parameters (default 1e9)")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--tensor", type=int, default=1 << 22, help="elements per parameter tensor")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--job", choices=("synthetic", "fsdp2"), default="synthetic",
                        help="synthetic: sharded and replicated tensors, a hand-written clip (default); "
                             "fsdp2: an FSDP2 MLP and torch's own clip")
    parser.add_argument("--json", default=None)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world}",
           __file__, "--rank", "--params", str(args.params), "--world", str(args.world), "--tensor", str(args.tensor),
           "--repeat", str(args.repeat), "--job", args.job] + (["--json", args.json] if args.json else [])
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
