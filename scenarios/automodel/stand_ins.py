"""CPU stand-ins for the two CUDA-only libraries NeMo Automodel's TE experts are built with, so that
Automodel's own code builds, marks and parallelizes them on CPU/gloo.

``GroupedExpertsTE`` (what ``MoE`` builds for ``BackendConfig(experts="te", dispatcher="deepep")``)
holds its experts in Transformer Engine ``GroupedLinear`` modules, one parameter per local expert
(``weight0``, ``weight1``, ..., shape ``(out_features, in_features)``), and ``apply_ep`` gives it a
DeepEP token dispatcher. Neither library runs without CUDA. These stand-ins replace only what is
constructed, never what is computed on the way to the clip:

* ``transformer_engine.pytorch.GroupedLinear``: a module registering ``weight{i}`` (and ``bias{i}``
  with ``bias=True``) at TE's shapes, dtype and device (``device="meta"`` as Automodel asks);
  ``Fp8Padding`` / ``Fp8Unpadding`` and the ``Linear`` / ``RMSNorm`` classes whose ``forward``
  Automodel's ``_patch_te_modules`` wraps: empty modules. Any forward raises.
* ``deep_ep.Buffer`` (``set_num_sms``: nothing to set) and ``deep_ep.utils.EventHandle`` /
  ``EventOverlap``: what ``moe/megatron/fused_a2a.py`` imports; its dispatcher manager is built and
  never called (no token goes through it: the gradient path is a linear loss, not a real forward).

They sit in ``sys.modules`` only inside ``cpu_stand_ins()`` (and only under names that are not
importable for real), so no other framework in the process ever sees them. ``fused_a2a`` decides
whether DeepEP is there once, when it is first imported: the first import of Automodel's MoE modules
happens with DeepEP's stand-in alone (``ensure_imported``; ``deepep_usable()`` says whether it took);
TE's is added only while the experts are built and parallelized (its import-time checks, as in
``moe_utils``, must see no TE, as on a machine without one).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from typing import Any, Iterator

import torch
import torch.nn as nn


class _NoKernels(nn.Module):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{type(self).__name__} is a CPU stand-in for Transformer Engine: it has no kernels")


class GroupedLinear(_NoKernels):
    """Transformer Engine's ``GroupedLinear`` as far as its parameters go."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, *, bias: bool = True,
                 params_dtype: torch.dtype | None = None, device: Any = "cuda", **kwargs: Any) -> None:
        super().__init__()
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias = bias
        dtype = params_dtype or torch.get_default_dtype()
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", nn.Parameter(
                torch.empty(out_features, in_features, dtype=dtype, device=device)))
            if bias:
                self.register_parameter(f"bias{i}", nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)))


class Fp8Padding(_NoKernels):
    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        self.num_gemms = num_gemms


class Fp8Unpadding(Fp8Padding):
    pass


class Linear(_NoKernels):
    pass


class RMSNorm(_NoKernels):
    pass


class Buffer:
    """DeepEP's communication buffer: never created here (no token is dispatched)."""

    @staticmethod
    def set_num_sms(num_sms: int) -> None:
        return None


class EventHandle:
    pass


class EventOverlap:
    pass


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__path__ = []  # a package, so that its submodules import
    return module


_MODULES = {
    "transformer_engine": _module("transformer_engine"),
    "transformer_engine.pytorch": _module("transformer_engine.pytorch", GroupedLinear=GroupedLinear,
                                          Fp8Padding=Fp8Padding, Fp8Unpadding=Fp8Unpadding, Linear=Linear,
                                          RMSNorm=RMSNorm),
    "transformer_engine.pytorch.module": _module("transformer_engine.pytorch.module"),
    "transformer_engine.pytorch.module.grouped_linear": _module("transformer_engine.pytorch.module.grouped_linear",
                                                                GroupedLinear=GroupedLinear),
    "transformer_engine.pytorch.module.linear": _module("transformer_engine.pytorch.module.linear", Linear=Linear),
    "transformer_engine.pytorch.module.rmsnorm": _module("transformer_engine.pytorch.module.rmsnorm", RMSNorm=RMSNorm),
    "deep_ep": _module("deep_ep", Buffer=Buffer),
    "deep_ep.utils": _module("deep_ep.utils", EventHandle=EventHandle, EventOverlap=EventOverlap),
}


def _really_installed(top: str) -> bool:
    """Whether a library of that name is importable for real (the stand-ins are out of ``sys.modules``
    whenever this is asked)."""
    return top in sys.modules or importlib.util.find_spec(top) is not None


@contextlib.contextmanager
def cpu_stand_ins(libraries: tuple[str, ...] = ("transformer_engine", "deep_ep")) -> Iterator[None]:
    """The stand-ins of ``libraries`` in ``sys.modules`` for the duration (for a library that is
    really installed, nothing is put in its place)."""
    real = {top for top in libraries if _really_installed(top)}
    added = [name for name in _MODULES
             if name.split(".")[0] in libraries and name.split(".")[0] not in real and name not in sys.modules]
    for name in added:
        sys.modules[name] = _MODULES[name]
    try:
        yield
    finally:
        for name in added:
            if sys.modules.get(name) is _MODULES[name]:
                del sys.modules[name]


FUSED_A2A = "nemo_automodel.components.moe.megatron.fused_a2a"


def ensure_imported() -> None:
    """Import Automodel's MoE modules with DeepEP's stand-in in place (the first import decides), and
    without Transformer Engine's: modules that check for TE at import (``moe_utils``) must find none,
    as on any machine without it; TE's stand-in is there only while the experts are built."""
    with cpu_stand_ins(("deep_ep",)):
        importlib.import_module("nemo_automodel.components.moe.parallelizer")
        importlib.import_module("nemo_automodel.components.moe.layers")


def deepep_usable() -> bool:
    """Whether Automodel's ``fused_a2a`` took DeepEP (its stand-in) for installed."""
    module = sys.modules.get(FUSED_A2A)
    return bool(getattr(module, "HAVE_DEEP_EP", False))
