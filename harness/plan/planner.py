"""Expand a matrix (scenario x target x ep_size x world x dtype x norm_type x backend) into the ordered
list of cases one launch runs, validating everything up front.

Planning is pure and deterministic, so every rank plans the same list; it needs no process group, so
a launcher can plan every world size before it starts a single process. A *name* that does not exist
(an unknown scenario, target or dtype) is bad input and raises ``UsageError``. A *combination* that
cannot exist (ep_size not dividing the world, experts not divisible by ep_size, a framework-specific
target paired with another framework's scenario, a world size or backend the matrix does not list)
is dropped and counted under its reason; only when nothing is left is that an error. What the
selection (``variant``, ``exclude``, ``parallelism``: ``harness.plan.selection``) removes was asked
for, not impossible: it is not counted, but a named scenario it empties gets a line
(``Plan.header_lines``), and a plan it leaves without a case is an error naming the selection.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from harness.errors import UsageError
from harness.cases.variant import CaseSpec, Variant, norm_label, with_honest_plan
from harness.cases.injection import DTYPES
from harness.cases.layout import LayoutError
from harness.cases.loading import LoadError
from harness.cases.matrix import MatrixSpec
from harness.cases.constructive import variant_truth
from harness.cases.parallelism import check_kinds
from harness.plan.selection import Emptied, emptied_summary, select_variants
from harness.targets.registry import builtin_scenarios, registered_targets, resolve_scenario
from harness.cases.scenario import Scenario, ScenarioOptions
from harness.cases.target import Target
from harness.targets.target import resolve_target


@dataclass
class Plan:
    cases: list[CaseSpec]
    scenarios: dict[str, Scenario]
    targets: dict[str, Target]
    notes: list[str] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    layouts: dict[str, list[Variant]] = field(default_factory=dict)
    """Each scenario's selected variants (of the scenarios some target runs with)."""
    emptied: list[Emptied] = field(default_factory=list)
    """The scenarios the selection left without a layout."""

    def header_lines(self) -> list[str]:
        """What a run prints before its cases: the notes, each named scenario the selection emptied,
        the dropped combinations."""
        return self.notes + [entry.line() for entry in self.emptied if entry.named] + self.drop_lines()

    def drop_lines(self) -> list[str]:
        total = sum(self.dropped.values())
        if not total:
            return []
        lines = [f"dropped {total} invalid combination(s):"]
        lines += [f"  {count} x {reason}" for reason, count in self.dropped.most_common()]
        return lines


def plan_cases(spec: MatrixSpec, world_size: int, backend: str) -> Plan:
    try:
        plan = _plan(spec, world_size, backend)
    except (LayoutError, LoadError) as exc:
        raise UsageError(str(exc)) from None
    if not plan.cases:
        raise UsageError(f"no valid cases at world size {world_size}: {_nothing_left(plan)}")
    return plan


def plan_layouts(spec: MatrixSpec, world_size: int) -> Plan:
    """The selected layouts of every scenario at one world size, without targets, bounds or cases
    (``clipcheck layouts``): the same expansion and selection as ``plan_cases``, the same errors."""
    try:
        plan = _begin(spec)
        for name, scenario in plan.scenarios.items():
            plan.layouts[name] = selected_variants(name, scenario, spec, world_size, plan)
    except (LayoutError, LoadError) as exc:
        raise UsageError(str(exc)) from None
    if not any(plan.layouts.values()):
        raise UsageError(f"no layout at world size {world_size}: {_nothing_left(plan)}")
    return plan


def _nothing_left(plan: Plan) -> str:
    return "; ".join([*emptied_summary(plan.emptied), *plan.dropped]) or "the matrix is empty"


def check_spec(spec: MatrixSpec) -> None:
    """Values no parser checks: the bounds, the dtypes and the parallelism kinds (``UsageError``, one
    line)."""
    if spec.max_norm is not None and not (math.isfinite(spec.max_norm) and spec.max_norm > 0):
        raise UsageError(f"max_norm must be positive, got {spec.max_norm}")
    if spec.max_norm is None and not spec.clip_ratios:
        raise UsageError("no clip bound: give clip_ratios or max_norm")
    for ratio in spec.clip_ratios:
        if not (math.isfinite(ratio) and ratio > 0):
            raise UsageError(f"clip ratios must be positive, got {ratio}")
    for dtype in spec.dtypes:
        if dtype not in DTYPES:
            raise UsageError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    try:
        check_kinds(spec.parallelism)
    except LayoutError as exc:
        raise UsageError(str(exc)) from None


def _begin(spec: MatrixSpec) -> Plan:
    """An empty plan of ``spec``'s scenarios, once its values are checked; ``ep_sizes`` given for
    scenarios without expert parallelism is a note, or an error when it applies to none of those named."""
    check_spec(spec)
    plan = Plan(cases=[], scenarios={name: resolve_scenario(name) for name in spec.scenarios or builtin_scenarios()},
                targets={})
    if spec.ep_sizes is not None:
        no_ep = [n for n, s in plan.scenarios.items() if not s.uses_ep]
        if no_ep and spec.scenarios and len(no_ep) == len(plan.scenarios):
            raise UsageError(f"--ep-size does not apply to {', '.join(no_ep)}: it has no expert parallelism")
        if no_ep:
            plan.notes.append(f"ep_size does not apply to {', '.join(no_ep)} (no expert parallelism)")
    return plan


