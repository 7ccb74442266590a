"""The end of a run, one way for every command that ends one: rank 0's ``Reporter.finish`` (a torchrun
launch, ``harness.check``, a replay), ``clipcheck run``'s launcher and ``clipcheck matrix``.

The judged case records are grouped into metamorphic groups and counted into the summary, and every
file is written from those same records, in one order: JSON Lines (cases, groups, summary), JUnit,
then the HTML page where one is asked for. So a file added to a run's end, or a change to what closes
one, is made here once, and the three cannot drift apart. A file that cannot be written is one line on
stderr and exit status 5 (``results_file``); the verdicts are on the console either way.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence, cast

from harness.judge.establishment import counting_line
from harness.judge.metamorphic import MetamorphicResult, metamorphic_groups
from harness.judge.records import MetamorphicRecord, Record, SummaryRecord
from harness.judge.verdicts import Counts, count, worst
from harness.report.html import write_html
from harness.report.junit import write_junit
from harness.report.results_file import ResultsFile, report_problems, write_records

def metamorphic_json(group: MetamorphicResult, backend: str) -> MetamorphicRecord:
    """A metamorphic group as the record that files and views read."""
    return {
        "type": "metamorphic",
        "world_size": group.world_size,
        "backend": backend,
        "scenario": group.scenario,
        "target": group.target,
        "norm": group.norm_label,
        "dtype": group.dtype,
        "invariance_key": group.key,
        "bound": group.bound,
        "coefficients": group.coefficients,
        "norms": group.norms,
        "gap": group.gap,
        "passed": group.passed,
    }


@dataclass(frozen=True)
class FinishedRun:
    """What a run's end wrote, and what its command still prints and exits with."""

    records: list[Record]
    """Everything the files hold: the cases, then the metamorphic groups, then the summary."""
    groups: list[MetamorphicRecord]
    summary: SummaryRecord
    counts: Counts
    problems: list[str | None]
    """One line for each file that could not be written (None for each that was)."""
    page: str | None
    """Where the HTML page is, or why it is not there; None when none was asked for."""

    @property
    def counting(self) -> str | None:
        """How the run's cases established each parameter group's counting, in one line
        (``establishment.counting_line``), or None where none was."""
        return counting_line(cast(Mapping[str, str], r.get("counting") or {}) for r in self.records
                             if r.get("type") == "case")

    def exit_status(self, *more: int) -> int:
        """Print each problem on stderr and return the run's status: the worst of the counts', the
        ``more`` a command adds (a crashed launch), and 5 when a file could not be written."""
        return report_problems(self.problems, worst(self.counts.status, *more), sys.stderr)


def finish_run(launches: Sequence[tuple[Sequence[Record], str]], jsonl: ResultsFile | str | None,
               junit: str | None, html: Path | None = None, problems: Iterable[str | None] = ()) -> FinishedRun:
    """End a run made of ``launches``, each its case records and its backend (a metamorphic group is
    formed within one launch: two backends at one world size are two groups).

    ``jsonl``: the results file written case by case (a ``ResultsFile``: the groups and the summary
    follow its cases, and it is closed), a path to write whole, or None. ``problems``: what already
    went wrong with the files, reported first. The files are written before anything is printed; the
    caller prints, then calls ``exit_status``."""
    cases = [record for records, _ in launches for record in records]
    groups = [metamorphic_json(g, backend) for records, backend in launches for g in metamorphic_groups(records)]
    counts = count([*cases, *groups])
    summary = counts.as_record()
    everything: list[Record] = [*cases, *groups, summary]
    problems = list(problems)
    if isinstance(jsonl, ResultsFile):
        for record in [*groups, summary]:
            jsonl.write(record)
        jsonl.close()
        problems.append(jsonl.problem())
    elif jsonl is not None:
        problems.append(write_records(jsonl, everything))
    if junit:
        problems.append(write_junit(junit, everything))
    page = None
    if html is not None:
        try:
            page = str(write_html(everything, html))
        except OSError as exc:
            page = f"not written ({exc.strerror or exc})"
            problems.append(f"cannot write {html}: {exc.strerror or exc}")
    return FinishedRun(everything, groups, summary, counts, problems, page)
