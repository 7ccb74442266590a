"""ColossalAI 0.5.0: the ZeRO-1 optimizer of its MoE hybrid-parallel plugin,
``MoeHybridParallelZeroOptimizer.step`` (``LowLevelZeroOptimizer.step`` composing the per-store norms
of ``HybridParallelZeroOptimizer._compute_grad_norm``, then ``_unscale_and_clip_grads``), on the
``colossalai_moe`` scenario's model.

Setup per case (``dress``, every rank), as ``MoeHybridParallelPlugin.configure`` sets a model up:

* ColossalAI's plugin builds its process groups: ``MoeHybridParallelPlugin(tp_size=1, pp_size=1,
  ep_size=k, zero_stage=1)`` (or ``HybridParallelPlugin(..., overlap_communication=False)`` for the
  dense-only control: there are no CUDA streams to overlap on, and the MoE plugin turns overlap off
  itself); one plugin per layout, precision and generation of process groups, kept for later cases
  (each builds its ``ProcessGroupMesh``'s gloo groups, never freed until the generation ends); its
  ``max_norm`` is set per case.
* the experts get ColossalAI's EP mark, ``set_moe_tensor_ep_group(p, plugin.ep_group)`` (what its EP
  MoE blocks do in ``setup_process_groups``);
* the model is wrapped in ``HybridParallelModule`` with the plugin's shard config and a custom policy
  that replaces nothing (the harness model has no layers for shardformer to swap; ``custom_policy``
  is the plugin's own extension point);
* the optimizer is built exactly as ``configure`` builds it (``MoeHybridParallelZeroOptimizer`` with
  the plugin's ``mixed_dp_group``, ``moe_dp_group``, tp/pp groups, ``zero_config``, ``amp_config``,
  ``clip_grad_norm=max_norm``), except that ``forced_dtype`` is the case's dtype: ``configure``
  asserts ``precision != 'fp32'`` under ZeRO, while the optimizer itself runs fp32 as it runs bf16.
  The wrapped torch optimizer is a no-op, so ``step()`` reduces, measures and clips, and the
  parameters stay as they are.

The clip (``colossalai``): ``sync_dp_grads()`` (the reduction ColossalAI's ``backward`` runs right
after ``loss.backward()``: each store's gradients bucketed, averaged over its group, partitioned) and
``step()``; the norm is the optimizer's ``get_grad_norm()``. ZeRO keeps the clipped gradients as
fp32 partitions of its master parameters and releases ``.grad``; so that the harness can judge the
coefficient applied, the adapter records the partitions that ``_unscale_and_clip_grads`` scaled
(wrapping it for the call; the original runs unchanged) and all-gathers them back into ``.grad``
over each store's group.

``colossalai-inf``: ``step()`` never passes a norm type (its clip is L2 only). This target binds
``norm_type=inf`` onto the optimizer's ``_compute_grad_norm`` for the call, so that ``step()``'s own
composition reaches the inf branch ColossalAI ships in ``HybridParallelZeroOptimizer._compute_grad_norm``.

CPU shim: ``LowLevelZeroOptimizer._sanity_checks`` asserts an accelerator named cuda or npu, and its
buckets ask the accelerator for streams, which ``CpuAccelerator`` refuses. On a CPU world the adapter
installs, through ColossalAI's own ``set_accelerator``, a ``CpuAccelerator`` that reports the name
``cuda``, hands out no streams (``None``, with ``stream(None)`` a no-op context) and synchronizes
as a no-op; every device it returns is still the CPU. On a CUDA world ColossalAI's own accelerator
is left alone. ColossalAI itself runs unmodified.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.run.devices import accelerator_for
from harness.spec.context import CaseContext, context
from harness.targets.target import Finding, Target, direct_call, stock

from .framework import FRAMEWORK as COLOSSALAI
from .scenario import EXPERT_PREFIX, ColossalAISetup

_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def _colossalai(module: str) -> Any:
    """A ColossalAI module, imported on first use (it is optional, and ships no type information: the
    project's mypy configuration does not list it, so its modules are typed Any here)."""
    return importlib.import_module(f"colossalai.{module}")


def _install_cpu_accelerator() -> None:
    accelerator = _colossalai("accelerator")
    cpu_accelerator: Any = accelerator.CpuAccelerator

    class CpuAcceleratorAsCuda(cpu_accelerator):
        """The CPU, named 'cuda' for ZeRO's sanity check, with no streams (the CPU is synchronous)."""

        def __init__(self) -> None:
            super().__init__()
            self._name = "cuda"

        def Stream(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
            return None

        def current_stream(self, device: Any = None) -> None:
            return None

        def stream(self, stream_: Any) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

        def synchronize(self, device: Any = None) -> None:
            return None

    if type(accelerator.get_accelerator()).__name__ != "CpuAcceleratorAsCuda":
        accelerator.set_accelerator(CpuAcceleratorAsCuda())


class _NoOpOptimizer(torch.optim.Optimizer):
    """The torch optimizer ZeRO wraps: its step changes nothing, so the case's parameters stay put."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.0})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


def _no_shard_policy() -> Any:
    policy: Any = _colossalai("shardformer.policies.base_policy").Policy

    class NoShardPolicy(policy):
        """Replaces no module: the harness model has no transformer layers for shardformer to swap."""

        def config_sanity_check(self) -> None:
            return None

        def preprocess(self) -> nn.Module:
            return self.model

        def module_policy(self) -> dict:
            return {}

        def postprocess(self) -> nn.Module:
            return self.model

    return NoShardPolicy()


# plugins (and so their process groups) by (generation, moe, ep size, precision): every rank builds
# or reuses together, since building one is collective
_PLUGINS: dict[tuple[int, bool, int, str], Any] = {}


def _plugin(ctx: CaseContext, setup: ColossalAISetup, precision: str) -> Any:
    generation = ctx.world.generation if ctx.world is not None else -1
    key = (generation, setup.moe, setup.ep_size, precision)
    plugin = _PLUGINS.get(key)
    if plugin is None:
        for stale in [k for k in _PLUGINS if k[0] != generation]:
            del _PLUGINS[stale]
        common = dict(tp_size=1, pp_size=1, zero_stage=1, precision=precision, custom_policy=_no_shard_policy())
        if setup.moe:
            moe = _colossalai("booster.plugin.moe_hybrid_parallel_plugin")
            plugin = moe.MoeHybridParallelPlugin(ep_size=setup.ep_size, **common)
        else:
            # its default overlaps the reduction on a CUDA side stream; the MoE plugin turns it off itself
            hybrid = _colossalai("booster.plugin.hybrid_parallel_plugin")
            plugin = hybrid.HybridParallelPlugin(overlap_communication=False, **common)
        _PLUGINS[key] = plugin
    plugin.max_norm = ctx.case.max_norm
    return plugin


def dress(model: nn.Module, ctx: CaseContext) -> None:
    hybrid = _colossalai("booster.plugin.hybrid_parallel_plugin")
    moe = _colossalai("booster.plugin.moe_hybrid_parallel_plugin")
    if accelerator_for(ctx.device) == "cpu":
        _install_cpu_accelerator()
    setup = ctx.case.variant.info_as(ColossalAISetup)
    dtype = next(p.dtype for p in model.parameters())
    precision = _PRECISION[dtype]
    plugin = _plugin(ctx, setup, precision)
    if setup.moe:
        for name, p in model.named_parameters():
            if name.startswith(EXPERT_PREFIX):
                _colossalai("tensor.moe_tensor.api").set_moe_tensor_ep_group(p, plugin.ep_group)
    optimizer = _NoOpOptimizer([p for p in model.parameters() if p.requires_grad])
    param_info = hybrid.get_param_info(optimizer)
    wrapped = hybrid.HybridParallelModule(
        model, precision=precision, shard_config=plugin.shard_config, dp_group=plugin.mixed_dp_group,
        tp_group=plugin.tp_group, sp_group=plugin.sp_group, use_ddp=False, ddp_config=plugin.ddp_config,
        custom_policy=plugin.custom_policy, use_fp8=plugin.use_fp8,
    )
    zero_config = dict(plugin.zero_config, forced_dtype=dtype)
    common = dict(param_info=param_info, dp_process_group=plugin.mixed_dp_group, tp_process_group=plugin.tp_group,
                  pp_process_group=plugin.pp_group, verbose=True, clip_grad_norm=plugin.max_norm,
                  **zero_config, **plugin.amp_config)
    if setup.moe:
        zero = moe.MoeHybridParallelZeroOptimizer(
            optimizer, wrapped, use_pipeline=plugin.enable_pipeline_parallelism or plugin.ep_size > 1,
            moe_dp_group=plugin.moe_dp_group, **common)
    else:
        zero = hybrid.HybridParallelZeroOptimizer(
            optimizer, wrapped, use_pipeline=plugin.enable_pipeline_parallelism, **common)
    ctx.extras["zero"] = zero


@contextlib.contextmanager
def _recording_clip(zero: Any, seen: dict[nn.Parameter, torch.Tensor]) -> Iterator[None]:
    """Around ``step()``: after ColossalAI's ``_unscale_and_clip_grads`` has scaled the master
    partitions, note each working parameter's (clipped) partition."""
    original = zero._unscale_and_clip_grads

    def recording(grads: Any, total_norm: float) -> Any:
        out = original(grads, total_norm)
        for group_id in range(zero.num_param_groups):
            for master in zero._master_param_groups_of_current_rank[group_id]:
                if master.grad is not None:
                    seen[zero.master_to_working_param[id(master)]] = master.grad
        return out

    zero._unscale_and_clip_grads = recording
    try:
        yield
    finally:
        del zero._unscale_and_clip_grads


def _gather_back(zero: Any, model: nn.Module, seen: dict[nn.Parameter, torch.Tensor]) -> None:
    """Each store's clipped partitions all-gathered over its group into the working ``.grad``."""
    for p in model.parameters():
        if p not in seen:
            continue  # no gradient went into ZeRO (the same on every rank of its group)
        group = zero.param_to_pg[p]
        shard = seen[p].detach().to(p.device).contiguous()
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard, group=group)
        p.grad = torch.cat(parts)[: p.numel()].view(p.shape).to(p.dtype)


def _step(model: nn.Module, norm_type: float | None) -> torch.Tensor:
    zero = context(model).extras["zero"]
    seen: dict[nn.Parameter, torch.Tensor] = {}
    zero.sync_dp_grads()
    with _recording_clip(zero, seen):
        if norm_type is None:
            zero.step()
        else:
            zero._compute_grad_norm = functools.partial(type(zero)._compute_grad_norm, zero, norm_type=norm_type)
            try:
                zero.step()
            finally:
                del zero._compute_grad_norm
    _gather_back(zero, model, seen)
    return torch.tensor(zero.get_grad_norm(), dtype=torch.float64)


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """MoeHybridParallelZeroOptimizer.step (ZeRO-1; L2: step() passes no norm type)."""
    if norm_type != 2.0:
        raise ValueError("ColossalAI's ZeRO optimizer clips with the L2 norm only")
    return _step(model, None)


def clip_inf(model: nn.Module, *, max_norm: float, norm_type: float = math.inf) -> torch.Tensor:
    """The same step() with norm_type=inf bound onto its _compute_grad_norm (the inf branch)."""
    return _step(model, norm_type)


TARGETS = (
    Target("colossalai", clip, "ColossalAI MoeHybridParallelZeroOptimizer.step (ZeRO-1, per-store norms, L2 only)",
           origin="adapter colossalai", scenarios=("colossalai_moe",), requires=COLOSSALAI, dress=dress,
           dtypes=("fp32", "bf16"), norm_types=(2.0,),
           findings=(
               Finding("*moe-zero*", "hpcaitech/ColossalAI #2192 (experts not reduced over EP) and the MoE-ZeRO linear composition (0.5.0 and HEAD, code)",
                       "||dense|| + ||own experts|| on each rank instead of their 2-norm over all experts",
                       stock("MoeHybridParallelPlugin(ep_size>1, zero_stage=1) with max_norm set")),)),
    Target("colossalai-inf", clip_inf,
           "ColossalAI ZeRO step() with norm_type=inf bound onto HybridParallelZeroOptimizer._compute_grad_norm",
           origin="adapter colossalai", scenarios=("colossalai_moe",), requires=COLOSSALAI, dress=dress,
           dtypes=("fp32", "bf16"), norm_types=(math.inf,),
           findings=(
               Finding("*", "ColossalAI 0.5.0 inf branch (code; §6 row 33)",
                       "super()._compute_grad_norm(gradients, norm_type) without dp_pg: TypeError: object of type 'float' has no len()",
                       direct_call("the MoE ZeRO optimizer built with norm_type=inf")),)),
)
