"""``clipcheck layouts``: what a clip is handed on each layout the selection plans, without running it.

    clipcheck layouts --scenario fsdp2_meshes --nproc 4
    clipcheck layouts --scenario xorl_ep_lora --nproc 4 --parallelism ep,fsdp --json

Per layout: its canonical kinds (``cases.parallelism``), mesh and gradient dtype; per parameter: the
gradient's kind (DTensor or plain), local and logical shape, the ranks holding it, and its declared
placement on each mesh axis (``cases.handed``). Pure planning, the planner's own (``plan_layouts``):
no process group starts, so it answers at once, and bad input is one line and exit status 2, as for
``clipcheck run``. The layouts are those a clip of your own meets: the first dtype of the selection
only (layouts do not differ by dtype but for it), and the synthetic ones only with ``--synthetic``.
``--json`` prints one JSON document (``{"layouts": [...], "notes": [...]}``) instead of the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from harness.cases.handed import HandedParam, handed
from harness.cases.matrix import MatrixSpec
from harness.cases.parallelism import parallelism_of
from harness.cases.scenario import Scenario
from harness.cases.variant import Variant
from harness.commands.options import add_layout_selection_options, print_error, spec_from_args, world_sizes
from harness.errors import ClipcheckInputError
from harness.judge.verdicts import EXIT_USAGE
from harness.plan.planner import Plan, check_spec, plan_layouts
from harness.plan.selection import Emptied, emptied_across_worlds
from harness.plan.project import project_defaults
from harness.report.safe_text import one_line
from harness.targets.registry import registered_targets

DEFAULT_WORLD = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clipcheck layouts", allow_abbrev=False,
                                description="What a clip is handed on each selected layout: per parameter, the "
                                            "gradient's kind (DTensor or plain), local shape, declared placements "
                                            "and mesh axes; the layout's kinds of parallelism. Starts no process.")
    p.add_argument("--nproc", default=None, metavar="N[,N]",
                   help=f"world size(s), comma separated (default: [tool.clipcheck] worlds, else {DEFAULT_WORLD})")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    add_layout_selection_options(p)
    return p


def _worlds(text: str | None, spec: MatrixSpec) -> list[int]:
    if text is None:
        return list(spec.worlds) or [DEFAULT_WORLD]
    return world_sizes(text, "--nproc")


@dataclass(frozen=True)
class Shown:
    """One layout as the command shows it."""

    scenario: str
    world_size: int
    variant: Variant
    params: tuple[HandedParam, ...]
    dressed_by: tuple[str, ...]
    """The targets of the scenario that set the model up their framework's way first (``dress``)."""
    own_build: bool
    """The scenario builds its model itself (``build_model`` overridden): it may hand something else."""

    def record(self) -> dict[str, Any]:
        kinds = parallelism_of(self.variant.layout)
        return {"scenario": self.scenario, "world_size": self.world_size, "label": self.variant.label,
                "kinds": kinds.names, "unknown_axes": list(kinds.unknown),
                "mesh": dict(self.variant.layout.mesh.axes), "dtype": self.variant.injection.dtype,
                "synthetic": self.variant.synthetic, "dressed_by": list(self.dressed_by), "own_build": self.own_build,
                "parameters": [p.record() for p in self.params]}


def shown_layouts(plan: Plan, world_size: int, synthetic: bool) -> tuple[list[Shown], int]:
    """Every selected layout of ``plan`` as shown, and how many synthetic ones were left out."""
    targets = registered_targets(list(plan.scenarios.values()))
    out, hidden = [], 0
    for name, variants in plan.layouts.items():
        scenario = plan.scenarios[name]
        dressed = tuple(sorted(t.name for t in targets.values()
                               if t.dress is not None and t.scenarios is not None and name in t.scenarios))
        own_build = type(scenario).build_model is not Scenario.build_model
        for variant in variants:
            if variant.synthetic is not None and not synthetic:
                hidden += 1
                continue
            out.append(Shown(name, world_size, variant, tuple(handed(variant)), dressed, own_build))
    return out, hidden


