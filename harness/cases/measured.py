"""A case measured on a real job (``harness.audit``): which ranks held bit-identical copies of which
gradient, as a layout the harness can judge and replay. Pure data and functions, no process groups.

How copies are found. Every rank sends, per gradient, its shape, dtype, a few sampled elements' raw
bits and its sums (``harness.run.audit.gradient_pass``). Holdings that differ in shape, dtype or any sampled
bit are different gradients, for certain; holdings that agree on all of them are *candidates*, and
only those are hashed whole (``measure.linear_digest``). A *class* is then every holding with the same
shape, dtype and bits (equal digests): one logical gradient, counted once by the truth, held by one
rank or many, under one parameter name or several (a weight tied between the first and the last
pipeline stage is one class once its copies are identical). Two exceptions:

* an all-zero gradient carries no norm whatever it is counted as; its bits say nothing about which
  parameter it belongs to, so all-zero holdings are classes of their own parameter name only (two
  experts without tokens are not "tied");
* identical non-zero gradients of two different parameters cannot be told from a tie: they are one
  class. For real gradients this takes a coincidence of every bit (or a parameter that is a copy).

The measured layout (``measured_variant``) is a ``Layout`` of ``Piece``s: each class one range of a
value space, each holding a piece of it at its own local shape and dtype, with the 2-norm measured;
gradients that were ``None`` on a rank are unique pieces with ``none_on``, all-zero classes
``zero_on``, non-finite ones a ``nonfinite`` element. Replayed (``clipcheck run --from-audit``) with
injected values scaled to the measured norms, its truth is the audit's (2-norm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from harness.cases.axes import MeshAxis
from harness.cases.injection import DTYPES, Injection
from harness.cases.layout import Layout, LayoutError, MeshSpec, ParamSpec, Piece, Placement, Replicate, Shard
from harness.cases.variant import DTensorAxes, Variant, sub_mesh_problem, whole_mesh_dims

SCENARIO = "audit"
"""The scenario name measured cases are reported under."""

_PRECISION_ORDER = ("fp64", "fp32", "fp16", "bf16")
"""Gradient dtypes from the most precise: a case's tolerance is its least precise gradient's."""


@dataclass(frozen=True)
class Holding:
    """One rank's gradient of one parameter, as the first round reported it (``Stats.record``)."""

    rank: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    itemsize: int
    pow: float
    zero: bool
    words: tuple[int, ...]
    first_nonfinite: tuple[int, str] | None
    sq: float
    kernel_error: float = 0.0
    """How far torch's own norm kernel is from this gradient's exact norm (an older record: unmeasured, 0)."""

    @classmethod
    def of(cls, rank: int, name: str, record: Sequence[Any]) -> "Holding":
        shape, dtype, numel, itemsize, power, zero, words, first, sq, *measured = record
        return cls(rank, name, tuple(shape), dtype, numel, itemsize, power, bool(zero), tuple(words),
                   None if first is None else (int(first[0]), str(first[1])), sq,
                   float(measured[0]) if measured else 0.0)

    @property
    def candidate_key(self) -> tuple[Any, ...]:
        """What every copy of this holding shares for certain (all-zero ones: their name too)."""
        return (self.shape, self.dtype, self.words, self.name if self.zero else None)


def holdings(records: Sequence[Mapping[str, Any]]) -> list[Holding]:
    """Every rank's gradients, rank by rank, each rank's in its own parameter order."""
    return [Holding.of(r, name, rec["grads"][name]) for r, rec in enumerate(records)
            for name, *_ in rec["params"] if rec["grads"].get(name) is not None]


def candidates(held: Sequence[Holding], world_size: int) -> list[list[str]]:
    """Per rank, the gradients that may be copies of another holding (the only ones to hash)."""
    seen: dict[tuple[Any, ...], int] = {}
    for h in held:
        seen[h.candidate_key] = seen.get(h.candidate_key, 0) + 1
    out: list[list[str]] = [[] for _ in range(world_size)]
    for h in held:
        if seen[h.candidate_key] > 1:
            out[h.rank].append(h.name)
    return out


