"""torchtune 0.6.1: the model set up as ``recipes/full_finetune_distributed.py`` sets it up, its
gradients through the recipe's backward, and the recipe's own optimizer-step clip.

Setup per case (``dress``), in the recipe's order (``_setup_model``):

1. the model on the meta device: torchtune's builder ``torchtune.models.llama3.llama3`` (a 2-layer
   decoder at the scenario's sizes) under ``training.set_default_dtype`` and ``torch.device("meta")``;
   its submodules replace the harness's placeholders under the harness's root, so parameter names
   are torchtune's own;
2. the recipe's mesh ``init_device_mesh(mesh_shape=(dp, tp), mesh_dim_names=("dp", "tp"))`` is the
   case mesh (the harness builds it once per layout); when ``tp > 1``: ``training.prepare_mha_for_tp``
   and ``parallelize_module`` on ``tp`` with ``torchtune.models.llama3.base_llama_tp_plan()`` (plus
   ``SequenceParallel`` for the RMSNorms where the variant says so: a user-supplied
   ``tensor_parallel_plan``);
3. when ``dp > 1``: ``training.shard_model`` over ``dp`` with ``training.get_shard_conditions``
   (each ``layers.N``, then the root), as the recipe calls it;
4. ``rope_init`` on the device, then ``training.load_from_full_model_state_dict(model, full_sd,
   device, strict=True)``: the full state dict is the harness's deterministic parameter values at
   torchtune's global shapes (in place of the checkpoint), sharded by torchtune's loader onto the
   TP/FSDP placements; then ``training.validate_no_params_on_meta_device``.

Gradients (``backward``): torchtune acts on them between the backward and the clip where FSDP2
shards the model (``dp > 1``: the post-backward reduce-scatter over ``dp``, divided by ``dp``), so they
come through the recipe's own path: one forward of the sharded model (a loss linear in the
parameters, ``harness.targets.gradient_path``, through every FSDP module's hooks) and
``loss.backward()``, with ``reduced_to`` directions that FSDP2's reduce-scatter turns into exactly the
layout's shards. With TP alone (``dp = 1``) nothing acts on parameter gradients (TP's hooks
redistribute activations; a DTensor parameter's gradient keeps its placements), and the same backward
runs. The TP-planned linear layers are not called (their hooks expect activations): their
parameters are read by the enclosing FSDP module (or the root).

The clip (``clip``) is the recipe's step, verbatim in effect: ``training.scale_grads`` with a unit
scaler (the recipe's token normalization, exact here so the judged gradients stay the delivered
ones), ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=...)`` with no norm type (so L2
only) and ``full_tensor()`` when the norm is a DTensor. torchtune 0.6.1 has no clip helper of its
own: that inline call is its clip path. No CPU shim is needed; nothing of torchtune's is copied or
patched.
"""

from __future__ import annotations

import importlib
from functools import partial
from types import ModuleType
from typing import Mapping

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from harness.cases.axes import MeshAxis
from harness.cases.context import CaseContext
from harness.cases.model import parameter_values
from harness.targets.gradient_path import backward_linear, reduced_to
from harness.cases.target import Finding, Target, stock

from .framework import FRAMEWORK as TORCHTUNE
from .scenario import EMBED, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, TorchtuneParallel

SP_NORMS = ("layers.*.sa_norm", "layers.*.mlp_norm", "norm")


def _torchtune(module: str) -> ModuleType:
    """A torchtune module, imported when a case runs (the package ships no type information, and
    importing it is slow: it pulls in Hugging Face datasets)."""
    return importlib.import_module(f"torchtune.{module}")


def _tp_plan(sp_norms: bool) -> dict[str, ParallelStyle]:
    # a copy: base_llama_tp_plan() returns torchtune's module-level dict
    plan: dict[str, ParallelStyle] = dict(_torchtune("models.llama3").base_llama_tp_plan())
    if sp_norms:
        plan.update({pattern: SequenceParallel() for pattern in SP_NORMS})
    return plan


