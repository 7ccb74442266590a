"""NVIDIA-NeMo/Automodel #3816, standalone: with TE grouped experts under expert parallelism,
``scale_grads_and_clip_grad_norm`` never reduces the experts' norm over the EP axis, so each EP rank
reports (and clips by) ``sqrt(dense^2 + its own experts^2)`` instead of the global norm.

Who reaches it: nemo-automodel **0.6.0** (and earlier), stock: the LLM recipe ``train_ft`` with
``model.backend: {experts: te, dispatcher: deepep}`` and ``distributed.ep_size > 1``. Fixed in
**0.7.0** by PR #3817 (``GroupedExpertsTE.__init__`` stamps ``_nemo_ep_local_expert_params``, the
clip reduces those parameters over EP): there this script prints ratio=1.000000.

Everything is Automodel's: ``MoE`` builds ``GroupedExpertsTE``, ``moe.parallelizer.parallelize_model``
(as the recipe calls it for ep > 1) applies EP and FSDP2 on meta, then the model is materialized,
gradients come from a backward through FSDP2 (a loss linear in the parameters: the TE kernels need
CUDA) and the clip is called as ``train_ft`` calls it. Transformer Engine and DeepEP are CUDA-only:
two stand-ins give ``GroupedLinear`` its parameters (``weight{j}``, TE's shapes) and DeepEP a buffer
class that is never used. The true norm: every rank holds distinct gradients (dense FSDP shards,
its own experts), so it is the square root of the all-reduced sum of squares.

    torchrun --nproc_per_node=2 scenarios/automodel/repro_te_experts_ep_norm.py   (ep = world = 2 or 4)
"""

from __future__ import annotations

import sys
import types
import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


class _GroupedLinear(nn.Module):  # Transformer Engine's GroupedLinear, its parameters only
    def __init__(self, num_gemms: int, in_features: int, out_features: int, *, bias: bool = True,
                 params_dtype: torch.dtype | None = None, device: Any = "cuda", **kwargs: Any) -> None:
        super().__init__()
        self.num_gemms, self.use_bias = num_gemms, bias
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", nn.Parameter(torch.empty(out_features, in_features,
                                                                           dtype=params_dtype, device=device)))


class _Empty(nn.Module):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()


class _Buffer:  # DeepEP's buffer: built never, asked for its SM count once
    @staticmethod
    def set_num_sms(num_sms: int) -> None:
        return None


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs, __path__=[])
    return module


def _stand_ins(*libraries: str) -> None:
    te = "transformer_engine"
    modules = {"deep_ep": _module("deep_ep", Buffer=_Buffer),
               "deep_ep.utils": _module("deep_ep.utils", EventHandle=object, EventOverlap=object),
               te: _module(te), f"{te}.pytorch.module": _module(f"{te}.pytorch.module"),
               f"{te}.pytorch": _module(f"{te}.pytorch", GroupedLinear=_GroupedLinear, Fp8Padding=_Empty,
                                        Fp8Unpadding=_Empty),
               f"{te}.pytorch.module.grouped_linear": _module("gl", GroupedLinear=_GroupedLinear),
               f"{te}.pytorch.module.linear": _module("l", Linear=_Empty),
               f"{te}.pytorch.module.rmsnorm": _module("n", RMSNorm=_Empty)}
    sys.modules.update({k: v for k, v in modules.items() if k.split(".")[0] in libraries})


def _linear_loss(module: nn.Module, rank: int, path: str = "") -> torch.Tensor:
    """sum(local(p) * direction) over the module's parameters, children called through their hooks."""
    total = torch.zeros((), dtype=torch.float64)
    for name, p in module.named_parameters(recurse=False):
        local = p.to_local() if isinstance(p, DTensor) else p
        g = torch.Generator().manual_seed(zlib.crc32(f"{rank}{path}.{name}".encode()))
        total = total + (local * torch.randn(local.shape, generator=g)).sum().double()
    for name, child in module.named_children():
        child.forward = (lambda c=child, n=f"{path}.{name}": _linear_loss(c, rank, n))
        total = total + child()
    return total


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes
    from nemo_automodel.components.distributed.mesh_utils import _create_fsdp2_device_mesh
    from nemo_automodel.components.models.common.utils import BackendConfig
    from nemo_automodel.components.training.utils import scale_grads_and_clip_grad_norm
    _stand_ins("deep_ep")  # the MoE modules' fused_a2a takes DeepEP for installed; TE must look absent there
    from nemo_automodel.components.moe.config import MoEConfig
    from nemo_automodel.components.moe.layers import MoE
    from nemo_automodel.components.moe.parallelizer import parallelize_model
    from torch.distributed.fsdp import MixedPrecisionPolicy
    _stand_ins("deep_ep", "transformer_engine")

    device_mesh, moe_mesh = _create_fsdp2_device_mesh(ParallelismSizes(dp_size=world, ep_size=world),
                                                      world_size=world)
    config = MoEConfig(n_routed_experts=8, n_shared_experts=0, n_activated_experts=2, n_expert_groups=1,
                       n_limited_groups=1, train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0,
                       score_func="softmax", route_scale=1.0, dim=16, inter_dim=32, moe_inter_dim=8,
                       norm_topk_prob=False, dtype=torch.float32)
    model, block = nn.Module(), nn.Module()
    with torch.device("meta"):
        block.self_attn = nn.Linear(16, 16, bias=False)
        block.mlp = MoE(config, BackendConfig(experts="te", dispatcher="deepep"))
    model.layers = nn.ModuleList([block])
    model.moe_config = config
    parallelize_model(model, world_mesh=device_mesh, moe_mesh=moe_mesh,
                      mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
                      **MeshContext.from_meshes(device_mesh, moe_mesh).parallelize_axis_kwargs())
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).fill_(1.0)
    model.forward = lambda: _linear_loss(model, rank)
    model().backward()

    squares = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        assert p.grad is not None
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        squares += grad.double().square().sum()
    dist.all_reduce(squares)
    true = float(squares.sqrt())
    reported = float(scale_grads_and_clip_grad_norm(
        1.0, [model], norm_type=2.0, device_mesh=device_mesh, moe_mesh=moe_mesh, ep_axis_name="ep", foreach=True))
    print(f"rank {rank}: reported {reported:.6f}", flush=True)
    dist.barrier()
    if rank == 0:
        import importlib.metadata
        print(f"nemo-automodel {importlib.metadata.version('nemo-automodel')}, ep={world}: every rank should "
              f"report the true norm")
        print(f"reported={reported:.6f} true={true:.6f} ratio={reported / true:.6f}")
    dist.barrier()  # every rank done with its collectives before any tears its groups down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
