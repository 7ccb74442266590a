"""clipcheck: a correctness harness for gradient-norm computation and clipping in distributed training.

Public API for users writing their own clip targets or scenarios:

* ``context(model)`` -> ``CaseContext``: the mesh, groups, declared plan and true layout of a case.
* layout building blocks: ``MeshSpec``, ``ParamSpec``, ``param``, ``Layout``, ``Shard``, ``Replicate``.
* ``Injection`` (what the gradients are), ``Variant`` and ``Scenario`` (a family of layouts).
* ``check(target, scenarios=..., worlds=[2, 4])`` -> ``CheckReport``: the built-in scenarios against
  your clip from Python, on warm worlds (``harness.api``).
* ``audit(model, clip, max_norm=...)`` -> ``AuditReport``, and ``auditing(...)``: your clip judged on your
  own model after your own backward, inside your own launch (``harness.auditor``).
* ``fuzz(target, pool, examples)`` -> ``FuzzReport``: layouts drawn by hypothesis, on a warm world
  (``RankPool``).
* ``ClipcheckError``: the root of every exception clipcheck raises on purpose.
"""

import importlib
import importlib.abc
import types
import warnings
from importlib.machinery import ModuleSpec
from typing import TYPE_CHECKING

# ``harness.scenarios`` is the repository's top-level scenarios/ folder: in a checkout a finder maps it
# (stdlib only, no torch), so ``import harness.scenarios.deepspeed`` works wherever harness does
from harness.targets import builtin_scenarios as _scenarios_finder  # noqa: F401

RENAMED = {
    "harness.spec": "harness.cases", "harness.spec.case": "harness.cases.variant",
    "harness.targets.frameworks": "harness.cases.frameworks", "harness.targets.loading": "harness.cases.loading",
    "harness.cases.plan": "harness.plan.planner", "harness.commands.project": "harness.plan.project",
    "harness.run.runner": "harness.run.case.runner",
    "harness.run.measure": "harness.run.case.measure",
    "harness.run.delivery": "harness.run.case.delivery",
    "harness.run.effects": "harness.run.case.effects",
    "harness.run.aftermath": "harness.run.case.model_state",
    "harness.run.replicas": "harness.run.case.replicas",
    "harness.run.truth_cache": "harness.run.case.truth_cache",
    "harness.run.blame": "harness.run.case.blame_reruns",
    "harness.run.release": "harness.run.world.release",
    "harness.run.devices": "harness.run.world.devices",
    "harness.run.torch_compat": "harness.run.world.torch_compat",
    "harness.run.startup": "harness.run.world.startup",
    "harness.run.execute": "harness.run.hosts.launch",
    "harness.run.pool": "harness.run.hosts.pool",
    "harness.run.on_pool": "harness.run.hosts.pool_cases",
    "harness.run.watchdog": "harness.run.guards.watchdog",
    "harness.run.leftovers": "harness.run.guards.leftovers",
    "harness.run.family": "harness.run.guards.family",
    "harness.run.audit_cheap": "harness.run.audit.without_copy",
    "harness.run.audit_exact": "harness.run.audit.with_copy",
    "harness.run.audit_mesh": "harness.run.audit.job_mesh",
    "harness.run.gradient_pass": "harness.run.audit.gradient_pass",
    "harness.run.user_world": "harness.run.audit.user_world",
}
"""Modules that moved, old name -> new: an import of an old name still works, with a DeprecationWarning,
and is the very module of the new name (one class identity). ``harness.spec`` became ``harness.cases``;
the run/ modules went into folders by role (``run.world`` and ``run.audit`` are now those folders' names,
so their old modules have no alias); the rest moved below the steps that used them."""


class _RenamedModules:
    """The import hook behind ``RENAMED`` (a package's submodules follow it: ``harness.spec.layout``)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> "ModuleSpec | None":
        if fullname in RENAMED:
            new = RENAMED[fullname]
        elif fullname.startswith("harness.spec."):
            new = RENAMED["harness.spec"] + fullname[len("harness.spec"):]
        else:
            return None
        import importlib.util

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
    "fuzz": ".fuzz", "FuzzReport": ".fuzz",
    "RankPool": ".run.hosts.pool",
    "ClipcheckError": ".errors",
}

if TYPE_CHECKING:  # what the checker should see: the function, not the submodule of the same name
    from harness.fuzz import fuzz as fuzz


def _export(name: str) -> object:
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    value = globals()[name] = _export(name)
    return value


class _NamedLikeItsModule:
    """An export named like the submodule it lives in (``harness.fuzz``: the function, in
    harness/fuzz.py). Importing a submodule binds it on its package once the submodule has run, so
    a plain lazy export would be the function or the module by import order (``from harness import
    fuzz`` the module wherever ``harness.fuzz`` was imported first). A data descriptor on the package's
    class outranks that binding: the name is always the export, and the submodule stays importable
    by its full name (``from harness.fuzz import FuzzReport``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, package: types.ModuleType | None, owner: type | None = None) -> object:
        if package is None:
            return self
        if self.name not in vars(package):
            vars(package)[self.name] = _export(self.name)
        return vars(package)[self.name]

    def __set__(self, package: types.ModuleType, value: object) -> None:
        if not isinstance(value, types.ModuleType):  # the import system binding the submodule: ignored
            vars(package)[self.name] = value

    def __delete__(self, package: types.ModuleType) -> None:
        vars(package).pop(self.name, None)


class _Package(types.ModuleType):
    fuzz = _NamedLikeItsModule()


_sys.modules[__name__].__class__ = _Package


__all__ = [
    "AuditReport",
    "CaseContext",
    "CaseSpec",
    "CheckReport",
    "ClipcheckError",
    "FuzzReport",
    "Injection",
    "Layout",
    "LayoutError",
    "MeshAxis",
    "MeshSpec",
    "ParamSpec",
    "RankPool",
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
    "fuzz",
    "param",
]
