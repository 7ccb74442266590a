"""clipcheck: a correctness harness for gradient-norm computation and clipping in distributed training.

Public API for users writing their own clip targets or scenarios:

* ``context(model)`` -> ``CaseContext``: the mesh, groups, declared plan and true layout of a case.
* layout building blocks: ``MeshSpec``, ``ParamSpec``, ``param``, ``Layout``, ``Shard``, ``Replicate``.
* ``Injection`` (what the gradients are), ``Variant`` and ``Scenario`` (a family of layouts).
"""

from .case import CaseSpec, Variant, declared_from_layout
from .context import CaseContext, context
from .injection import Injection
from .layout import Layout, LayoutError, MeshSpec, ParamSpec, Replicate, Shard, param
from .scenario import Scenario, ScenarioOptions

__all__ = [
    "CaseContext",
    "CaseSpec",
    "Injection",
    "Layout",
    "LayoutError",
    "MeshSpec",
    "ParamSpec",
    "Replicate",
    "Scenario",
    "ScenarioOptions",
    "Shard",
    "Variant",
    "context",
    "declared_from_layout",
    "param",
]
