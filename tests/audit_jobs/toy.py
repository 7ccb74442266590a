"""A user's training step in miniature, audited by ``harness.audit`` (run by tests/test_audit.py under torchrun).

Every rank holds a dense MLP (all-reduced like DDP: replicas), an expert of its own (expert parallel: a
plain tensor named alike on every rank, different on each), and the first and last rank hold an embedding
and an output head tied to it (as pipeline stages do: all-reduced between the two, so bit-identical under
two names). One real forward and backward, then the audit of one of these clips:

* ``correct``: each logical gradient once (dense on rank 0 only, each expert, the tie on the first rank);
* ``local``: ``torch.nn.utils.clip_grad_norm_`` on the rank's own parameters (no cross-rank reduction);
* ``tied-twice``: correct but for the tie, counted on both ranks that hold it;
* ``biases-twice``: correct but for the dense layers' biases, counted on the first two ranks (a small group);
* ``raise``: raises on rank 1 before its all-reduce (the other ranks wait for it in the collective);
* ``silent``: clips correctly but returns nothing (the norm is read from the coefficient);
* ``hang``: rank 1 never reaches its all-reduce (it sleeps), the others wait for it there.

    torchrun --nproc_per_node=4 tests/audit_jobs/toy.py MODE OUT.json [restore] [save=PATH] [cuda] [bf16]

``cuda``: nccl, the model and its gradients on this rank's GPU (``bench/gpu_check.sh``); gloo on CPU otherwise.
``bf16``: the model, and so its gradients, in bf16.

Rank 0 writes what the audit found (the case record, the text, whether every rank's gradients came back
bit for bit with ``restore``) to OUT.json.
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import harness
from harness.run.case.measure import linear_digest

MAX_NORM = 0.01


class Toy(nn.Module):
    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        torch.manual_seed(100 + rank)
        self.expert = nn.Linear(8, 8, bias=False)
        torch.manual_seed(7)
        table = torch.randn(10, 8)
        if rank == 0:
            self.embed = nn.Parameter(table.clone())
        if rank == world - 1:
            self.head = nn.Parameter(table.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.expert(self.dense(x))
        out = h.pow(2).mean()
        for name in ("embed", "head"):
            if hasattr(self, name):
                out = out + (getattr(self, name) * h[:10]).sum()
        return out


def step(model: Toy, rank: int, world: int, device: torch.device) -> None:
    torch.manual_seed(1000 + rank)  # each rank its own batch
    model(torch.randn(16, 8).to(device, next(model.parameters()).dtype)).backward()
    for p in model.dense.parameters():  # DDP's all-reduce: replicas
        dist.all_reduce(p.grad)
        p.grad /= world
    tie = torch.zeros(10, 8, device=device)  # the embedding group's all-reduce between the first and the last stage
    for name in ("embed", "head"):
        if hasattr(model, name):
            tie += getattr(model, name).grad
    dist.all_reduce(tie)
    for name in ("embed", "head"):
        if hasattr(model, name):
            getattr(model, name).grad.copy_(tie)


def make_clip(model: Toy, mode: str, rank: int, world: int, device: torch.device):
    def squares(params) -> float:
        return sum(float(p.grad.double().pow(2).sum()) for p in params)

    def reduced(tied_on_every_holder: bool, biases_twice: bool = False) -> float:
        part = squares(model.expert.parameters())
        if rank == 0:
            part += squares(model.dense.parameters())
        if rank == 1 and biases_twice:
            part += squares([p for n, p in model.dense.named_parameters() if n.endswith("bias")])
        for name in ("embed", "head"):
            if hasattr(model, name) and (tied_on_every_holder or name == "embed"):
                part += squares([getattr(model, name)])
        total = torch.tensor([part], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        norm = math.sqrt(float(total))
        coefficient = min(1.0, MAX_NORM / (norm + 1e-6))
        for p in model.parameters():
            p.grad.mul_(coefficient)
        return norm

    if mode == "local":
        return lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    if mode == "correct":
        return lambda: reduced(False)
    if mode == "tied-twice":
        return lambda: reduced(True)
    if mode == "biases-twice":
        return lambda: reduced(False, biases_twice=True)
    if mode == "silent":
        return lambda: (reduced(False), None)[1]
    if mode == "hang":
        def stuck() -> float:
            if rank == 1:
                time.sleep(3600)
            return reduced(False)
        return stuck
    if mode == "raise":
        def clip() -> float:
            if rank == 1:
                raise RuntimeError("this rank's clip gave up")
            return reduced(False)
        return clip
    raise SystemExit(f"unknown mode {mode}")


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    options = sys.argv[3:]
    cuda = "cuda" in options
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = Toy(rank, world).to(device, torch.bfloat16 if "bf16" in options else torch.float32)
    step(model, rank, world, device)
    before = {n: linear_digest(p.grad) for n, p in model.named_parameters()}
    report = harness.audit(model, make_clip(model, mode, rank, world, device), max_norm=MAX_NORM,
                           restore="restore" in options, timeout_s=3.0)
    after = {n: linear_digest(p.grad) for n, p in model.named_parameters()}
    kept = [None] * world
    dist.all_gather_object(kept, before == after)
    for option in options:
        if option.startswith("save="):
            report.save(option[len("save="):])
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"record": report.record(), "text": report.describe(), "passed": report.passed,
                       "verdict": report.verdict, "restored": all(kept), "notes": report.notes}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
