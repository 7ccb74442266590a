"""The records clipcheck writes, as types: one judged case, one metamorphic group, one summary.

The same dicts travel from the runner (rank 0's reporter) to the JSON Lines file, through the matrix
merge, into JUnit, the compatibility table, the HTML page and ``harness.check``'s report, so their
fields are declared once here. Numbers that may be non-finite are written as the strings "nan",
"inf", "-inf" (``JsonNumber``) to keep every line valid JSON.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping, NotRequired, Sequence, TypeAlias, TypedDict, cast

from harness.clipmath import combine, root
from harness.cases.variant import CaseSpec
from harness.cases.layout import MeshSpec
from harness.cases.target import FindingRecord

JsonNumber: TypeAlias = "float | int | str | None"
"""A number as written: finite floats as themselves, non-finite ones as "nan"/"inf"/"-inf"."""

Verdict: TypeAlias = Literal["PASS", "FAIL", "ERROR", "SKIP"]


class Coefficients(TypedDict):
    """The factor each gradient was scaled by, as a rank measured it (``effects.applied_coefficients``,
    or the audit's paths with and without a copy)."""

    scale: dict[str, list[float]]
    """By parameter: [least-squares factor, largest residual relative to the gradient, elements]."""
    vanished: list[str]
    """Gradients that were there before the call and are gone after it."""
    became_nonfinite: list[str]
    """Gradients finite before the call and not after it."""


class RankLocal(Coefficients):
    """What one rank measured about the call, as the checks read it (each ``CheckSpec.reads`` names keys
    of this type). Built in one place, ``harness.run.case.effects.CallEffects.record``, for the runner,
    the audit and the judge's unit tests alike."""

    mangled: dict[str, str]
    """Gradients whose wrapper, shape, dtype, layout or device changed, with why."""
    replaced: list[str]
    """Gradients now in other storage (not scaled in place)."""
    created: list[str]
    """Gradients where there were none before the call."""
    params_changed: list[str]
    """Parameters whose values or ``requires_grad`` flags changed."""
    late: list[str]
    """Changes that came after the call had returned (threads it started)."""
    stale_truth: bool
    """The truth measured for an earlier case was reused on gradients that differ from it (a harness error)."""
    undelivered: list[str]
    """What a framework's gradient path failed to deliver as the layout says."""
    policies: NotRequired[list[str] | None]
    """Only in a case with a non-finite gradient: the non-finite policies this rank is consistent with
    (None when it holds no gradient)."""
    post_replicas: NotRequired[Any]
    """The runner's part of the post-call replication round (rank 0 merges them)."""
    implied: NotRequired[bool]
    """The audit only: the norm was implied by the coefficient applied (the clip returned nothing)."""


RankLocalKey: TypeAlias = Literal["scale", "vanished", "became_nonfinite", "mangled", "replaced", "created",
                                  "params_changed", "late", "stale_truth", "undelivered", "policies",
                                  "post_replicas", "implied"]
"""The keys of ``RankLocal``, as a type: a check's ``reads`` is checked against them (``tests/test_judging.py``
keeps the two lists the same)."""


class RankRecord(TypedDict):
    """One rank's record of a case, gathered by rank 0 and judged (``checks.evaluate``)."""

    reported: float | None
    error: str | None
    fault: str | None
    seconds: float
    local: RankLocal
    precision: NotRequired[str | None]
    """The precision of what the target returned ("fp32", ...), where the runner saw it."""
    post: NotRequired[dict[str, str | None]]
    """The audit only: each gradient's digest after the call (or "kept"), for the blame's put-back."""


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
    counting: dict[str, str]
    """Per parameter group, how its counting was established: by the case, in its own run, or why not."""
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


# -- in memory: what the runner measures and the judge reads, one home for both ---------------------------
@dataclass
class StatsTable:
    """Per-rank, per-parameter statistics, identical on every rank after one all-reduce.

    ``numel`` is -1 where a rank has no gradient for the parameter (absent or ``None``).
    ``pow_sum`` is sum |g|^p (max |g| for the inf norm) of the rank's local gradient.
    ``digests``: each rank's ``bits_digest`` per parameter (None where absent), when asked for.
    """

    names: list[str]
    numel: list[list[int]]
    itemsize: list[list[int]]
    pow_sum: list[list[float]]
    digests: list[dict[str, str | None]] | None = None
    kernel_error: list[list[float]] | None = None
    """Per rank and parameter: the relative error of torch's own norm kernel on that gradient
    (``clipmath.kernel_error``, signed): what the case's band is measured from (``harness.judge.band``)."""
    flat_error: list[float] | None = None
    """Per rank: the relative error of torch's kernel on one flat buffer of its gradients
    (``clipmath.flat_error``)."""

    @property
    def world_size(self) -> int:
        return len(self.numel)

    def present(self, rank: int, j: int) -> bool:
        return self.numel[rank][j] >= 0

    def local_norms(self, norm_type: float) -> list[float]:
        """Each rank's norm of everything it holds, with no cross-rank reduction."""
        out = []
        for r in range(self.world_size):
            total = 0.0
            for j in range(len(self.names)):
                if self.present(r, j):
                    total = combine(total, self.pow_sum[r][j], norm_type)
            out.append(root(total, norm_type))
        return out


@dataclass
class Replication:
    """Measured replication: ``distinct[axis][name]`` is True when some group of ``axis`` saw a spread.

    ``classes`` (a measured layout's, ``harness.audit``): per parameter, per rank, the key of the bits
    that rank holds (None: no gradient). Holdings with one key are copies of one logical gradient,
    under one name or several; where the layout is no mesh placement, the truth counts each key once
    and the replicas check asks every key's holders to stay alike (``harness.judge.truth``, ``checks``).
    """

    distinct: dict[str, dict[str, bool]]
    classes: dict[str, list[str | None]] | None = None

    def replicated_axes(self, name: str, mesh: MeshSpec) -> frozenset[str]:
        return frozenset(a for a in mesh.names if not self.distinct.get(a, {}).get(name, False))

    def describe(self, name: str, mesh: MeshSpec) -> str:
        parts = []
        rep = [d for d in mesh.names if mesh.size(d) > 1 and not self.distinct[d][name]]
        dis = [d for d in mesh.names if mesh.size(d) > 1 and self.distinct[d][name]]
        if rep:
            parts.append("replicated on " + ", ".join(rep))
        if dis:
            parts.append("distinct on " + ", ".join(dis))
        return "; ".join(parts) or "single rank"


@dataclass(frozen=True)
class Evidence:
    """What a hypothesis may use: the truth and the norms other mistakes would have produced."""

    truth: float
    norm_type: float
    mesh: MeshSpec
    local_norms: Sequence[float]
    declared_norm: float
    declared_mismatches: Sequence[str]
    unreduced: Mapping[str, Sequence[float]] = field(default_factory=dict)
    """Per mesh axis of size > 1: what each rank reports when the reduction skips that axis."""
    replicas_counted: Mapping[str, float] = field(default_factory=dict)
    """Per mesh axis of size > 1: the norm with copies along that axis counted as distinct."""
    max_norm: float | None = None
    """The case's bound: a clip that reports the norm after clipping reports it (when it clipped)."""
    replica_counts: frozenset[int] | None = None
    """The true replica counts (> 1) the layout's gradients have on some rank: the only group sizes a
    replica-factor reading may name (None: any, for evidence built without a layout)."""


@dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""


@dataclass(frozen=True)
class GroupWeight:
    group: str
    """Parameter names with their numeric path components as ``*`` (``layers.*.experts.lora_A``)."""
    params: int
    weight: float | None
    """reported^p / true^p with gradients in this group only; None when it cannot be attributed."""
    note: str = ""
    """Why it could not be attributed, or the declared-vs-measured contradiction of its parameters."""


@dataclass
class CaseResult:
    case: CaseSpec
    verdict: Verdict  # PASS | FAIL | ERROR (harness error) | SKIP (a framework it needs is missing)
    truth: float
    measured_truth: float
    reported: list[float | None]
    checks: list[Check]
    signature: list[str]
    placements: dict[str, str]
    mismatches: list[str]
    coefficient: float | None
    seconds: float
    errors: list[str | None] = field(default_factory=list)
    param_mismatches: dict[str, list[str]] = field(default_factory=dict)
    """Per parameter, its declared-vs-measured contradictions (``mismatches`` groups them)."""
    blame: list[GroupWeight] = field(default_factory=list)
    """The weight the target gave each parameter group (``harness.run.case.blame_reruns``), when asked."""
    blame_note: str = ""
    """Why the weights do not add up to the full case, when they do not."""
    blame_rank: int = 0
    """The rank whose reports the blame weighs."""
    tolerance: float = 0.0
    """The relative tolerance its norm was judged with (``harness.judge.tolerance``): 0 when unjudged."""
    evidence: Evidence | None = field(default=None, repr=False, compare=False)
    """What the signature was read from, kept for a second reading once the blame is known."""
    groups: dict[str, list[str]] = field(default_factory=dict, repr=False, compare=False)
    """The parameter groups whose counting is established, with their parameters (``blame.counting_groups``)."""
    moved: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    """Per parameter group, how far its weakest miscount moves this case's norm
    (``establishment.weakest_miscounts``): which groups the case itself establishes."""
    counting: dict[str, str] = field(default_factory=dict)
    """Per parameter group, how its counting was established (``harness.judge.establishment``)."""

    @property
    def ratio(self) -> float | None:
        r = self.reported[0] if self.reported else None
        if r is None or not math.isfinite(self.truth) or self.truth == 0:
            return None
        return r / self.truth

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]


