"""clipcheck: a correctness harness for gradient-norm computation and clipping in distributed training.

Public API for users writing their own clip targets or scenarios:

* ``context(model)`` -> ``CaseContext``: the mesh, groups, declared plan and true layout of a case.
* layout building blocks: ``MeshSpec``, ``ParamSpec``, ``param``, ``Layout``, ``Shard``, ``Replicate``.
* ``Injection`` (what the gradients are), ``Variant`` and ``Scenario`` (a family of layouts).
* ``check(target, scenarios=..., worlds=[2, 4])`` -> ``CheckReport``: the built-in scenarios against
  your clip from Python, on warm worlds (``harness.api``).
* ``audit(model, clip, max_norm=...)`` -> ``AuditReport``, and ``auditing(...)``: your clip judged on your
  own model after your own backward, inside your own launch (``harness.auditor``).
"""

import importlib
import importlib.abc
import types
import warnings
from importlib.machinery import ModuleSpec

# ``harness.scenarios`` is the repository's top-level scenarios/ folder: in a checkout a finder maps it
# (stdlib only, no torch), so ``import harness.scenarios.deepspeed`` works wherever harness does
from harness.targets import builtin_scenarios as _scenarios_finder  # noqa: F401

class _RenamedModules:
    """``harness.spec`` was renamed ``harness.cases`` (and its ``case`` module ``variant``): an import of
    an old name still works, with a DeprecationWarning, and is the very module of the new name."""

    OLD, NEW = "harness.spec", "harness.cases"

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> "ModuleSpec | None":
        if fullname != self.OLD and not fullname.startswith(self.OLD + "."):
            return None
        import importlib.util

        new = self.NEW + fullname[len(self.OLD):]
        new = new[: -len(".case")] + ".variant" if new == self.NEW + ".case" else new
        warnings.warn(f"{fullname} is now {new}", DeprecationWarning, stacklevel=2)
        return importlib.util.spec_from_loader(fullname, _Alias(new))


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: ModuleSpec) -> types.ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


import sys as _sys  # noqa: E402

if not any(isinstance(f, _RenamedModules) for f in _sys.meta_path):
    # first: the old package's __path__ is the new folder, where the path finder would load a second copy
    _sys.meta_path.insert(0, _RenamedModules())

# torch warns on import when numpy is absent; nothing in clipcheck needs numpy, so it is not a dependency
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

# Exports are imported on first use (PEP 562), so importing ``harness.pytest_plugin`` (every pytest
# start where clipcheck is installed) does not import torch.
_EXPORTS = {
    "MeshAxis": ".cases.axes",
    "CaseSpec": ".cases.variant", "Variant": ".cases.variant", "declared_from_layout": ".cases.variant",
    "CaseContext": ".cases.context", "context": ".cases.context",
    "Injection": ".cases.injection",
    "Layout": ".cases.layout", "LayoutError": ".cases.layout", "MeshSpec": ".cases.layout", "ParamSpec": ".cases.layout",
    "Replicate": ".cases.layout", "Shard": ".cases.layout", "param": ".cases.layout",
    "Scenario": ".cases.scenario", "ScenarioOptions": ".cases.scenario",
    "check": ".api", "CheckReport": ".api",
    "audit": ".auditor", "auditing": ".auditor", "AuditReport": ".auditor",
}


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AuditReport",
    "CaseContext",
    "CaseSpec",
    "CheckReport",
    "Injection",
    "Layout",
    "LayoutError",
    "MeshAxis",
    "MeshSpec",
    "ParamSpec",
    "Replicate",
    "Scenario",
    "ScenarioOptions",
    "Shard",
    "Variant",
    "audit",
    "auditing",
    "check",
    "context",
    "declared_from_layout",
    "param",
]