def selected_variants(name: str, scenario: Scenario, spec: MatrixSpec, world_size: int, plan: Plan) -> list[Variant]:
    """``scenario``'s variants at ``world_size`` for each dtype and ep_size of ``spec`` (honest plans with
    ``plans = "honest"``), as its selection keeps them; a scenario the selection empties is recorded in
    ``plan.emptied``."""
    variants = _variants(scenario, spec, world_size, plan)
    if spec.plans == "honest":
        variants = [with_honest_plan(v) for v in variants]
    kept, emptied = select_variants(name, variants, spec, world_size)
    if emptied is not None:
        plan.emptied.append(emptied)
    return kept


def _plan(spec: MatrixSpec, world_size: int, backend: str) -> Plan:
    plan = _begin(spec)
    scenarios = plan.scenarios
    registered = registered_targets(list(scenarios.values()))
    for t in spec.targets:
        plan.targets[t] = resolve_target(t, registered)

    if spec.worlds and world_size not in spec.worlds:
        plan.dropped[f"world size {world_size} is not in the matrix {list(spec.worlds)}"] += 1
        return plan
    if spec.backends and backend not in spec.backends:
        plan.dropped[f"backend {backend} is not in the matrix {list(spec.backends)}"] += 1
        return plan

    groups: Counter[str] = Counter()  # bound groups planned per target, across scenarios
    for name, scenario in scenarios.items():
        targets_here = []
        for target_name in spec.targets or scenario.default_targets:
            resolved = plan.targets.setdefault(target_name, resolve_target(target_name, registered))
            if resolved.scenarios is not None and name not in resolved.scenarios:
                plan.dropped[f"target {target_name} runs with {', '.join(resolved.scenarios)}, not {name}"] += 1
                continue
            targets_here.append(target_name)
        if not targets_here:
            continue
        variants = plan.layouts[name] = selected_variants(name, scenario, spec, world_size, plan)
        scenario_skip = scenario.requires.unavailable() if scenario.requires else None
        skips = {t: scenario_skip or plan.targets[t].unavailable() for t in targets_here}  # probed once
        for variant in variants:
            partial = any(param.present_ranks is not None for param in variant.layout)
            for target_name in targets_here:
                resolved = plan.targets[target_name]
                if partial and resolved.dtensor_only:
                    plan.dropped[f"target {target_name} needs every parameter on every rank (DTensor); "
                                 f"{name} {variant.label} has parameters on some ranks only"] += 1
                    continue
                if variant.synthetic is not None and not spec.synthetic and not resolved.runs_synthetic:
                    trainer = f"{resolved.requires.name}'s trainer" if resolved.requires else "a known trainer"
                    plan.dropped[f"target {target_name}: synthetic layouts of {name} run only with --synthetic "
                                 f"(no known path of {trainer} reaches them)"] += 1
                    continue
                refusal = resolved.refuses(variant) if resolved.refuses is not None else None
                if refusal is not None:
                    plan.dropped[f"target {target_name} refuses some {name} layouts: {refusal}"] += 1
                    continue
                if resolved.dtypes is not None and variant.injection.dtype not in resolved.dtypes:
                    plan.dropped[f"target {target_name} supports dtype {', '.join(resolved.dtypes)} only"] += 1
                    continue
                for norm_type in spec.norm_types or scenario.default_norm_types:
                    if resolved.norm_types is not None and norm_type not in resolved.norm_types:
                        plan.dropped[f"target {target_name} supports norm types "
                                     f"{', '.join(norm_label(n) for n in resolved.norm_types)} only"] += 1
                        continue
                    # every other group of a target's bounds in reverse (x0.5, x2, x2, x0.5, ...): a clip that
                    # clips only on odd (or even) calls meets a case that needs clipping on both parities
                    ordered = bounds(spec, variant, norm_type)
                    if groups[target_name] % 2:
                        ordered.reverse()
                    groups[target_name] += 1
                    for max_norm, ratio in ordered:
                        plan.cases.append(CaseSpec(len(plan.cases), name, variant, target_name, norm_type,
                                                   max_norm, skips[target_name], ratio))
    return plan


def bounds(spec: MatrixSpec, variant: Variant, norm_type: float) -> list[tuple[float, float | None]]:
    """The clip bounds of one variant: the absolute ``max_norm``, or each ratio times the variant's
    true norm (computed from the generator alone, so planning stays free of communication). A
    non-finite truth has no scale: its ratios are used as bounds directly."""
    if spec.max_norm is not None:
        return [(spec.max_norm, None)]
    truth = variant_truth(variant, norm_type)
    scale = truth if math.isfinite(truth) and truth > 0 else 1.0
    return [(ratio * scale, ratio) for ratio in spec.clip_ratios]


def _variants(scenario: Scenario, spec: MatrixSpec, world_size: int, plan: Plan) -> list[Variant]:
    """Every variant for each requested ep_size and dtype; an impossible ep_size is dropped and counted."""
    ep_choices: list[tuple[int, ...] | None] = [None]
    if scenario.uses_ep and spec.ep_sizes is not None:
        ep_choices = [(ep,) for ep in spec.ep_sizes]
    out: list[Variant] = []
    for dtype in spec.dtypes:
        for ep in ep_choices:
            options = ScenarioOptions(seed=spec.seed, dtype=dtype, ep_sizes=ep)
            try:
                variants = scenario.variants(world_size, options)
            except LayoutError as exc:
                plan.dropped[str(exc)] += 1
                continue
            for variant in variants:
                variant.layout.check_world(world_size)
            out.extend(variants)
    return out
