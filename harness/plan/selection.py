"""Which of a scenario's layouts a matrix selects, by label and by kind, and what to say when a
selection leaves a scenario none.

Three filters, in this order, each over what the one before kept:

* ``variant`` (``--variant``, repeatable): keep a layout whose label matches any of the patterns;
* ``exclude`` (``--exclude``, repeatable): drop a layout whose label matches any of them;
* ``parallelism`` (``--parallelism ep,fsdp``): keep a layout whose kinds (``cases.parallelism``) are a
  subset of the selected ones.

A pattern matches a label the same way for both label filters (``label_matches``): ``=LABEL`` is that
one label exactly (what a replay command names); any other text matches a label that contains it, with
``*`` and ``?`` as in shell patterns. A selection is a request, not an impossible combination: what it
removes is not counted among the dropped combinations, but a scenario it leaves empty is said, once,
naming the filter that removed its last layouts (``Emptied``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable, Sequence

from harness.cases.matrix import MatrixSpec
from harness.cases.parallelism import parallelism_of
from harness.cases.variant import Variant


def label_matches(label: str, pattern: str) -> bool:
    """``=LABEL``: exactly that label; any other text: a label containing it (``*``, ``?`` as in shell
    patterns)."""
    if pattern.startswith("="):
        return label == pattern[1:]
    return fnmatch.fnmatchcase(label, f"*{pattern}*")


@dataclass(frozen=True)
class Emptied:
    """A scenario whose every layout at one world size one selection removed: which selection, and, for
    ``parallelism``, the kinds of the layouts it removed (what the user would have to select to keep
    them). ``named``: the matrix names the scenario (rather than running every one), so a line says so."""

    scenario: str
    world_size: int
    selection: str
    """The filter and its values as a user wrote them: ``parallelism ep,fsdp``, ``variant 'zzz'``."""
    kinds: tuple[str, ...] = ()
    named: bool = True

    def line(self, worlds: str | None = None) -> str:
        """One line; ``worlds``: the world sizes it stands for (several, in a matrix)."""
        return (f"scenario {self.scenario}: {self.selection} leaves none of its layouts at world "
                f"{worlds or self.world_size}" + (f" (their kinds: {', '.join(self.kinds)})" if self.kinds else ""))


def select_variants(scenario: str, variants: Sequence[Variant], spec: MatrixSpec,
                    world_size: int) -> tuple[list[Variant], Emptied | None]:
    """The variants ``spec``'s selection keeps, and the ``Emptied`` of a selection that kept none of
    them (None when something is left, or when there was nothing to select from)."""
    def quoted(patterns: tuple[str, ...]) -> str:
        return ", ".join(repr(p) for p in patterns)

    # (how the user wrote it, what it keeps, whether an emptied scenario's kinds explain it)
    filters: list[tuple[str, Callable[[Variant], bool], bool]] = []
    if spec.variant:
        filters.append((f"variant {quoted(spec.variant)}",
                        lambda v: any(label_matches(v.label, p) for p in spec.variant), False))
    if spec.exclude:
        filters.append((f"exclude {quoted(spec.exclude)}",
                        lambda v: not any(label_matches(v.label, p) for p in spec.exclude), False))
    if spec.parallelism:
        filters.append((f"parallelism {','.join(spec.parallelism)}",
                        lambda v: parallelism_of(v.layout).within(spec.parallelism), True))
    kept = list(variants)
    for selection, keep, by_kind in filters:
        before, kept = kept, [v for v in kept if keep(v)]
        if before and not kept:
            kinds = sorted({parallelism_of(v.layout).label for v in before}) if by_kind else []
            return [], Emptied(scenario, world_size, selection, tuple(kinds), named=scenario in spec.scenarios)
    return kept, None


def emptied_summary(emptied: Sequence[Emptied]) -> list[str]:
    """One line per selection that emptied scenarios, naming them (the reason a plan with no case gives)."""
    by_selection: dict[str, list[Emptied]] = {}
    for entry in emptied:
        by_selection.setdefault(entry.selection, []).append(entry)
    lines = []
    for selection, entries in by_selection.items():
        kinds = sorted({kind for entry in entries for kind in entry.kinds})
        lines.append(f"{selection} leaves no layout of {', '.join(e.scenario for e in entries)}"
                     + (f" (their kinds: {', '.join(kinds)})" if kinds else ""))
    return lines


def emptied_across_worlds(emptied: Sequence[Emptied]) -> list[str]:
    """The named scenarios' ``Emptied`` of several world sizes (``clipcheck matrix``), one line per
    scenario and selection, listing the worlds it left without a layout."""
    worlds: dict[tuple[str, str], list[int]] = {}
    kinds: dict[tuple[str, str], set[str]] = {}
    for entry in emptied:
        if entry.named:
            key = (entry.scenario, entry.selection)
            worlds.setdefault(key, []).append(entry.world_size)
            kinds.setdefault(key, set()).update(entry.kinds)
    return [Emptied(scenario, at[0], selection, tuple(sorted(kinds[scenario, selection]))).line(
                ", ".join(map(str, sorted(set(at))))) for (scenario, selection), at in worlds.items()]
