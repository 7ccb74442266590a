"""DeepSpeed: its fp32 clip (``deepspeed.runtime.utils.clip_grad_norm_``) and the engine path that
calls it (``DeepSpeedEngine.clip_fp32_gradients``), on the ``deepspeed_autoep`` scenario's model.

Setup per case (the ``dress`` step, on every rank): DeepSpeed's communication layer on top of the
harness's process group (``deepspeed.init_distributed``) and its expert-parallel and
expert-data-parallel groups for this case (``groups._create_expert_and_data_parallel``). On CPU,
DeepSpeed needs ``DS_ACCELERATOR=cpu`` before it is imported, and its first ``init_distributed`` would
JIT-compile a shared-memory op for a minute or more; the harness does not need that op and skips
building it.

Whether DeepSpeed acts on gradients between backward and clip, per target:

* ``deepspeed`` (``clip_grad_norm_`` called directly): **no**. This target is what a custom training
  loop that calls DeepSpeed's clip function itself meets (reach ``direct-call``), and what reaches that
  function there is whatever the loop's own backward produced: nothing of DeepSpeed's runs in between.
  The gradients are injected after setup. The experts carry DeepSpeed's marks (``allreduce = False``,
  ``group_name = "ep_size_<k>"``, set by the scenario as ``deepspeed.moe``'s ``Experts`` sets them).
* ``deepspeed-engine`` (``DeepSpeedEngine.clip_fp32_gradients``): **yes**. ``engine.backward(loss)``
  ends in the engine's gradient all-reduce (``allreduce_gradients`` -> ``buffered_allreduce_fallback``):
  it gives every trainable parameter without a gradient a zero one, all-reduces dense gradients over
  the data-parallel group and expert gradients over their expert-data-parallel group, and divides both
  by the data-parallel size. So the gradients reach the clip through that path: ``dress`` builds the
  model the engine sees as an MoE model (a real ``deepspeed.moe.layer.MoE`` for the case's ep size,
  whose own gate and expert parameters, marked by DeepSpeed's ``Experts``, are the layout's parameters
  under the layout's names; the data copied in), then ``deepspeed.initialize`` (ZeRO-0, fp32,
  ``gradient_clipping = max_norm``); ``backward`` runs ``engine(...)`` and ``engine.backward(loss)`` on a
  loss linear in per-parameter directions (``harness.targets.gradient_path``) chosen so that the
  engine's sum-then-divide leaves exactly the layout's gradient on every rank (the direction is the
  target times the data-parallel size on the first replica of the parameter's reduction group, zero
  on the others). Layouts with a ``None`` gradient are refused: the engine never hands its clip one.
  Synthetic layouts (``--synthetic``) keep the plain model and get their gradients injected.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.cases.axes import MeshAxis
from harness.cases.variant import Variant
from harness.cases.context import CaseContext, context
from harness.run.world.devices import accelerator_for
from harness.targets.gradient_path import install_linear_forwards
from harness.cases.target import Finding, Target, direct_call, stock, synthetic
from .framework import FRAMEWORK as DEEPSPEED
from .scenario import NUM_EXPERTS, WIDTH, expert_name

_GROUP_CACHES_DICT = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP",
                      "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP_RANKS")
_GROUP_CACHES_NONE = ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP")


def _import_deepspeed(device: torch.device) -> Any:
    """DeepSpeed on the world's device: its CPU accelerator for a gloo world even on a GPU machine,
    where DeepSpeed would otherwise pick CUDA and allocate there while the gradients are on the CPU."""
    if accelerator_for(device) == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    importlib.import_module("deepspeed.comm.torch")
    # `import deepspeed.comm.torch as m` would bind the torch package (deepspeed.comm has a `torch`
    # attribute), so patch the module object itself: the shm op is a CPU fast path we do not use.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]
    return importlib.import_module("deepspeed")


def _forget_groups() -> None:
    """Reset DeepSpeed's group caches (module globals of ``deepspeed.utils.groups``): what they hold of a
    dropped generation would keep its groups, and their threads, alive for the rest of the run."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name in _GROUP_CACHES_DICT:
        setattr(groups, name, {})
    for name in _GROUP_CACHES_NONE:
        setattr(groups, name, None)


def _build_groups(ep: int) -> dict[str, Any]:
    """DeepSpeed's EP/EDP/DP groups for ``ep``, built by DeepSpeed (collective: every rank), and the
    caches that hold them, to hand back to DeepSpeed for every later case of this generation: new groups
    every case piled up hundreds of gloo groups and their threads per rank at world 8."""
    from deepspeed.utils import groups

    _forget_groups()
    groups._create_expert_and_data_parallel(ep)
    groups._get_data_parallel_group()  # its first call builds a group: every rank, now
    return {name: (dict(getattr(groups, name)) if name in _GROUP_CACHES_DICT else getattr(groups, name))
            for name in _GROUP_CACHES_DICT + _GROUP_CACHES_NONE}


