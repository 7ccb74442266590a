"""Recipe: Megatron-core's ``get_grad_norm_fp32`` + ``clip_grad_by_total_norm_fp32`` audited on a TP model.

    torchrun --nproc_per_node=4 tests/audit_jobs/megatron_clip.py MODE OUT.json

megatron-core's own ``ColumnParallelLinear`` and ``RowParallelLinear`` (tensor parallel over every rank,
``tp_group`` the world) and a layernorm weight (a TP duplicate: every rank the same gradient), one real
forward and backward, then the audit of Megatron's clip as its optimizer calls it: gradients filtered by
``param_is_not_shared`` and ``param_is_not_tensor_parallel_duplicate``, the norm reduced over the TP group,
every gradient scaled by the one total.

* ``stock``: the weights as megatron marks them: right;
* ``unmarked``: the column-parallel weight without its ``tensor_model_parallel`` mark, as TEGroupedLinear
  left grouped-GEMM experts before Megatron-LM PR #5916 (our finding): the filter then keeps that
  sharded gradient on TP rank 0 only, and the audit catches the under-count.

CPU shim: megatron allocates its norm buffers with ``device='cuda'`` (redirected to the CPU around the
two calls, ``cuda_on_cpu``) and its ``.grad`` path asserts CUDA tensors (the gradients are handed over
as ``decoupled_grad``, Megatron's alternative gradient attribute): the same shim as the harness's adapter.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import harness
from harness.scenarios.megatron.adapter import cuda_on_cpu
from job_output import write

HIDDEN, FFN, MAX_NORM = 8, 16, 1e-3


class Block(nn.Module):
    def __init__(self, tp_group: Any, world: int) -> None:
        super().__init__()
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        config = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True)
        torch.manual_seed(0)
        self.norm = nn.Parameter(torch.ones(HIDDEN))
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=nn.init.normal_, bias=False,
                                        gather_output=False, tp_group=tp_group)
        self.fc2 = RowParallelLinear(FFN, HIDDEN, config=config, init_method=nn.init.normal_, bias=False,
                                     input_is_parallel=True, skip_bias_add=True, tp_group=tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(x * self.norm)
        out, _ = self.fc2(torch.relu(h))
        return out.pow(2).sum()


def megatron_clip(model: nn.Module, tp_group: Any) -> float:
    """What Megatron's optimizer does: its gradient filter, ``get_grad_norm_fp32`` over TP, the clip."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    params = [p for p in model.parameters() if p.grad is not None]
    for p in params:
        p.decoupled_grad = p.grad  # type: ignore[attr-defined]
    grads = [p.grad for p in params if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p, tp_group)]
    with cuda_on_cpu(torch.device("cpu")):
        total = get_grad_norm_fp32(grads, grad_stats_parallel_group=tp_group)
        clip_grad_by_total_norm_fp32(params, MAX_NORM, total, use_decoupled_grad=True)
    return float(total)


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    tp_group = dist.new_group(list(range(dist.get_world_size())))
    model = Block(tp_group, dist.get_world_size())
    if mode == "unmarked":
        model.fc1.weight.tensor_model_parallel = False  # type: ignore[attr-defined]
    torch.manual_seed(1)  # TP ranks see the same batch
    model(torch.randn(4, HIDDEN)).backward()
    report = harness.audit(model, lambda: megatron_clip(model, tp_group), max_norm=MAX_NORM, restore=True)
    write(out, report)


if __name__ == "__main__":
    main()