def class_tokens(held: Sequence[Holding], digests: Sequence[Mapping[str, str]]) -> dict[tuple[int, str], str]:
    """Each holding's class key: its digest where it was hashed (prefixed by its name for an all-zero
    gradient), a key of its own where it has no candidate copy."""
    tokens = {}
    for h in held:
        digest = digests[h.rank].get(h.name) if h.rank < len(digests) else None
        if digest is None:
            tokens[(h.rank, h.name)] = f"only|{h.rank}|{h.name}"
        else:
            tokens[(h.rank, h.name)] = f"zero|{h.name}|{digest}" if h.zero else digest
    return tokens


def parameter_names(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every parameter name of the job, in the order the ranks list them (rank 0's first)."""
    names: dict[str, None] = {}
    for rec in records:
        for name, *_ in rec["params"]:
            names.setdefault(name)
    return list(names)


def tolerance_dtype(held: Sequence[Holding]) -> str:
    """The least precise gradient dtype the harness knows (its tolerance is the case's); fp32 if none."""
    known = [h.dtype for h in held if h.dtype in DTYPES]
    return max(known, key=_PRECISION_ORDER.index) if known else "fp32"


def world_mesh(world_size: int) -> MeshSpec:
    """The mesh of a job whose own mesh the audit does not know: every rank on one axis."""
    return MeshSpec(((MeshAxis.WORLD.value, world_size),))


def measured_variant(records: Sequence[Mapping[str, Any]], tokens: Mapping[tuple[int, str], str],
                     mesh: MeshSpec, declared: Mapping[str, Mapping[str, Placement]],
                     distinct: Mapping[str, Mapping[str, bool]], spans: DTensorAxes) -> Variant:
    """The measured case as a ``Variant``: the layout of ``Piece``s (see the module docstring), its
    injection, and a declared plan: the DTensor parameters' own placements (``declared``), and for
    every other parameter what was measured (nothing was declared, so nothing contradicts it). The
    DTensor parameters stay DTensors where ``not_as_dtensors`` allows, each on the sub-mesh of the
    axes ``spans`` says its mesh spanned (``Variant.dtensor_axes``; the whole mesh left unnamed)."""
    world = len(records)
    held = {(h.rank, h.name): h for h in holdings(records)}
    names = parameter_names(records)
    dtype = tolerance_dtype(list(held.values()))
    starts: dict[str, Piece] = {}
    pieces: dict[str, list[Piece | None]] = {name: [None] * world for name in names}
    trainable = dict.fromkeys(names, False)
    none_on: dict[str, set[int]] = {}
    zero_on: dict[str, set[int]] = {}
    nonfinite: list[tuple[str, int, str]] = []
    offset = 0
    for r, rec in enumerate(records):
        for name, param_dtype, requires_grad, shape in rec["params"]:
            trainable[name] = trainable[name] or bool(requires_grad)
            h = held.get((r, name))
            token = tokens[(r, name)] if h is not None else f"none|{r}|{name}"
            known = starts.get(token)
            if known is None:
                numel = math.prod(shape) if h is None else h.numel
                own_dtype = param_dtype if h is None else h.dtype
                norm = math.sqrt(h.sq) if h is not None and math.isfinite(h.sq) else None
                known = starts[token] = Piece(name, offset, tuple(shape) if h is None else h.shape,
                                              own_dtype if own_dtype != dtype and own_dtype in DTYPES else None,
                                              norm)
                offset += numel
                if h is not None and h.zero:
                    zero_on.setdefault(name, set()).add(r)
                if h is not None and h.first_nonfinite is not None:
                    nonfinite.append((name, known.start + h.first_nonfinite[0], h.first_nonfinite[1]))
            if h is None:
                none_on.setdefault(name, set()).add(r)
            pieces[name][r] = Piece(known.source, known.start, h.shape if h is not None else tuple(shape),
                                    known.dtype, known.norm)
    specs = []
    for name in names:
        extent = sum(p.numel for p in dict.fromkeys(q for q in pieces[name] if q is not None and q.source == name))
        specs.append(ParamSpec(name, (max(extent, 1),), trainable=trainable[name], pieces=tuple(pieces[name])))
    layout = Layout(mesh, tuple(specs))
    injection = Injection(dtype=dtype, none_on=tuple((n, frozenset(r)) for n, r in none_on.items() if trainable[n]),
                          zero_on=tuple((n, frozenset(r)) for n, r in zero_on.items()), nonfinite=tuple(nonfinite))
    plan = {name: {axis: declared[name][axis] if name in declared and axis in declared[name] else
                   Shard(0) if distinct.get(axis, {}).get(name) else Replicate() for axis in mesh.names}
            for name in names}
    label = f"{mesh.describe()} measured: {len(names)} params, {len(starts) - _unheld(starts)} gradients"
    dtensor = not_as_dtensors(layout, declared, spans) is None
    plain = frozenset(n for n in names if n not in declared) if dtensor else frozenset()
    whole = whole_mesh_dims(mesh.names)
    sub = {n: spans[n] for n in declared if spans[n] != whole} if dtensor else {}
    return Variant(label, layout, injection, plan, dtensor=dtensor, plain=plain, dtensor_axes=sub)


def spans_from(records: Sequence[Mapping[str, Any]]) -> dict[str, tuple[tuple[str, ...], ...]]:
    """Each DTensor parameter's mesh dims as the axes each spans (``job_mesh``), where every rank that
    declared it mapped its mesh, and mapped it the same way: a parameter left out is on a mesh the job's
    does not hold as a sub-mesh, which ``not_as_dtensors`` refuses."""
    seen: dict[str, set[tuple[tuple[str, ...], ...] | None]] = {}
    for rec in records:
        for name in rec["declared"]:
            dims = rec.get("spans", {}).get(name)
            seen.setdefault(name, set()).add(None if dims is None else tuple(tuple(dim) for dim in dims))
    return {name: dims for name, ways in seen.items() if len(ways) == 1 for dims in ways if dims is not None}


def not_as_dtensors(layout: Layout, declared: Mapping[str, Mapping[str, Placement]], spans: DTensorAxes
                    ) -> str | None:
    """Why the measured layout cannot hold its DTensor parameters as DTensors (None: it can). A replay
    builds them as ``harness.cases.model`` builds any DTensor variant's: on every rank, placed as declared,
    each on the sub-mesh of the job's mesh its own mesh spanned (``spans``), so torch's clip sees as many
    meshes as the job had; a parameter whose mesh is not such a sub-mesh (``spans`` leaves it out), or one
    torch cannot slice from the case's mesh, would be given a mesh it never had."""
    if layout.mesh.names == (MeshAxis.WORLD.value,):
        return "the job's mesh is unknown (harness.audit saw no DTensor parameter and was given no mesh=)"
    if not declared:
        return "the job held no DTensor parameters"
    partial = _partial(layout, declared)
    if partial:
        return f"DTensor parameters held by some ranks only: {_some(partial)}"
    unmapped = [name for name in declared if name not in spans]
    if unmapped:
        return f"DTensor parameters on a mesh that is not a sub-mesh of the job's mesh: {_some(unmapped)}"
    for name in declared:
        problem = sub_mesh_problem(layout.mesh.names, spans[name])
        if problem:
            return f"the sub-mesh of DTensor parameter {name} cannot be sliced from the job's mesh: {problem}"
    return None


def dtensor_replay_problem(variant: Variant) -> str | None:
    """Why a target that wraps every parameter as a DTensor over the whole mesh (``Target.dtensor_only``)
    cannot replay this measured layout (None: it can): its parameters are not DTensors there (see
    ``not_as_dtensors``: an audit file keeps only the outcome), or some are held by some ranks only."""
    layout = variant.layout
    if layout.mesh.names == (MeshAxis.WORLD.value,):
        return not_as_dtensors(layout, {}, {})
    if not variant.dtensor:
        return ("its gradients were not DTensors a replay can rebuild (plain tensors, or DTensors on a mesh that is "
                "not a sub-mesh of the job's: the audit's notes say which)")
    partial = _partial(layout, [spec.name for spec in layout])
    return f"parameters held by some ranks only: {_some(partial)}" if partial else None


def _partial(layout: Layout, names: Iterable[str]) -> list[str]:
    """Of ``names``, the parameters some rank of the layout does not hold."""
    world = layout.mesh.world_size
    return [name for name in names
            if (ranks := layout.param(name).present_ranks) is not None and len(ranks) < world]


def _some(names: Sequence[str], limit: int = 3) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _unheld(starts: Mapping[str, Piece]) -> int:
    return sum(1 for token in starts if token.startswith("none|"))


def mesh_from(axes: Sequence[Sequence[Any]] | None, world_size: int) -> MeshSpec:
    """The mesh the ranks reported (names and sizes), or the one-axis world mesh."""
    if not axes:
        return world_mesh(world_size)
    try:
        mesh = MeshSpec(tuple((str(name), int(size)) for name, size in axes))
        mesh.check_world(world_size)
    except LayoutError:
        return world_mesh(world_size)
    return mesh


def placement_from(text: Any) -> Placement:
    """``"R"`` or a tensor dim, as the ranks send declared placements."""
    return Replicate() if text == "R" else Shard(int(text))


AUDIT_FORMAT = "clipcheck-audit/1"
"""The first line's ``format`` of a file ``AuditReport.save`` writes."""


@dataclass(frozen=True)
class AuditFile:
    """A measured case as saved: the variant, its norm and bound, the world it ran on, and what the
    audit found there (truth, reports, verdict), for the replay to be compared with."""

    variant: Variant
    norm_type: float
    max_norm: float
    world_size: int
    found: Mapping[str, Any]


def audit_doc(variant: Variant, norm_type: float, max_norm: float, world_size: int,
              found: Mapping[str, Any]) -> dict[str, Any]:
    """What ``AuditReport.save`` writes (JSON): the format, the case (``blob.variant_doc``) and the audit's
    findings. A file names no target: the replay's target comes from its command line."""
    from harness.cases.blob import variant_doc

    return {"format": AUDIT_FORMAT, "world": world_size, "norm": norm_type if math.isfinite(norm_type) else "inf",
            "max_norm": max_norm, "found": dict(found), "case": variant_doc(variant)}


def read_audit(path: str) -> AuditFile:
    """An audit file, validated like a replay blob; LayoutError (one line) for anything else."""
    import json

    from harness.cases.blob import MAX_WORLD, variant_from_doc
    from harness.cases.variant import parse_norm_type

    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as exc:
        raise LayoutError(f"cannot read audit file {path!r}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LayoutError(f"{path!r} is not an audit file (not JSON: {exc})") from None
    try:
        if not isinstance(doc, dict) or doc.get("format") != AUDIT_FORMAT:
            raise ValueError(f"its format is not {AUDIT_FORMAT!r}")
        variant = variant_from_doc(doc["case"], int(doc["world"]))
        if not variant.layout.measured:
            raise ValueError("it holds no measured layout")
        world = int(doc["world"])
        if not 1 <= world <= MAX_WORLD:
            raise ValueError(f"world size {world} is outside 1..{MAX_WORLD}")
        variant.layout.check_world(world)
        max_norm = float(doc["max_norm"])
        if not (math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"max_norm must be a positive finite number, got {doc['max_norm']!r}")
        found = doc.get("found", {})
        if not isinstance(found, dict):
            raise ValueError("its findings are not a table")
        return AuditFile(variant, parse_norm_type(str(doc["norm"])), max_norm, world, found)
    except LayoutError as exc:
        raise LayoutError(f"audit file {path!r} describes an invalid case: {exc}") from None
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise LayoutError(f"{path!r} is not an audit file ({exc.__class__.__name__}: {exc})") from None


def measured_scenario() -> Any:
    """The scenario measured cases are replayed under: the harness's generic model of the layout,
    nothing dressed (``clipcheck run --from-audit``)."""
    from harness.cases.scenario import Scenario, ScenarioOptions

    class MeasuredScenario(Scenario):
        name = SCENARIO
        summary = "a layout measured on a real job by harness.audit (clipcheck run --from-audit)"

        def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
            return []

    return MeasuredScenario()
