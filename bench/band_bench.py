"""Whether torch's own ``clip_grad_norm_`` passes ``harness.audit`` on real jobs at users' sizes.

    python bench/band_bench.py --json rows.json                # every configuration: 1e7, 5e7, 2e8, worlds 2, 4 (long)
    python bench/band_bench.py --params 1e7 --world 2          # one size, one world, every layout and precision
    python bench/band_bench.py --layout tp --world 4 --params 5e7 --precision bf16   # one configuration alone
    python bench/band_bench.py --params 1e6,4e6                # the small sizes it was checked at (about a minute)

Why: the audit judges a norm against a band measured on the job's own gradients (the ``tolerance`` of its
record), because torch's CPU fp32 norm of millions of elements is further off than the analytic fp32
tolerance (docs/reading-a-failure.md, "The band"). Whether torch's own clip, correct by construction on these
layouts, lands inside that band is only known by running it on real layouts at the sizes users train at; a
FAIL here is a band too narrow (or a real torch bug), not a wrong clip.

Each configuration is one real job on CPU ranks (torchrun's elastic agent, gloo, ``OMP_NUM_THREADS=1``):
an MLP of square ``nn.Linear`` layers (bias on, ReLU between) of about ``--params`` logical parameters, its
width the largest of ``WIDTHS`` that gives an even number of layers within 25% of the size (a 2048- or
4096-wide layer at 1e7 and more: what a transformer's projections hold), laid out as

* ``fsdp2``: every layer and the root ``fully_shard``-ed over every rank (DTensor gradients, ``Shard(0)``);
* ``ddp``: ``DistributedDataParallel`` (plain gradients, all-reduced: bit-identical replicas);
* ``hsdp``: ``fully_shard`` on a 2-D mesh ``(replicate 2, shard world/2)`` (world 4 only);
* ``tp``: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` pairs (DTensor gradients:
  ``Shard(0)`` weights and biases, ``Shard(1)`` weights, ``Replicate`` biases); every rank the same batch, as a
  TP group sees it.

in one of three precisions:

* ``fp32``: fp32 parameters, forward and gradients;
* ``bf16``: bf16 parameters (``model.to(torch.bfloat16)``), bf16 forward and gradients;
* ``amp``: fp32 master parameters, forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``, fp32 gradients.

One forward and backward on random data (FSDP2, DDP and HSDP: each rank its own batch), then on every rank
``harness.audit(model, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm), max_norm=max_norm,
norm_type=2.0)``. torch's clip is correct on each layout: on DDP's replicated plain gradients a rank-local norm
is the whole norm; on DTensor gradients (FSDP2, HSDP, TP) torch 2.13 takes each norm as a partial DTensor
reduced over the dims the gradient is sharded on, and returns the total as a ``Replicate`` DTensor (the audit
reads a returned DTensor with ``full_tensor()``).

One row per configuration: verdict, the reported/true ratio of the rank farthest from the truth, the band the
audit judged the norm with, the coefficient applied (below 1: it clipped), and seconds (the job's build,
forward and backward; the audit, the clip's call included). The configurations of one world run in one
launch, one after another (each builds and frees its own model; a mesh is built once per launch and shape);
a rank that fails or hangs ends the run with a non-zero exit naming the configuration (``--timeout`` bounds
each). ``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = ("fsdp2", "ddp", "hsdp", "tp")
PRECISIONS = {
    "fp32": "fp32 params, fp32 forward, fp32 grads",
    "bf16": "bf16 params, bf16 forward, bf16 grads",
    "amp": "fp32 master params, bf16 autocast forward, fp32 grads",
}
WIDTHS = (4096, 2048, 1024, 512, 256, 128)
"""Layer widths tried, widest first: the widest whose even layer count lands within ``SIZE_SLACK`` of the size."""
SIZE_SLACK = 0.25
BATCH = 16
MAX_NORM = 1e-5
"""Below these jobs' norms at every size (0.0085 to 0.0117 at 1e6 and 4e6; under 1e-3 at 5e7 and 2e8, where a
bound of 1e-3 left the coefficient at 1), so that the clip clips and the audit's coefficient check judges a
coefficient below 1 (the ``coef`` column shows it)."""


def shape_for(params: float) -> tuple[int, int]:
    """(width, layers) of the MLP for about ``params`` logical parameters. Even layers: TP pairs a colwise
    layer with a rowwise one; the width as wide as the size allows, since the band grows with a gradient's
    elements (one 4096-wide layer is 16.8M of them)."""
    for width in WIDTHS:
        per_layer = width * width + width
        layers = max(2, 2 * round(params / (2 * per_layer)))
        if abs(layers * per_layer - params) <= SIZE_SLACK * params:
            return width, layers
    width = WIDTHS[-1]
    return width, max(2, 2 * round(params / (2 * (width * width + width))))


def configurations(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The selected configurations, in run order (by world, then size, layout, precision); HSDP at world 4 only."""
    out = []
    for world, params, layout, precision in itertools.product(args.world, args.params, args.layout, args.precision):
        if layout == "hsdp" and world != 4:
            continue
        width, layers = shape_for(params)
        out.append({"layout": layout, "world": world, "params": params, "precision": precision, "width": width,
                    "layers": layers, "logical": layers * (width * width + width)})
    return out


