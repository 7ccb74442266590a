"""transformers leaves TP shards as unmarked plain tensors; accelerate's ``Accelerator.clip_grad_norm_``
(what transformers' ``Trainer`` calls) then counts them rank-locally.

Whose it is: transformers' (``huggingface/transformers``): nothing marks those shards as shards, so no clip
can tell them from replicas; from 5.16 transformers makes them DTensors and the clip is exact.

What it shows: ``Accelerator._clip_grad_norm_dtensor_aware`` (accelerate 1.15.0 and 1.16.0, the fix
of accelerate PR #4219) reduces each DTensor group's norm over its mesh but takes the norm of the plain
(non-DTensor) gradients as it stands on each rank, assuming plain gradients are replicas (with no
DTensor at all it is ``torch.nn.utils.clip_grad_norm_`` on the rank-local gradients). Some
transformers releases leave tensor-parallel shards as plain local tensors: 4.x its ``use_dtensor=False``
styles (``grouped_gemm`` in gpt-oss's ``base_model_tp_plan``, ``local_colwise`` / ``local_rowwise`` in
dots.llm1's experts), 5.3 to 5.14 every TP shard. Each rank then adds only its own shards, reports a
norm that is too small and different on every rank, and clips by it.

Who reaches it (stock): ``from_pretrained(..., tp_plan="auto")`` with **transformers 4.x** (checked:
4.57.6; MoE experts) or **5.3 to 5.14** (checked: 5.3.0, 5.5.4, 5.10.4, 5.14.1; every sharded parameter),
trained with accelerate's ``ParallelismConfig(tp_size=N)``, ``accelerator.backward`` and
``accelerator.clip_grad_norm_`` (accelerate 1.15.0, 1.16.0; with every shard plain any accelerate
release: one plain group is ``torch.nn.utils.clip_grad_norm_``), as transformers' ``Trainer`` sets it up
for a TP model, with the L2 norm (the Trainer passes no norm type: an inf-norm clip is a direct call).
With 4.x the model's own TP backward already leaves the replicated gradients different per rank before
any clip (see the true norm below). Not with transformers from 5.16 (5.16.1, 5.17.0, 5.18.0
checked): its TP is built on DTensors (``MoEParamShard``, ``packed_colwise``), no plain shard arises
and the clip is exact on rank 0 (ratio 1); this script says so there.

Here: a tiny random dots.llm1 (one dense and one MoE layer) saved and reloaded with ``tp_plan="auto"``,
one real forward and backward of the language-model loss, accelerate's clip. (gpt-oss, whose experts
are ``grouped_gemm`` shards, raises in its first training forward with transformers 4.57.6 and torch
2.13: RowwiseParallel's ``mod._bias = mod.bias.to_local()`` on the biased ``o_proj``.) The true norm is
gathered on rank 0: DTensor gradients in full, plain shards (local shape unlike the checkpoint's) from
every rank, plain full-shape gradients once (rank 0's copy: transformers 4.x's TP backward leaves
them unequal across ranks, its ``gather`` style all-reduces the forward only; the ratio on rank 0 is
therefore exactly the missing shards of the other ranks; with 5.x the true norm is the same as with
DTensors).

On CPU: accelerate accepts a ``ParallelismConfig`` only on accelerator devices, so without one the
script builds ``Accelerator(cpu=True)`` and sets on its state what ``Accelerator.__init__`` sets for it
(the config and its device mesh). Everything after is accelerate's and transformers' code.

    torchrun --nproc_per_node=2 scenarios/accelerate/repro_tp_plain_experts.py
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any


def main() -> int:
    import torch
    import torch.distributed as dist
    import transformers
    from accelerate import Accelerator
    from accelerate.utils import ParallelismConfig
    from torch.distributed.tensor import DTensor
    from transformers import Dots1Config, Dots1ForCausalLM

    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = ParallelismConfig(tp_size=world)
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
        accelerator = Accelerator(parallelism_config=config)
    else:  # what Accelerator.__init__ does with a parallelism_config on an accelerator device
        accelerator = Accelerator(cpu=True)
        accelerator.state.parallelism_config = config
        accelerator.state.device_mesh = config.get_device_mesh("cpu")

    cfg = Dots1Config(
        num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        vocab_size=64, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, n_group=1, topk_group=1)
    box: list[Any] = [tempfile.mkdtemp(prefix="repro-dots1-") if rank == 0 else None]
    dist.broadcast_object_list(box)
    if rank == 0:
        torch.manual_seed(0)
        dense = Dots1ForCausalLM(cfg)
        with torch.no_grad():
            for p in dense.parameters():
                p.normal_(0.0, 0.5)
        dense.save_pretrained(box[0])
    dist.barrier()
    with torch.device("meta"):
        full_shapes = {n: p.shape for n, p in Dots1ForCausalLM(cfg).named_parameters()}

    model = Dots1ForCausalLM.from_pretrained(box[0], dtype=torch.float32, tp_plan="auto")
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), device=accelerator.device)
    accelerator.backward(model(input_ids=ids, labels=ids).loss)

    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    plain_shards = [n for n, g in named if not isinstance(g, DTensor) and g.shape != full_shapes[n]]
    squares = torch.zeros(3, dtype=torch.float64)  # DTensor, plain shards, plain full-shape
    for n, g in named:
        if isinstance(g, DTensor):
            squares[0] += g.full_tensor().double().square().sum().cpu()
        else:
            squares[1 if n in plain_shards else 2] += g.double().square().sum().cpu()
    every = [torch.zeros_like(squares) for _ in range(world)]
    dist.all_gather(every, squares)
    true = float((every[0][0] + sum(s[1] for s in every) + every[0][2]).sqrt())

    reported = float(accelerator.clip_grad_norm_(model.parameters(), max_norm=1.0))
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, reported)
    if rank == 0:
        print(f"transformers {transformers.__version__}: " + (
            f"{len(plain_shards)} plain TP-sharded gradients ({', '.join(plain_shards[:2])}, ...)" if plain_shards
            else "every TP-sharded gradient is a DTensor: no plain shards, the layout does not arise"))
        print("reported by rank: " + " ".join(f"{r:.6f}" for r in reports))
        print(f"reported={reported:.6f} true={true:.6f} ratio={reported / true:.6f}")
    dist.barrier()  # every rank done with its collectives before any tears its groups down
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
