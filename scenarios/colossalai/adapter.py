"""ColossalAI 0.5.0: the ZeRO-1 optimizer of its MoE hybrid-parallel plugin,
``MoeHybridParallelZeroOptimizer.step`` (``LowLevelZeroOptimizer.step`` composing the per-store norms
of ``HybridParallelZeroOptimizer._compute_grad_norm``, then ``_unscale_and_clip_grads``), on the
``colossalai_moe`` scenario's model, reached the way ColossalAI's own training reaches it.

Setup per case (``dress``, every rank), the user's path:

* ``MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=k, zero_stage=1, precision="bf16",
  max_norm=...)`` (or ``HybridParallelPlugin(..., overlap_communication=False)`` for the dense-only
  control: there are no CUDA streams to overlap on, and the MoE plugin turns overlap off itself);
  one plugin per layout and generation of process groups, kept for later cases (each builds its
  ``ProcessGroupMesh``'s gloo groups, never freed until the generation ends); its ``max_norm`` is set
  per case, before ``boost`` builds the optimizer with it;
* the experts get ColossalAI's EP mark, ``set_moe_tensor_ep_group(p, plugin.ep_group)`` (what its EP
  MoE blocks do in ``setup_process_groups``);
* ``Booster(plugin=plugin).boost(model, optimizer)``: ``configure`` wraps the model in
  ``HybridParallelModule`` (with a custom policy that replaces nothing: the harness model has no
  layers for shardformer to swap; ``custom_policy`` is the plugin's own extension point) and builds
  the ZeRO optimizer around a torch optimizer whose step changes nothing (the parameters stay put).

Precision: ``configure`` asserts ``precision != "fp32"`` under ZeRO, so no ColossalAI user runs this
optimizer in fp32: the targets take bf16 cases only (fp32 ones are dropped with that reason).

Gradients (``backward``): ColossalAI acts on them between backward and clip. ``booster.backward(loss,
optimizer)`` runs ``loss.backward()`` and then ZeRO's reduction (``_sync_grad``: each store's
gradients bucketed, divided by the store group's size, all-reduced, partitioned into its gradient
store; ``.grad`` released). So the loss is linear in seeded directions (``gradient_path``): each
parameter's direction is its layout gradient times its store group's size on the first rank of that
group (``mixed_dp_group`` for the dense store, ``moe_dp_group`` for the experts), zero on the others,
so that the average ZeRO takes is exactly the layout's gradient. What ZeRO then holds is read back
with its own ``get_param_grad`` (an all-gather over the store's group) into ``.grad``, for the
runner's bit-for-bit delivery check; ``step()`` reads its stores, not ``.grad``.

The clip (``colossalai``): ``optimizer.step()`` (with ``max_norm`` set, it clips); the norm is the
optimizer's ``get_grad_norm()``. ZeRO keeps the clipped gradients as fp32 partitions of its master
parameters: so that the harness can judge the coefficient applied, the adapter records the
partitions that ``_unscale_and_clip_grads`` scaled (wrapping it for the call; the original runs
unchanged) and all-gathers them back into ``.grad`` over each store's group.

``colossalai-inf`` (not run by default: ``--target colossalai-inf``): ``step()`` never passes a norm
type (its clip is L2 only; ColossalAI's ZeRO wrappers assert ``norm_type == 2``). This target binds
``norm_type=inf`` onto the optimizer's ``_compute_grad_norm`` for the call, so that ``step()``'s own
composition reaches the inf branch ColossalAI ships in ``HybridParallelZeroOptimizer._compute_grad_norm``:
a branch no configuration or public call reaches (synthetic).

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

from harness.run.world.devices import accelerator_for
from harness.cases.context import CaseContext, context
from harness.targets.gradient_path import install_linear_forwards
from harness.cases.target import Finding, Target, stock, synthetic

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


def _plugin(ctx: CaseContext, setup: ColossalAISetup, precision: str) -> Any:
    """The Booster plugin for this layout and precision, built once per generation of process groups
    (building one creates its groups, collectively: every rank builds or reuses together)."""
    def build() -> Any:
        common = dict(tp_size=1, pp_size=1, zero_stage=1, precision=precision, custom_policy=_no_shard_policy(),
                      max_norm=ctx.case.max_norm)
        if setup.moe:
            moe = _colossalai("booster.plugin.moe_hybrid_parallel_plugin")
            return moe.MoeHybridParallelPlugin(ep_size=setup.ep_size, **common)
        # its default overlaps the reduction on a CUDA side stream; the MoE plugin turns it off itself
        hybrid = _colossalai("booster.plugin.hybrid_parallel_plugin")
        return hybrid.HybridParallelPlugin(overlap_communication=False, **common)

    plugin = ctx.per_generation(("colossalai-plugin", setup.moe, setup.ep_size, precision), build)
    plugin.max_norm = ctx.case.max_norm
    return plugin


def dress(model: nn.Module, ctx: CaseContext) -> None:
    if accelerator_for(ctx.device) == "cpu":
        _install_cpu_accelerator()
    setup = ctx.case.variant.info_as(ColossalAISetup)
    dtype = next(p.dtype for p in model.parameters())
    plugin = _plugin(ctx, setup, _PRECISION[dtype])
    if setup.moe:
        for name, p in model.named_parameters():
            if name.startswith(EXPERT_PREFIX):
                _colossalai("tensor.moe_tensor.api").set_moe_tensor_ep_group(p, plugin.ep_group)
    booster = _colossalai("booster").Booster(plugin=plugin)
    boosted, zero, *_ = booster.boost(model, _NoOpOptimizer([p for p in model.parameters() if p.requires_grad]))
    ctx.extras["colossalai"] = (booster, boosted, zero)


def backward(model: nn.Module, ctx: CaseContext, grads: dict[str, torch.Tensor | None]) -> None:
    """``booster.backward`` of a loss linear in the parameters, through ZeRO's reduction, leaving
    exactly ``grads`` in ZeRO's gradient stores (copied into ``.grad`` for the delivery check)."""
    booster, boosted, zero = ctx.extras["colossalai"]
    directions: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    for name, target in grads.items():
        p = params.get(name)
        if target is None or p is None or not p.requires_grad:
            continue
        group = zero.param_to_pg[p]  # the store's group: mixed_dp_group (dense) or moe_dp_group (experts)
        first = dist.get_process_group_ranks(group)[0] == dist.get_rank()
        directions[name] = target * dist.get_world_size(group) if first else torch.zeros_like(target)
    install_linear_forwards(model, directions)
    booster.backward(boosted(), zero)
    ctx.extras["reduced"] = True
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.grad = zero.get_param_grad(p)


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
    extras = context(model).extras
    _, _, zero = extras["colossalai"]
    seen: dict[nn.Parameter, torch.Tensor] = {}
    if not extras.get("reduced"):  # gradients injected after setup: ZeRO's reduction, as booster.backward runs it
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