def dress(model: nn.Module, ctx: CaseContext) -> None:
    training, llama3 = _torchtune("training"), _torchtune("models.llama3").llama3
    info = ctx.case.variant.info_as(TorchtuneParallel)
    dtype = ctx.case.injection.torch_dtype
    with training.set_default_dtype(dtype), torch.device("meta"):
        decoder = llama3(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                         embed_dim=EMBED, max_seq_len=64, intermediate_dim=HIDDEN)
    for name in list(model._modules):
        delattr(model, name)
    for name, child in decoder.named_children():
        model.add_module(name, child)

    if info.tp > 1:
        tp_mesh = ctx.mesh[MeshAxis.TP]
        model = training.prepare_mha_for_tp(model, tp_mesh)
        parallelize_module(model, tp_mesh, parallelize_plan=_tp_plan(info.sp_norms))
    if info.dp > 1:
        training.shard_model(
            model=model,
            shard_conditions=[partial(training.get_shard_conditions, names_to_match=None)],
            cpu_offload=False,
            reshard_after_forward=True,
            dp_mesh=ctx.mesh[MeshAxis.DP],
        )
    with training.set_default_dtype(dtype), ctx.device:
        for module in model.modules():
            if hasattr(module, "rope_init"):  # RoPE is not in the state dict
                getattr(module, "rope_init")()
    full_sd = {name: parameter_values(tuple(p.shape), dtype, ctx.device) for name, p in model.named_parameters()}
    training.load_from_full_model_state_dict(model, full_sd, ctx.device, strict=True, cpu_offload=False)
    training.validate_no_params_on_meta_device(model)


def backward(model: nn.Module, ctx: CaseContext, grads: Mapping[str, torch.Tensor | None]) -> None:
    """The recipe's ``loss.backward()`` through the sharded model: FSDP2's hooks and reduce-scatter."""
    info = ctx.case.variant.info_as(TorchtuneParallel)
    directions: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        target = grads.get(name)
        if target is None:
            continue
        if info.dp > 1:  # shard_model wrapped every parameter: a DTensor on dp (and tp)
            assert isinstance(p, DTensor), f"{name}: FSDP2 left it a plain tensor"
            kept = tuple(axis for axis in p.device_mesh.mesh_dim_names or () if axis != MeshAxis.DP)  # TP
            directions[name] = reduced_to(p, target, info.dp, kept_axes=kept)
        else:
            directions[name] = target
    backward_linear(model, directions, runs=lambda module: isinstance(module, FSDPModule))


def clip(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """The optimizer step of torchtune's full_finetune_distributed recipe: scale_grads, then
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) (L2) and full_tensor()."""
    training = _torchtune("training")
    training.scale_grads(model, torch.tensor(1.0))
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float(max_norm))
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    return grad_norm


_TT_REPRO = "scenarios/torchtune/repro_tp_plain_norms.py"
_TT_2420 = ("meta-pytorch/torchtune #2420 (open; fixed on main by PR #2503, SequenceParallel norms, in no release: "
            "0.6.1 is the last, and torchtune is no longer maintained)")
_TT_RUN = ("tune run --nproc_per_node N full_finetune_distributed --config llama3_3/70B_full tensor_parallel_dim={tp} "
           "clip_grad_norm=1.0: the shipped config needs both overrides (it sets tensor_parallel_dim: 1 and "
           "clip_grad_norm: null; llama3/70B_full and llama3_1/70B_full the same){rest}; torchtune 0.6.1's "
           "base_llama_tp_plan")

TARGETS = (
    Target("torchtune", clip,
           "torchtune 0.6.1 full_finetune_distributed: llama3 + base_llama_tp_plan + shard_model, "
           "then the recipe's clip_grad_norm_",
           origin="adapter torchtune", scenarios=("torchtune_tp",), requires=TORCHTUNE, dress=dress,
           backward=backward, norm_types=(2.0,),
           findings=(
               Finding("dp=1 *base plan*", _TT_2420,
                       "the TP plan leaves the norms plain: foreach over mixed Tensor/DTensor raises",
                       stock(_TT_RUN.format(tp="N", rest="")), repro=_TT_REPRO),
               Finding("*tp+fsdp base plan*", f"{_TT_2420}, with FSDP via pytorch/pytorch #180346",
                       "the norms become 1-D DTensors on dp next to 2-D (dp, tp) ones: torch.stack of norms from "
                       "two meshes raises",
                       stock(_TT_RUN.format(tp="N/2", rest=", FSDP over the other half")), repro=_TT_REPRO),)),
)
