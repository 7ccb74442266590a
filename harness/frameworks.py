"""Optional third-party frameworks the adapters call, and how to tell whether one is usable here.

A framework that is not installed makes its cases *skips* with the install hint as the reason (in
the table, the JSON and the JUnit file), never failures: the harness must run everywhere, and a CI
job decides which frameworks it installs.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Framework:
    name: str
    probe: str  # a module that exists only in the right project (names on PyPI can be taken)
    distribution: str | None
    install: str

    def unavailable(self) -> str | None:
        """None when usable here, otherwise why not (with the install hint).

        Looks for the probe module's file without importing anything: importing a framework can be
        slow or have side effects (DeepSpeed picks its accelerator at import time).
        """
        top, *rest = self.probe.split(".")
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
        for root in roots:
            base = os.path.join(root, *rest)
            if os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py")):
                return None
        return f"{self.name} is not installed here; {self.install}"

    def version(self) -> str:
        if self.distribution:
            try:
                return importlib.metadata.version(self.distribution)
            except importlib.metadata.PackageNotFoundError:
                pass
        module = importlib.import_module(self.probe.split(".")[0])
        return str(getattr(module, "__version__", "unknown (source checkout)"))


DEEPSPEED = Framework(
    "deepspeed", "deepspeed.runtime.utils", "deepspeed",
    "pip install 'clipcheck[deepspeed]' (CPU: DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8)",
)
TORCHTITAN = Framework(
    "torchtitan", "torchtitan.distributed.utils", "torchtitan",
    "pip install --no-deps torchtitan==0.3.0 && pip install spmd_types==0.2.3 tyro",
)
MEGATRON = Framework(
    "megatron-core", "megatron.core.optimizer.clip_grads", "megatron-core",
    "pip install --no-deps megatron-core==0.16.1",
)
XORL = Framework(
    "xorl", "xorl.distributed.fsdp2.clip_grad_norm", None,
    "it is not on the package index (the PyPI 'xorl' is another project): git clone "
    "https://github.com/togethercomputer/xorl, pip install einops triton==3.6.0 transformers torchdata psutil, "
    "and put its src/ on PYTHONPATH",
)
