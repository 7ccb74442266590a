"""torchtune #2420 through the recipe itself: ``full_finetune_distributed`` with tensor parallelism and
``clip_grad_norm`` set raises at its clip.

What it shows: torchtune 0.6.1's ``base_llama_tp_plan()`` (the ``tensor_parallel_plan`` of its shipped
``llama3*/70B_full`` configs) shards the embeddings, projections and output but not the RMSNorm scales.
With ``data_parallel = 1`` the norms stay plain tensors next to DTensor projections, and the recipe's
``torch.nn.utils.clip_grad_norm_(self._model.parameters(), max_norm)`` raises ``aten._foreach_norm.Scalar
got mixed torch.Tensor and DTensor`` (torchtune #2420); with FSDP too (``data_parallel > 1``) the norms
become 1-D DTensors on ``dp`` next to 2-D ``(dp, tp)`` ones and torch's ``stack`` of the per-mesh norms
raises (torch #180346). Every rank raises before clipping anything, so the true norm is still there to
gather.

Who reaches it (stock): ``tune run --nproc_per_node N full_finetune_distributed --config
llama3_3/70B_full tensor_parallel_dim=N clip_grad_norm=1.0`` (or ``tensor_parallel_dim=N/2`` with FSDP).
Here: the recipe's own class (``FullFinetuneRecipeDistributed``: ``__init__``, ``setup``, ``train``)
with that config on CPU (gloo): a tiny ``llama3`` checkpoint written by each rank, a tokenizer and
dataset defined below (the recipe instantiates them from the config), one training step. CPU shims,
off the gradient path: the recipe logs rank 0's memory after building the model and empties the
device cache before training, and on CPU ``training.get_memory_stats`` raises and
``training.cleanup_before_training`` calls what ``torch.cpu`` lacks: there they return zeros and only
collect garbage.

    torchrun --nproc_per_node=2 scenarios/torchtune/repro_tp_plain_norms.py          # dp=1 tp=2
    torchrun --nproc_per_node=4 scenarios/torchtune/repro_tp_plain_norms.py --dp 2   # dp=2 tp=2

The last line on rank 0: ``reported=raised true=<norm> error=<the exception>``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import sys
import tempfile
from typing import Any

MODEL = dict(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=16, max_seq_len=64,
             intermediate_dim=32)


class TinyTokenizer:
    """What the recipe reads of a tokenizer: ``pad_id`` (its collate pads with it)."""

    pad_id = 0
    max_seq_len = 64


def tiny_dataset(tokenizer: TinyTokenizer) -> list[dict[str, list[int]]]:
    """Eight fixed token sequences (the recipe's ``dataset`` component, called with the tokenizer)."""
    return [{"tokens": [(7 * i + 3 * j) % 63 + 1 for j in range(12)],
             "labels": [(7 * i + 3 * j) % 63 + 1 for j in range(12)]} for i in range(8)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (FSDP when > 1)")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import torchtune
    from omegaconf import OmegaConf
    from torch.distributed.tensor import DTensor
    from torchtune.models.llama3 import llama3

    # the recipe file ``tune run`` runs (the wheel's top-level ``recipes`` folder is not importable)
    path = os.path.join(os.path.dirname(os.path.dirname(torchtune.__file__)), "recipes", "full_finetune_distributed.py")
    spec = importlib.util.spec_from_file_location("full_finetune_distributed", path)
    assert spec is not None and spec.loader is not None
    recipe_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe_module)

    world = int(os.environ["WORLD_SIZE"])
    root = tempfile.mkdtemp(prefix="repro-torchtune-")  # this rank's checkpoint and output
    ckpt, out = os.path.join(root, "checkpoint"), os.path.join(root, "output")
    os.makedirs(ckpt)
    torch.manual_seed(0)
    torch.save(llama3(**MODEL).state_dict(), os.path.join(ckpt, "model.pt"))  # the same on every rank
    cfg = OmegaConf.create({
        "output_dir": out, "device": "cpu", "dtype": "fp32", "seed": 0, "shuffle": False, "batch_size": 2,
        "epochs": 1, "max_steps_per_epoch": 1, "gradient_accumulation_steps": 1, "resume_from_checkpoint": False,
        "tensor_parallel_dim": world // args.dp,
        "tensor_parallel_plan": {"_component_": "torchtune.models.llama3.base_llama_tp_plan"},
        "clip_grad_norm": 1.0, "log_every_n_steps": 1, "log_peak_memory_stats": False,
        "enable_activation_checkpointing": False, "enable_activation_offloading": False,
        "model": {"_component_": "torchtune.models.llama3.llama3", **MODEL},
        "checkpointer": {"_component_": "torchtune.training.FullModelTorchTuneCheckpointer", "checkpoint_dir": ckpt,
                         "checkpoint_files": ["model.pt"], "recipe_checkpoint": None, "output_dir": out,
                         "model_type": "LLAMA3"},
        "tokenizer": {"_component_": "__main__.TinyTokenizer"},
        "dataset": {"_component_": "__main__.tiny_dataset"},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-5, "fused": False},
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger",
                          "log_dir": os.path.join(out, "logs")},
    })
    if not torch.cuda.is_available():  # memory bookkeeping torchtune does on CPU too, where it raises
        setattr(torchtune.training, "get_memory_stats", lambda device, reset_stats=True: dict.fromkeys(
            ("peak_memory_active", "peak_memory_alloc", "peak_memory_reserved"), 0.0))
        setattr(torchtune.training, "cleanup_before_training", gc.collect)
    recipe = recipe_module.FullFinetuneRecipeDistributed(cfg=cfg)  # initializes the process group (gloo)
    recipe.setup(cfg=cfg)
    error = None
    try:
        recipe.train()
    except RuntimeError as exc:
        error = f"{type(exc).__name__}: {exc}".splitlines()[0]

    square = torch.zeros((), dtype=torch.float64)  # rank 0's part of the true squared norm
    for p in recipe._model.parameters():
        if p.grad is None:
            continue
        g: Any = p.grad
        local = g.full_tensor() if isinstance(g, DTensor) else g  # plain: replicated over tp, count it once
        if dist.get_rank() == 0:
            square += local.double().square().sum()
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error)
    if dist.get_rank() == 0:
        print(f"ranks raising: {[r for r, e in enumerate(errors) if e]} of {world} "
              f"(dp={args.dp}, tp={world // args.dp}, base_llama_tp_plan, clip_grad_norm=1.0)")
        print(f"reported={'raised' if error else 'no error'} true={float(square.sqrt()):.6f} error={error}")
    dist.barrier()  # every rank done with its collectives before any tears its groups down
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