_REPRO = "scenarios/colossalai/repro_moe_zero_norm.py"
_PLUGIN = "Booster(plugin=MoeHybridParallelPlugin(ep_size=k > 1, zero_stage=1, precision='bf16', max_norm=m))"
_MOE_ZERO_NORM = (
    "ColossalAI 0.5.0 (and v0.5.1, HEAD) MoE ZeRO at ep > 1: LowLevelZeroOptimizer.step adds its two gradient "
    "stores' norms linearly (low_level_optim.py l.575, `norm_group +=`, from PR #5821, 2024) and the MoE store's "
    "norm is reduced over moe_dp only, never over ep (HybridParallelZeroOptimizer._compute_grad_norm, "
    "hybrid_parallel_plugin.py l.912-920): each rank reports and clips by ||dense|| + ||own experts|| instead of "
    "sqrt(||dense||^2 + ||all experts||^2), rank-dependent (#2192 is the same class of bug in the 2022 code). "
    "Report to hpcaitech/ColossalAI: docs/findings/colossalai-moe-zero-norm.md (repro, per-defect shares, fix)")
_MOE_ZERO_REACH = (
    f"{_PLUGIN}, booster.backward(loss, optimizer), optimizer.step(): ColossalChat's "
    "applications/ColossalChat/examples/training_scripts/lora_finetune.py --plugin moe --ep N (N > 1) with its "
    "defaults (zero_stage 1, bf16, grad_clip 1.0), on a model with a ColossalAI EP policy (Mixtral, DeepSeek, "
    "DeepSeek-V3)")
_BF16_ONLY = ("bf16",)
"""``MoeHybridParallelPlugin.configure`` (and ``HybridParallelPlugin``'s) asserts ``precision != 'fp32'``
under ZeRO: fp32 cases are dropped."""

TARGETS = (
    Target("colossalai", clip, "ColossalAI MoeHybridParallelZeroOptimizer.step (ZeRO-1, per-store norms, L2 only)",
           origin="adapter colossalai", scenarios=("colossalai_moe",), requires=COLOSSALAI, dress=dress,
           backward=backward, dtypes=_BF16_ONLY, norm_types=(2.0,), in_place=False,  # _gather_back: new .grad
           findings=(
               Finding("*moe-zero*", None, _MOE_ZERO_NORM, stock(_MOE_ZERO_REACH), repro=_REPRO),)),
    Target("colossalai-inf", clip_inf,
           "ColossalAI ZeRO step() with norm_type=inf bound onto HybridParallelZeroOptimizer._compute_grad_norm",
           origin="adapter colossalai", scenarios=("colossalai_moe",), requires=COLOSSALAI, dress=dress,
           backward=backward, dtypes=_BF16_ONLY, norm_types=(math.inf,), in_place=False,
           findings=(
               Finding("*", "ColossalAI 0.5.0 inf branch (code; §6 row 33)",
                       "super()._compute_grad_norm(gradients, norm_type) without dp_pg: TypeError: object of type "
                       "'float' has no len()",
                       synthetic("no configuration or public call passes a norm type to the MoE ZeRO optimizer: "
                                 "step() calls _compute_grad_norm with the default 2, and ColossalAI's ZeRO "
                                 "wrappers (zero.wrapper, LowLevelZeroPlugin) assert norm_type == 2; only a call "
                                 "of the private _compute_grad_norm(..., norm_type=inf) reaches the branch")),)),
)