def _label(config: dict[str, Any]) -> str:
    return f"{config['layout']} world {config['world']} {config['params']:.0e} {config['precision']}"


# ---------------------------------------------------------------------------------------------------- ranks


def _mlp(width: int, layers: int) -> Any:
    """The model every layout starts from: square layers, ReLU between (elementwise, so a TP pair's
    colwise-sharded activations need no exchange before the rowwise layer)."""
    import torch
    import torch.nn as nn

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i < len(self.layers) - 1:
                    x = torch.relu(x)
            return x

    torch.manual_seed(0)  # the same full model on every rank: sharding and TP slice it locally, DDP checks it
    return MLP()


_MESHES: dict[tuple[tuple[int, ...], tuple[str, ...]], Any] = {}


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """One DeviceMesh per shape for the whole launch, as a job keeps its mesh. Not one per configuration with
    its groups destroyed after it: meshes of the same ranks and dim names compare equal (``DeviceMesh.__eq__``
    ignores their groups), DTensor's cached sharding decisions then handed the next HSDP configuration the
    dead groups of the last one, and torch's clip raised "Could not resolve the process group"."""
    from torch.distributed.device_mesh import init_device_mesh

    if (shape, names) not in _MESHES:
        _MESHES[shape, names] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[shape, names]


def build(config: dict[str, Any], world: int) -> Any:
    """The model as its layout holds it, after ``fully_shard``, DDP or ``parallelize_module``."""
    import torch

    model = _mlp(config["width"], config["layers"])
    if config["precision"] == "bf16":
        model = model.to(torch.bfloat16)
    layout = config["layout"]
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if layout in ("fsdp2", "hsdp"):
        from torch.distributed.fsdp import fully_shard

        shape, names = ((world,), ("fsdp",)) if layout == "fsdp2" else ((2, world // 2), ("replicate", "shard"))
        mesh = _mesh(shape, names)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if layout == "tp":
        from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel,
                                                       parallelize_module)

        plan: dict[str, ParallelStyle] = {f"layers.{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                                          for i in range(config["layers"])}
        return parallelize_module(model, _mesh((world,), ("tp",)), plan)
    raise ValueError(f"unknown layout {layout!r}")


def backward(model: Any, config: dict[str, Any], rank: int) -> None:
    """One real forward and backward (the layout's own reduce-scatters and all-reduces). A TP group sees one
    batch; data-parallel ranks each their own."""
    import contextlib

    import torch

    torch.manual_seed(100 + (0 if config["layout"] == "tp" else rank))
    dtype = torch.bfloat16 if config["precision"] == "bf16" else torch.float32
    x = torch.randn(BATCH, config["width"], dtype=dtype)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if config["precision"] == "amp" else contextlib.nullcontext()
    with amp:
        out = model(x)
    out.float().pow(2).mean().backward()


def run_one(config: dict[str, Any], world: int, rank: int, max_norm: float) -> tuple[dict[str, Any], bool]:
    """One configuration on this rank: (rank 0's row, whether the job's groups are broken)."""
    import torch
    import torch.distributed as dist

    from harness.auditor import audit  # harness.audit itself (the package exports it lazily: typed here)

    start = time.perf_counter()
    model = build(config, world)
    backward(model, config, rank)
    dist.barrier()
    built = time.perf_counter()
    report = audit(model, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm),
                   max_norm=max_norm, norm_type=2.0)
    audited = time.perf_counter()
    row = dict(config, verdict=report.verdict, step_s=round(built - start, 3), audit_s=round(audited - built, 3))
    record = report.record()
    if record is not None:
        truth = record["true_norm"]  # a JSON number, or a string for inf and nan
        ratios = ([r / truth for r in record["reported"] if isinstance(r, (int, float))]
                  if isinstance(truth, (int, float)) and truth != 0 else [])
        worst = max(ratios, key=lambda r: abs(r - 1), default=None)
        row.update(ratio=worst, tolerance=record["tolerance"], true_norm=truth, reported=record["reported"],
                   coefficient=record["coefficient"], dtype=record["dtype"],
                   failed=[name for name, check in record["checks"].items() if not check["passed"]])
    if report.verdict != "PASS":
        row["text"] = report.describe()
    broken = report.broken
    del model, report
    gc.collect()  # the next configuration's model in this process: free this one's parameters and gradients
    return row, broken


def rank_main(configs_path: str, rows_path: str, max_norm: float, timeout_s: float) -> None:
    """Every configuration of this world in turn; rank 0 appends a start line before each and its row after,
    so the launcher can name the configuration a failed launch died in."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    world, rank = dist.get_world_size(), dist.get_rank()
    configs = json.loads(Path(configs_path).read_text())
    for i, config in enumerate(configs):
        if rank == 0:
            _append(rows_path, {"start": config})
        row, broken = run_one(config, world, rank, max_norm)
        if rank == 0:
            _append(rows_path, row)
            ratio = f"ratio {row['ratio']:.7f} band {row['tolerance']:.2e}" if row.get("ratio") is not None else ""
            print(f"band_bench: [{i + 1}/{len(configs)}] {_label(config)}: {row['verdict']} {ratio} "
                  f"({row['step_s'] + row['audit_s']:.1f} s)", flush=True)
        if broken:
            raise RuntimeError(f"{_label(config)}: a rank hung or died in the clip; the job's process groups "
                               "cannot be trusted, so no later configuration runs")
    dist.barrier()
    dist.destroy_process_group()


def _append(path: str, obj: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(obj) + "\n")


# ------------------------------------------------------------------------------------------------- launcher


def launch(world: int, configs: list[dict[str, Any]], args: argparse.Namespace,
           tmp: str) -> tuple[list[dict[str, Any]], str]:
    """Run one world's configurations under torchrun; (rows, an error message or ""). The launch runs in its
    own session so that a timeout ends torchrun's agent and every rank it started, and nothing else."""
    configs_path = os.path.join(tmp, f"configs{world}.json")
    rows_path = os.path.join(tmp, f"rows{world}.jsonl")
    Path(configs_path).write_text(json.dumps(configs))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", __file__,
           "--rank", configs_path, rows_path, "--max-norm", repr(args.max_norm), "--timeout", repr(args.timeout)]
    limit = 120 + args.timeout * len(configs)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        rc = None
    lines = [json.loads(line) for line in Path(rows_path).read_text().splitlines()] if os.path.exists(rows_path) else []
    rows = [line for line in lines if "start" not in line]
    if rc == 0 and len(rows) == len(configs):
        return rows, ""
    started = [line["start"] for line in lines if "start" in line]
    where = (f"while running {_label(started[-1])}" if len(started) > len(rows) else
             "before the first configuration started" if not started else "after its last configuration")
    why = f"ran past its {limit:.0f} s limit and was ended" if rc is None else f"exited with status {rc}"
    return rows, (f"band_bench: the world-{world} launch {why} {where} "
                  f"({len(rows)} of {len(configs)} configurations done; the failing rank's output is above)")


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\nprecision: " + "; ".join(f"{k} = {v}" for k, v in PRECISIONS.items()))
    print("ratio: reported/true of the rank farthest from the truth; band: the relative tolerance the audit "
          "judged the norm with; coef: the coefficient applied (below 1: clipped)")
    head = (f"{'layout':<6} {'world':>5} {'params':>7} {'logical':>9} {'width x n':>10} {'precision':<9} "
            f"{'verdict':<7} {'ratio':>10} {'|ratio-1|':>9} {'band':>8} {'coef':>8} {'step s':>7} {'audit s':>7}")
    print(head)
    print("-" * len(head))
    for row in rows:
        ratio = row.get("ratio")
        coef = row.get("coefficient")
        print(f"{row['layout']:<6} {row['world']:>5} {row['params']:>7.0e} {row['logical']:>9.3g} "
              f"{str(row['width']) + ' x ' + str(row['layers']):>10} {row['precision']:<9} {row['verdict']:<7} "
              + (f"{ratio:>10.7f} {abs(ratio - 1):>9.2e} " if ratio is not None else f"{'-':>10} {'-':>9} ")
              + (f"{row['tolerance']:>8.2e} " if row.get("tolerance") is not None else f"{'-':>8} ")
              + (f"{coef:>8.4f} " if isinstance(coef, (int, float)) else f"{'-':>8} ")
              + f"{row['step_s']:>7.2f} {row['audit_s']:>7.2f}")
    for row in rows:
        if row["verdict"] != "PASS":
            print(f"\n{_label(row)}: {row['verdict']} (failed checks: {', '.join(row.get('failed', [])) or '-'})")
            print(row.get("text", ""))


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def _choices(allowed: tuple[str, ...] | list[str]) -> Any:
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)} (comma list)")
        return values

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", type=_choices(LAYOUTS), default=list(LAYOUTS), help="comma list (default all)")
    parser.add_argument("--world", type=lambda t: [int(v) for v in t.split(",") if v], default=[2, 4],
                        help="comma list (default 2,4; hsdp runs at 4 only)")
    parser.add_argument("--params", type=_floats, default=[1e7, 5e7, 2e8],
                        help="logical parameters, comma list (default 1e7,5e7,2e8)")
    parser.add_argument("--precision", type=_choices(list(PRECISIONS)), default=list(PRECISIONS),
                        help="comma list of fp32, bf16, amp (default all)")
    parser.add_argument("--max-norm", type=float, default=MAX_NORM, help=f"the clip's bound (default {MAX_NORM:g})")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one configuration may take before its launch is ended (default 900)")
    parser.add_argument("--json", default=None, help="write the rows (a JSON list) to this path")
    parser.add_argument("--rank", nargs=2, metavar=("CONFIGS", "ROWS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args.rank[0], args.rank[1], args.max_norm, args.timeout)
        return
    configs = configurations(args)
    if not configs:
        parser.error("no configuration selected (hsdp runs at world 4 only)")
    rows: list[dict[str, Any]] = []
    error = ""
    with tempfile.TemporaryDirectory(prefix="band_bench") as tmp:
        for world in sorted({c["world"] for c in configs}):
            done, error = launch(world, [c for c in configs if c["world"] == world], args, tmp)
            rows += done
            if error:
                break
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if error:
        print("\n" + error, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