def _prepare_groups(ctx: CaseContext) -> None:
    """DeepSpeed's comm layer and its EP/EDP groups for this case's generation of process groups."""
    deepspeed = _import_deepspeed(ctx.device)
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
    ep = ctx.group_size(MeshAxis.EP)
    built = ctx.per_generation(("deepspeed-groups", ep), lambda: _build_groups(ep))
    ctx.at_generation_end(_forget_groups)
    for name, value in built.items():
        setattr(groups, name, dict(value) if isinstance(value, dict) else value)


def dress_runtime(model: nn.Module, ctx: CaseContext) -> None:
    _prepare_groups(ctx)


def _set_parameter(root: nn.Module, dotted: str, parameter: nn.Parameter) -> None:
    *path, leaf = dotted.split(".")
    module = root.get_submodule(".".join(path)) if path else root
    setattr(module, leaf, parameter)


def _adopt_deepspeed_moe(model: nn.Module, ctx: CaseContext) -> None:
    """A real ``deepspeed.moe.layer.MoE`` for this case's ep size (so that the engine sees an MoE model
    and reduces its experts over their expert-data-parallel group), whose own gate and expert
    parameters, with the marks DeepSpeed's ``Experts`` put on them, replace the layout's (same names,
    same local shapes, the values copied in). Expert ``i`` of the layout is local expert
    ``i - ep_rank * num_local`` of the ep rank that owns it, as DeepSpeed's all-to-all routes it."""
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    ep = ctx.case.variant.ep_size or 1
    moe = MoE(hidden_size=WIDTH, expert=nn.Linear(WIDTH, WIDTH, bias=False), num_experts=NUM_EXPERTS, ep_size=ep,
              k=1).to(ctx.device)
    ep_rank = dist.get_rank(group=groups._get_expert_parallel_group(f"ep_size_{ep}"))
    params = dict(model.named_parameters())
    own: dict[str, nn.Parameter] = {"moe.gate.weight": moe.deepspeed_moe.gate.wg.weight}
    for j, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
        own[expert_name(ep_rank * moe.num_local_experts + j)] = expert.weight
    missing = sorted(set(own) - set(params))
    if missing:
        raise RuntimeError(f"DeepSpeed's MoE places experts {missing} on this rank, which the layout does not")
    for name, parameter in own.items():
        old = params[name]
        with torch.no_grad():
            parameter.data = old.detach().clone().to(parameter.dtype)
        parameter.requires_grad_(old.requires_grad)
        _set_parameter(model, name, parameter)
    # registered after the layout's modules: named_parameters() names each shared parameter by the layout
    model.add_module("deepspeed_moe_layer", moe)


def dress_engine(model: nn.Module, ctx: CaseContext) -> None:
    _prepare_groups(ctx)
    deepspeed = _import_deepspeed(ctx.device)
    if ctx.case.variant.synthetic is None:
        _adopt_deepspeed_moe(model, ctx)
    config = {
        "train_batch_size": ctx.world_size,
        "gradient_clipping": ctx.case.max_norm,
        "zero_optimization": {"stage": 0},
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
    }
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    ctx.extras["engine"] = engine


def backward_engine(model: nn.Module, ctx: CaseContext, grads: Mapping[str, torch.Tensor | None]) -> None:
    """The layout's gradients through ``engine(...)`` and ``engine.backward(loss)``: each parameter's
    direction is its target gradient times the engine's divisor on the first rank of its reduction
    group (the data-parallel group for dense parameters, the expert-data-parallel group of its
    ``group_name`` for experts), zero on the others, so the engine's all-reduce (sum) and its division
    by the data-parallel size leave exactly the target on every rank."""
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.utils import groups

    engine = ctx.extras["engine"]
    params = dict(model.named_parameters())
    dp_size = dist.get_world_size(group=groups._get_data_parallel_group())
    directions: dict[str, torch.Tensor] = {}
    for name, target in grads.items():
        if name not in params:  # a parameter of the layout that lives on other ranks only
            continue
        if target is None:
            raise ValueError(f"{name}: the engine gives every trainable parameter a gradient; this layout has none")
        p = params[name]
        group = (groups._get_expert_data_parallel_group(p.group_name) if is_moe_param(p)  # type: ignore[attr-defined]
                 else groups._get_data_parallel_group())
        first = dist.get_rank(group=group) == 0
        directions[name] = target * dp_size if first else torch.zeros_like(target)
    install_linear_forwards(model, directions)  # engine.module is the model: engine() runs its linear forward
    engine.backward(engine())


def refuses_engine(variant: Variant) -> str | None:
    if variant.synthetic is None and variant.injection.none_on:
        return ("DeepSpeedEngine never hands its clip a None gradient: its backward all-reduce "
                "(_get_gradients_for_reduction) gives every trainable parameter without one a zero gradient")
    return None


