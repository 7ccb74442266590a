"""The records clipcheck writes, as types: one judged case, one metamorphic group, one summary.

The same dicts travel from the runner (rank 0's reporter) to the JSON Lines file, through the matrix
merge, into JUnit, the compatibility table, the HTML page and ``harness.check``'s report, so their
fields are declared once here. Numbers that may be non-finite are written as the strings "nan",
"inf", "-inf" (``JsonNumber``) to keep every line valid JSON.
"""

from __future__ import annotations

import json
from typing import Iterable, Literal, TypeAlias, TypedDict, cast

JsonNumber: TypeAlias = "float | int | str | None"
"""A number as written: finite floats as themselves, non-finite ones as "nan"/"inf"/"-inf"."""

Verdict: TypeAlias = Literal["PASS", "FAIL", "ERROR", "SKIP"]


class CheckRecord(TypedDict):
    passed: bool
    detail: str


class BlameRecord(TypedDict):
    """The weight a target gave one parameter group (``harness.judge.blame.GroupWeight``)."""

    group: str
    params: int
    weight: JsonNumber
    note: str
    line: str


class FindingRecord(TypedDict):
    """What a real framework's FAIL is (``harness.targets.target.Finding``), and who reaches it."""

    upstream: str | None
    note: str
    reach: Literal["stock", "direct-call", "synthetic"]
    how: str
    owner: str | None
    repro: str | None
    text: str
    """The one line the reports show: the upstream report or 'new finding', the mechanism."""


class CaseRecord(TypedDict):
    """One case, written as soon as it is judged."""

    type: Literal["case"]
    framework: str | None
    index: int
    scenario: str
    layout: str
    mesh: dict[str, int]
    target: str
    norm_type: JsonNumber
    norm: str
    dtype: str
    max_norm: float
    clip_ratio: float | None
    seed: int
    world_size: int
    backend: str
    verdict: Verdict
    true_norm: JsonNumber
    measured_true_norm: JsonNumber
    reported: list[JsonNumber]
    ratio: JsonNumber
    tolerance: float
    coefficient: JsonNumber
    checks: dict[str, CheckRecord]
    signature: list[str]
    errors: list[str | None]
    measured_placements: dict[str, str]
    declared_mismatches: list[str]
    invariance_key: str | None
    skip_reason: str | None
    seconds: float
    blame: list[BlameRecord]
    blame_note: str
    blame_rank: int
    finding: FindingRecord | None
    """For a framework adapter's FAIL or ERROR: the finding it matches (None if none does, or for the
    harness's own targets)."""
    synthetic: str | None
    """Why no known path of the framework reaches this layout, for a synthetic regression layout."""


class MetamorphicRecord(TypedDict):
    """One group of layouts that must apply the same coefficient (same invariance key)."""

    type: Literal["metamorphic"]
    world_size: int
    backend: str
    scenario: str
    target: str
    norm: str
    dtype: str
    invariance_key: str
    bound: str
    coefficients: dict[str, float]
    norms: dict[str, float]
    gap: float
    passed: bool


class SummaryRecord(TypedDict):
    """The counts that close a results file (``harness.judge.verdicts.Counts``)."""

    type: Literal["summary"]
    cases: int
    passed: int
    failed: int
    harness_errors: int
    unjudged: int
    skipped: int
    metamorphic_groups: int
    metamorphic_failed: int
    ok: bool
    status: int


class FuzzRecord(TypedDict):
    """One target's fuzz run (``clipcheck fuzz --json``): written as soon as that target is done."""

    type: Literal["fuzz"]
    target: str
    world_size: int
    backend: str
    examples: int
    seconds: float
    passed: bool
    failed_at: int | None
    shrink_steps: int
    crash: str | None
    flaky: str | None
    """Set when the first failure did not come back on replay (a stateful or timing-dependent target)."""
    minimal: list[str]
    """The minimal case in words (mesh, parameters, injection), as ``clipcheck fuzz`` prints it."""
    result: CaseRecord | None
    """The minimal case as judged (blame included where it ran)."""
    replay: str | None


class InFlightRecord(TypedDict):
    """Written by rank 0 before each case (``Reporter.in_flight``): a file that ends with one and no
    case record for it lost its rank 0 in that case (``verdicts.count`` counts it as not judged)."""

    type: Literal["in_flight"]
    index: int
    scenario: str
    layout: str
    target: str
    world_size: int


Record: TypeAlias = "CaseRecord | MetamorphicRecord | SummaryRecord | InFlightRecord"


def read_records(path: str) -> list[Record]:
    """Every record of a JSON Lines results file (cases, metamorphic groups, the summary, in-flight
    markers). A line that is not a JSON object (one cut short when its writer was killed or the disk
    filled up) is left out: the case it held is then missing, and whoever planned it counts it as
    not judged."""
    records: list[Record] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line) if line.strip() else None
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(cast(Record, record))
    return records


def case_records(records: Iterable[Record]) -> list[CaseRecord]:
    """The case records among ``records`` (in order)."""
    return [cast(CaseRecord, r) for r in records if r.get("type") == "case"]


def metamorphic_records(records: Iterable[Record]) -> list[MetamorphicRecord]:
    """The metamorphic group records among ``records`` (in order)."""
    return [cast(MetamorphicRecord, r) for r in records if r.get("type") == "metamorphic"]
