"""DeepSpeed: its fp32 clip (``deepspeed.runtime.utils.clip_grad_norm_``) and the engine path that
calls it (``DeepSpeedEngine.clip_fp32_gradients``), on the ``deepspeed_autoep`` scenario's model,
whose expert parameters carry DeepSpeed's own marks (``allreduce=False``, ``group_name``).

Setup per case (the ``dress`` step, on every rank): DeepSpeed's communication layer on top of the
harness's process group (``deepspeed.init_distributed``), its expert-parallel and expert-data-parallel
groups rebuilt for this case (``groups._create_expert_and_data_parallel``), and for the engine target
a ZeRO-0 fp32 engine with ``gradient_clipping = max_norm``. On CPU, DeepSpeed needs
``DS_ACCELERATOR=cpu`` before it is imported, and its first ``init_distributed`` would JIT-compile a
shared-memory op for a minute or more; the harness does not need that op and skips building it.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import torch
import torch.nn as nn

from harness.spec.axes import MeshAxis
from harness.spec.context import CaseContext, context
from harness.run.devices import accelerator_for
from harness.targets.target import Finding, Target, direct_call, stock
from .framework import FRAMEWORK as DEEPSPEED

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


# DeepSpeed's EP/EDP/DP groups for the current generation of process groups, by ep size: built once
# and handed back to DeepSpeed for every later case, since new groups every case (never freed until
# the generation ends) piled up hundreds of gloo groups and their threads per rank at world 8
# (the key is what every rank knows alike, so every rank builds or reuses together: groups are collective)
_BUILT: dict[tuple[int, int], dict[str, Any]] = {}


def _prepare_groups(ctx: CaseContext) -> None:
    """DeepSpeed's comm layer and its EP/EDP groups for this case's generation of process groups."""
    deepspeed = _import_deepspeed(ctx.device)
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
    generation = ctx.world.generation if ctx.world is not None else -1
    key = (generation, ctx.group_size(MeshAxis.EP))
    built = _BUILT.get(key)
    if built is not None:
        for name, value in built.items():
            setattr(groups, name, dict(value) if isinstance(value, dict) else value)
        return
    for name in _GROUP_CACHES_DICT:
        setattr(groups, name, {})
    for name in _GROUP_CACHES_NONE:
        setattr(groups, name, None)
    groups._create_expert_and_data_parallel(ctx.group_size(MeshAxis.EP))  # collective: every rank
    groups._get_data_parallel_group()  # its first call builds a group: every rank, now
    for stale in [k for k in _BUILT if k[0] != generation]:  # groups of an ended generation
        del _BUILT[stale]
    _BUILT[key] = {name: (dict(getattr(groups, name)) if name in _GROUP_CACHES_DICT else getattr(groups, name))
                   for name in _GROUP_CACHES_DICT + _GROUP_CACHES_NONE}


def dress_runtime(model: nn.Module, ctx: CaseContext) -> None:
    _prepare_groups(ctx)


def dress_engine(model: nn.Module, ctx: CaseContext) -> None:
    _prepare_groups(ctx)
    deepspeed = _import_deepspeed(ctx.device)
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


TARGETS = (
    Target("deepspeed", clip_runtime, "DeepSpeed's fp32 clip, deepspeed.runtime.utils.clip_grad_norm_",
           origin="adapter deepspeed", scenarios=("deepspeed_autoep",), requires=DEEPSPEED, dress=dress_runtime,
           findings=(
               Finding("*no-expert-rank frozen-dense*", None,
                       "deepspeed.runtime.utils.clip_grad_norm_'s inf branch torch.stack()s the rank's maxima: a rank "
                       "holding no gradient at all raises 'stack expects a non-empty TensorList'; report to "
                       "deepspeedai/DeepSpeed with: clipcheck run --nproc 4 --scenario deepspeed_autoep --target "
                       "deepspeed --variant 'no-expert-rank frozen-dense' --norm-type inf",
                       direct_call("deepspeed.runtime.utils.clip_grad_norm_(..., norm_type=inf) on a rank that holds "
                                   "no gradient"), norms=("Linf",)),
               Finding("*", "deepspeedai/DeepSpeed #8475 / PR #8478",
                       "the mean of per-rank norms over ranks owning different experts",
                       stock("AutoEP with ZeRO-0, fp32, gradient_clipping set (the seed report's config)")),)),
    Target("deepspeed-engine", clip_engine, "DeepSpeedEngine.clip_fp32_gradients (ZeRO-0, fp32, L2 only)",
           origin="adapter deepspeed", scenarios=("deepspeed_autoep",), requires=DEEPSPEED, dress=dress_engine,
           dtypes=("fp32",), norm_types=(2.0,),
           findings=(
               Finding("*", "deepspeedai/DeepSpeed #8475 / PR #8478",
                       "the same averaged norm through the engine's fp32 clip",
                       stock("AutoEP with ZeRO-0, fp32, gradient_clipping set (the seed report's config)")),)),
)
