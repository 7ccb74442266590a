"""Turn command-line choices into the ordered list of cases, validating everything up front.

Planning is pure and deterministic, so every rank plans the same list; and it needs no process
group, so bad input is reported before any collective (and, from a launcher, before any process).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from .case import CaseSpec
from .injection import DTYPES
from .layout import LayoutError
from .loading import LoadError
from .registry import builtin_scenarios, resolve_scenario, target
from .scenario import Scenario, ScenarioOptions
from .targets import Target


class UsageError(ValueError):
    """Bad command-line input, reported as one clear line."""


@dataclass(frozen=True)
class Request:
    scenarios: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    ep_sizes: tuple[int, ...] | None = None
    norm_types: tuple[float, ...] = ()
    dtypes: tuple[str, ...] = ("fp32",)
    max_norm: float = 0.5
    seed: int = 0
    variant: str | None = None


@dataclass
class Plan:
    cases: list[CaseSpec]
    scenarios: dict[str, Scenario]
    targets: dict[str, Target]
    notes: list[str]


def plan_cases(request: Request, world_size: int) -> Plan:
    try:
        return _plan(request, world_size)
    except (LayoutError, LoadError) as exc:
        raise UsageError(str(exc)) from None


def _plan(request: Request, world_size: int) -> Plan:
    if not request.max_norm > 0:
        raise UsageError(f"--max-norm must be positive, got {request.max_norm}")
    for dtype in request.dtypes:
        if dtype not in DTYPES:
            raise UsageError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    names = request.scenarios or tuple(builtin_scenarios())
    scenarios = {name: resolve_scenario(name) for name in names}
    notes: list[str] = []
    if request.ep_sizes is not None:
        no_ep = [n for n, s in scenarios.items() if not s.uses_ep]
        if no_ep and request.scenarios:
            raise UsageError(f"--ep-size does not apply to {', '.join(no_ep)}: it has no expert parallelism")
        if no_ep:
            notes.append(f"--ep-size ignored for {', '.join(no_ep)} (no expert parallelism)")

    targets: dict[str, Target] = {}
    cases: list[CaseSpec] = []
    matched_variant = False
    for name, scenario in scenarios.items():
        target_names = request.targets or scenario.default_targets
        for t in target_names:
            if t not in targets:
                targets[t] = target(t, list(scenarios.values()))
        norm_types = request.norm_types or scenario.default_norm_types
        for dtype in request.dtypes:
            options = ScenarioOptions(
                seed=request.seed,
                dtype=dtype,
                ep_sizes=request.ep_sizes if scenario.uses_ep else None,
            )
            for variant in scenario.variants(world_size, options):
                variant.layout.check_world(world_size)
                if request.variant and not fnmatch.fnmatchcase(variant.label, f"*{request.variant}*"):
                    continue
                matched_variant = True
                for t in target_names:
                    for norm_type in norm_types:
                        cases.append(
                            CaseSpec(
                                index=len(cases),
                                scenario=name,
                                variant=variant,
                                target=t,
                                norm_type=norm_type,
                                max_norm=request.max_norm,
                            )
                        )
    if request.variant and not matched_variant:
        raise UsageError(f"--variant {request.variant!r} matches no layout variant")
    return Plan(cases=cases, scenarios=scenarios, targets=targets, notes=notes)
