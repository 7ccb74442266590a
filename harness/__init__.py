"""clipcheck: a correctness harness for gradient-norm computation and clipping in distributed training.

Public API for users writing their own clip targets or scenarios:

* ``context(model)`` -> ``CaseContext``: the mesh, groups, declared plan and true layout of a case.
* layout building blocks: ``MeshSpec``, ``ParamSpec``, ``param``, ``Layout``, ``Shard``, ``Replicate``.
* ``Injection`` (what the gradients are), ``Variant`` and ``Scenario`` (a family of layouts).
* ``check(target, scenarios=..., worlds=[2, 4])`` -> ``CheckReport``: the built-in scenarios against
  your clip from Python, on warm worlds (``harness.api``).
"""

import warnings

# ``harness.scenarios`` is the repository's top-level scenarios/ folder: in a checkout a finder maps it
# (stdlib only, no torch), so ``import harness.scenarios.deepspeed`` works wherever harness does
from harness.targets import builtin_scenarios as _scenarios_finder  # noqa: F401

# torch warns on import when numpy is absent; nothing in clipcheck needs numpy, so it is not a dependency
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

# Exports are imported on first use (PEP 562), so importing ``harness.pytest_plugin`` (every pytest
# start where clipcheck is installed) does not import torch.
_EXPORTS = {
    "MeshAxis": ".spec.axes",
    "CaseSpec": ".spec.case", "Variant": ".spec.case", "declared_from_layout": ".spec.case",
    "CaseContext": ".spec.context", "context": ".spec.context",
    "Injection": ".spec.injection",
    "Layout": ".spec.layout", "LayoutError": ".spec.layout", "MeshSpec": ".spec.layout", "ParamSpec": ".spec.layout",
    "Replicate": ".spec.layout", "Shard": ".spec.layout", "param": ".spec.layout",
    "Scenario": ".spec.scenario", "ScenarioOptions": ".spec.scenario",
    "check": ".api", "CheckReport": ".api",
}


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


__all__ = [
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
    "check",
    "context",
    "declared_from_layout",
    "param",
]