def _placements(param: HandedParam) -> str:
    text = " ".join(f"{axis}={p}" for axis, p in param.declared.items())
    lies = {axis: p for axis, p in param.true.items() if param.declared[axis] != p}
    return text + (f" (true: {' '.join(f'{a}={p}' for a, p in lies.items())})" if lies else "")


def text_lines(shown: Sequence[Shown]) -> list[str]:
    """The table: a heading per scenario and world, a line per layout, a line per parameter."""
    lines = ["per parameter: its gradient (DTensor, plain, or none: frozen), local shape of the logical shape, the "
             "ranks holding it, its declared placement on each mesh axis (the true one where the plan lies), and a "
             "DTensor's own mesh where it is not the layout's whole mesh"]
    heading = None
    for layout in shown:
        if (layout.scenario, layout.world_size) != heading:
            heading = (layout.scenario, layout.world_size)
            lines.append(f"{layout.scenario} at world {layout.world_size}:")
            if layout.dressed_by:
                lines.append(f"  (targets {', '.join(layout.dressed_by)} set the model up their framework's way first "
                             "(dress) and may be handed other kinds; a clip of your own is handed what is below)")
            if layout.own_build:
                lines.append("  (this scenario builds its model itself: what it hands may differ from below)")
        kinds = parallelism_of(layout.variant.layout)
        synthetic = f"  synthetic: {layout.variant.synthetic}" if layout.variant.synthetic else ""
        lines.append(one_line(f"  {layout.variant.label}  [{kinds.label}]  mesh {layout.variant.layout.mesh.describe()}"
                              f"  {layout.variant.injection.dtype}{synthetic}"))
        width = max(len(p.name) for p in layout.params) if layout.params else 0
        for p in layout.params:
            ranks = "all ranks" if p.ranks is None else f"ranks {','.join(map(str, p.ranks))}"
            none = f"  no grad on ranks {','.join(map(str, p.no_grad_on))}" if p.no_grad_on else ""
            on = f"  (DTensor mesh: {', '.join(p.dtensor_mesh)})" if p.dtensor_mesh else ""
            lines.append(one_line(f"    {p.name:<{width}}  {p.grad:<7}  local {str(p.local_shape):<12} of "
                                  f"{str(p.shape):<12}  {ranks:<10}  {_placements(p)}{on}{none}"))
    return lines


def json_document(shown: Sequence[Shown], notes: Sequence[str]) -> str:
    """One JSON document, ``{"layouts": [...], "notes": [...]}``, a layout to a line (greppable, and one
    ``json.loads`` reads it whole)."""
    layouts = ",\n".join(json.dumps(layout.record()) for layout in shown)
    return f'{{"layouts": [\n{layouts}\n], "notes": {json.dumps(list(notes))}}}'


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = spec_from_args(args, project_defaults())
        spec = dataclasses.replace(spec, dtypes=spec.dtypes[:1])
        check_spec(spec)
        shown: list[Shown] = []
        notes: list[str] = []
        emptied: list[Emptied] = []
        hidden = 0
        problems = []
        for world in _worlds(args.nproc, spec):
            try:
                plan = plan_layouts(spec, world)
            except ClipcheckInputError as exc:
                problems.append(str(exc))
                continue
            found, left_out = shown_layouts(plan, world, spec.synthetic)
            shown += found
            hidden += left_out
            emptied += plan.emptied
            notes += [f"world {world}: {note}" for note in plan.notes + plan.drop_lines()]
        if not shown:
            raise ClipcheckInputError("; ".join(problems) or "no layout to show")
    except ClipcheckInputError as exc:
        print_error(exc)
        return EXIT_USAGE
    notes = problems + emptied_across_worlds(emptied) + notes
    if hidden:
        notes.append(f"{hidden} synthetic layout(s) not shown: a clip of your own meets them only with --synthetic")
    _print(json_document(shown, notes) if args.json else
           "\n".join(text_lines(shown) + [f"note: {one_line(note)}" for note in notes]))
    return 0


def _print(text: str) -> None:
    """Print ``text``; a reader that stops early (``| head``) ends the output quietly, as for a filter."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush writes nowhere
