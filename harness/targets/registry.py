"""Name -> scenario and name -> target lookups, built-ins and scenario-provided together."""

from __future__ import annotations

from harness.targets.builtin_scenarios import scenarios_package
from harness.cases.loading import LoadError, is_import_path, load_object, unknown_name
from harness.cases.scenario import Scenario
from harness.cases.target import Target
from harness.targets.target import BUILTIN_TARGETS


def builtin_scenarios() -> dict[str, Scenario]:
    """The scenarios shipped with the running harness (``harness.scenarios``), never the cwd's."""
    return {cls.name: cls() for cls in scenarios_package().SCENARIOS}


def resolve_scenario(name: str) -> Scenario:
    known = builtin_scenarios()
    if name in known:
        return known[name]
    if is_import_path(name):
        obj = load_object(name)
        scenario = obj() if isinstance(obj, type) else obj
        if not isinstance(scenario, Scenario):
            raise LoadError(f"{name!r} is not a harness.cases.scenario.Scenario")
        return scenario
    raise unknown_name("scenario", name, known, "Class")


def registered_targets(scenarios: list[Scenario] | None = None) -> dict[str, Target]:
    """Built-in targets, mutants, framework adapters, and every scenario's own (built-in and given)."""
    from harness.targets.mutants import MUTANTS

    found = dict(BUILTIN_TARGETS)
    found.update(MUTANTS)
    found.update({t.name: t for t in scenarios_package().ADAPTER_TARGETS})
    for scenario in list(builtin_scenarios().values()) + list(scenarios or []):
        found.update(scenario.targets)
    return found