def clip_runtime(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """deepspeed.runtime.utils.clip_grad_norm_ (the fp32 clip; mpu=None)."""
    from deepspeed.runtime.utils import clip_grad_norm_

    return clip_grad_norm_(parameters=model.parameters(), max_norm=max_norm, norm_type=norm_type)


def clip_engine(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """DeepSpeedEngine.clip_fp32_gradients on a ZeRO-0 fp32 engine (gradient_clipping = max_norm).

    The engine method returns nothing, so the norm its clip computed is read by wrapping the
    ``clip_grad_norm_`` the engine module calls for the duration of the call.
    """
    import deepspeed.runtime.engine as engine_module

    if norm_type != 2.0:
        raise ValueError("the DeepSpeed engine clips with the L2 norm only")
    engine = context(model).extras["engine"]
    original = engine_module.clip_grad_norm_
    seen: list[Any] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(original(*args, **kwargs))
        return seen[-1]

    engine_module.clip_grad_norm_ = recording
    try:
        engine.clip_fp32_gradients()
    finally:
        engine_module.clip_grad_norm_ = original
    return seen[0]


MEAN_OF_NORMS = ("clip_grad_norm_ takes each rank's root (its local norm) and then the mean of those norms over "
                 "the data-parallel group: right only while every rank holds the same parameters, an "
                 "under-report (under-clipping) once ranks own different experts")
ENGINE_CONFIG = ("DeepSpeedEngine with MoE/AutoEP experts sharded over ep > 1, ZeRO-0, fp32 (no fp16/bf16), "
                 "gradient_clipping > 0 (the default, 1.0): engine.step() calls clip_fp32_gradients, which calls "
                 "clip_grad_norm_ on the engine's all-reduced gradients")
IDLE_RANK_CRASH = (
    "deepspeed.runtime.utils.clip_grad_norm_ on a rank that holds no gradient at all (an empty list after its "
    "`p.grad is not None` filter): the L2 branch all-reduces a zero norm with the other ranks and then raises "
    "IndexError at `parameters[0].device`, so the healthy ranks return the mean of norms with a zero in it "
    "(at world 2, half the true norm) and the idle rank drops out of step; the inf branch raises RuntimeError "
    "('stack expects a non-empty TensorList') at torch.stack before its all-reduce, so the healthy ranks block in "
    "that all-reduce for as long as the idle rank's process lives, up to the data-parallel group's timeout (a "
    "new_group clone of the world without a timeout: torch's 30 min default whatever init_distributed got); "
    "here the raising rank abandons its groups, so they fail at once")

TARGETS = (
    Target("deepspeed", clip_runtime, "DeepSpeed's fp32 clip, deepspeed.runtime.utils.clip_grad_norm_, called directly",
           origin="adapter deepspeed", scenarios=("deepspeed_autoep",), requires=DEEPSPEED, dress=dress_runtime,
           findings=(
               Finding("*frozen-dense*", None, IDLE_RANK_CRASH,
                       direct_call("a custom training loop calling deepspeed.runtime.utils.clip_grad_norm_ "
                                   "(mpu=None) on a rank none of whose parameters has a gradient (its experts got "
                                   "no tokens and skip their compute, the dense part frozen); the engine never "
                                   "does (its all-reduce gives every trainable parameter a zero gradient)"),
                       repro="scenarios/deepspeed/repro_idle_rank_crash.py"),
               Finding("*no-grad*", "deepspeedai/DeepSpeed #8475 / PR #8478", MEAN_OF_NORMS,
                       direct_call("a custom training loop calling deepspeed.runtime.utils.clip_grad_norm_ with "
                                   "experts sharded over ep > 1 and some gradients None (the engine would have "
                                   "made them zeros; the same averaging reaches it as in the stock rows)"),
                       repro="scenarios/deepspeed/repro_engine_mean_of_norms.py"),
               Finding("*", "deepspeedai/DeepSpeed #8475 / PR #8478", MEAN_OF_NORMS, stock(ENGINE_CONFIG),
                       repro="scenarios/deepspeed/repro_engine_mean_of_norms.py"),)),
    Target("deepspeed-engine", clip_engine,
           "DeepSpeedEngine.clip_fp32_gradients after engine.backward (ZeRO-0, fp32, L2 only)",
           origin="adapter deepspeed", scenarios=("deepspeed_autoep",), requires=DEEPSPEED, dress=dress_engine,
           backward=backward_engine, refuses=refuses_engine, dtypes=("fp32",), norm_types=(2.0,),
           findings=(
               Finding("*frozen-dense*", None, IDLE_RANK_CRASH,
                       synthetic("the engine's backward all-reduce gives every trainable parameter a gradient (a "
                                 "zero one where none arrived), so its clip never meets a rank without one; run "
                                 "only on the synthetic no-expert-rank layout, gradients injected")),
               Finding("*", "deepspeedai/DeepSpeed #8475 / PR #8478", MEAN_OF_NORMS + ", through the engine's "
                       "own backward all-reduce and its fp32 clip", stock(ENGINE_CONFIG),
                       repro="scenarios/deepspeed/repro_engine_mean_of_norms.py"),)),
)
