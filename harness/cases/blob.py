"""Replay blobs: one drawn case (layout, plan, gradients, norm, bound, target, world size) in a
single copy-pasteable token, so a shrunk fuzz failure is one command away from being rerun.

    python -m harness --replay <blob>                               # starts the ranks it needs
    torchrun --nproc_per_node=N -m harness --replay <blob>          # or under torchrun

This module is the blob format (and the one-case spec it stands for); running one is
``harness.commands.replay``.

The blob is zlib-compressed JSON in URL-safe base64, and it is data from someone else:

* it names a *target*, and a target is code: a built-in name is harmless, but a ``module:function``
  is imported (the working directory is on the import path: ``evilmod:fn`` runs ``./evilmod.py``)
  and a ``path/to/file.py:function`` executed, on every rank. A blob may therefore name such a
  target only when the command line names the same one (``--target``); the replay command the
  fuzzer prints does;
* every field is checked for its JSON type (a shape of ``4.5`` or ``"4"`` is an error, not a
  coercion), the mesh must hold exactly the blob's world, the parameters at most ``MAX_ELEMENTS``
  elements in all (a blob cannot make every rank allocate 2**40 of them), and names and labels must be
  printable (a newline or an ANSI escape in a label could forge a line of the report);
* its world size is capped, its decompressed size too, and its norm type and bound get the same
  validation as the command line's.
"""

from __future__ import annotations

import base64
import json
import math
import shlex
import sys
import zlib
from typing import Any, Callable, Mapping, Sequence, TypeVar

from harness.cases.variant import CaseSpec, Variant, parse_norm_type
from harness.cases.injection import Injection
from harness.cases.json_numbers import json_float
from harness.cases.layout import Layout, LayoutError, MeshSpec, ParamSpec, Piece, Placement, Replicate, Shard
from harness.errors import UsageError
from harness.cases.loading import is_import_path
from harness.cases.drawn import DrawnCase, DrawnScenario

_PREFIX = "cc1."
MAX_WORLD = 64
MAX_DECOMPRESSED = 1 << 20
MAX_ELEMENTS = 1 << 22
"""Logical elements a blob's parameters may hold in all (drawn cases hold a few thousand)."""

T = TypeVar("T")


def _placement(p: Placement) -> Any:
    return p.dim if isinstance(p, Shard) else "R"


def _unplacement(x: Any) -> Placement:
    return Replicate() if x == "R" else Shard(_int(x, "a placement (\"R\" or a tensor dim)"))


def _int(x: Any, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise LayoutError(f"{what} must be an integer, got {x!r}")
    return x


def _number(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise LayoutError(f"{what} must be a number, got {x!r}")
    return float(x)


def _bool(x: Any, what: str) -> bool:
    if not isinstance(x, bool):
        raise LayoutError(f"{what} must be true or false, got {x!r}")
    return x


def _name(x: Any, what: str) -> str:
    if not isinstance(x, str) or not x.isprintable():
        raise LayoutError(f"{what} must be printable text, got {x!r}")
    return x


def _list(x: Any, what: str, item: Callable[[Any], T]) -> list[T]:
    if not isinstance(x, list):
        raise LayoutError(f"{what} must be a list, got {x!r}")
    return [item(v) for v in x]


def _dict(x: Any, what: str) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise LayoutError(f"{what} must be an object, got {x!r}")
    return x


def variant_doc(variant: Variant) -> dict[str, Any]:
    """A variant as JSON-able data: what a blob (and an audit file, ``harness.cases.measured``) holds."""
    layout, injection = variant.layout, variant.injection
    doc: dict[str, Any] = {
        "label": variant.label,
        "mesh": [list(d) for d in layout.mesh.axes],
        "params": [
            [s.name, list(s.shape), {d: _placement(p) for d, p in s.placements},
             None if s.present_ranks is None else sorted(s.present_ranks), s.trainable]
            + ([[None if q is None else [q.source, q.start, list(q.shape), q.dtype, q.norm] for q in s.pieces]]
               if s.pieces is not None else [])
            for s in layout
        ],
        "declared": {n: {d: _placement(p) for d, p in axes.items()} for n, axes in variant.declared.items()},
        "dtensor": variant.dtensor,
        "plain": sorted(variant.plain),
        "injection": {
            "seed": injection.seed, "dtype": injection.dtype, "scale": injection.scale,
            "zero": sorted(injection.zero), "none_on": {n: sorted(r) for n, r in injection.none_on},
            "nonfinite": [list(x) for x in injection.nonfinite],
        },
    }
    if injection.zero_on:
        doc["injection"]["zero_on"] = {n: sorted(r) for n, r in injection.zero_on}
    if variant.dtensor_axes:  # absent: every DTensor on the whole mesh (what files written before it mean)
        doc["dtensor_axes"] = {n: [list(dim) for dim in dims] for n, dims in variant.dtensor_axes.items()}
    return doc


def variant_from_doc(doc: Mapping[str, Any], world: int | None = None) -> Variant:
    """The variant ``variant_doc`` wrote, every field checked for its JSON type (LayoutError, or KeyError
    for a missing field, if it is not one): a blob's and an audit file's (``harness.cases.measured``).
    ``world``: the world it must run on, checked against the mesh before any parameter is read."""
    mesh = MeshSpec(tuple(_list(doc["mesh"], "mesh", _mesh_axis)))
    if world is not None:
        mesh.check_world(world)
    params = tuple(_list(doc["params"], "params", _param))
    inj = _dict(doc["injection"], "injection")
    injection = Injection(
        seed=_int(inj["seed"], "injection seed"), dtype=_name(inj["dtype"], "injection dtype"),
        scale=_number(inj["scale"], "injection scale"),
        zero=frozenset(_list(inj["zero"], "injection zero", lambda n: _name(n, "a parameter name"))),
        none_on=_rank_sets(inj["none_on"], "injection none_on"),
        nonfinite=tuple(_list(inj["nonfinite"], "injection nonfinite", _nonfinite)),
        zero_on=_rank_sets(inj.get("zero_on", {}), "injection zero_on"))
    declared = {_name(n, "a parameter name"): {_name(d, "a mesh axis name"): _unplacement(p)
                                               for d, p in _dict(axes, "a declared placement").items()}
                for n, axes in _dict(doc["declared"], "declared").items()}
    return Variant(_name(doc["label"], "label"), Layout(mesh, params), injection, declared,
                   dtensor=_bool(doc.get("dtensor", False), "dtensor"),
                   plain=frozenset(_list(doc.get("plain", []), "plain", lambda n: _name(n, "a parameter name"))),
                   dtensor_axes={_name(n, "a parameter name"): tuple(_list(dims, "a sub-mesh", _dim))
                                 for n, dims in _dict(doc.get("dtensor_axes", {}), "dtensor_axes").items()})


def _dim(x: Any) -> tuple[str, ...]:
    return tuple(_list(x, "a sub-mesh dim", lambda a: _name(a, "a mesh axis name")))


def _rank_sets(x: Any, what: str) -> tuple[tuple[str, frozenset[int]], ...]:
    return tuple((_name(n, "a parameter name"), frozenset(_list(r, what, lambda v: _int(v, "a rank"))))
                 for n, r in _dict(x, what).items())


def encode(drawn: DrawnCase, target: str) -> str:
    doc = {"world": drawn.world_size, "target": target, "norm": json_float(drawn.norm_type), "max_norm": drawn.max_norm,
           **variant_doc(drawn.variant)}
    raw = zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 9)
    return _PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode(blob: str) -> tuple[DrawnCase, str]:
    """The drawn case and target a blob holds; UsageError for anything that is not a valid blob, or
    not a case that could run (``_case``)."""
    try:
        if not blob.startswith(_PREFIX):
            raise ValueError("unknown format")
        body = blob[len(_PREFIX):]
        inflater = zlib.decompressobj()
        raw = inflater.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)), MAX_DECOMPRESSED)
        if inflater.unconsumed_tail:
            raise ValueError(f"it decompresses to more than {MAX_DECOMPRESSED} bytes")
        doc = json.loads(raw)
    except RecursionError:
        raise UsageError("not a replay blob (its JSON is nested too deeply)") from None
    except (ValueError, TypeError, zlib.error) as exc:
        raise UsageError(f"not a replay blob ({exc.__class__.__name__}: {exc})") from None
    try:
        return _case(_dict(doc, "the blob"))
    except LayoutError as exc:
        raise UsageError(f"replay blob describes an invalid case: {exc}") from None
    except KeyError as exc:
        raise UsageError(f"replay blob describes an invalid case: it has no {exc}") from None


def _case(doc: dict[str, Any]) -> tuple[DrawnCase, str]:
    world = _int(doc["world"], "world")
    if not 1 <= world <= MAX_WORLD:
        raise LayoutError(f"world size {world} is outside 1..{MAX_WORLD}")
    variant = variant_from_doc(doc, world)
    total = sum(p.numel for p in variant.layout) + sum(  # a measured layout's pieces are allocated at their own shapes
        piece.numel for spec in variant.layout for piece in spec.pieces or () if piece is not None)
    if total > MAX_ELEMENTS:
        raise LayoutError(f"its parameters hold {total} elements, more than the {MAX_ELEMENTS} a replay may allocate")
    max_norm = doc["max_norm"]
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not (
            math.isfinite(max_norm) and max_norm > 0):
        raise LayoutError(f"max_norm must be a positive finite number, got {max_norm!r}")
    norm = doc["norm"]
    if isinstance(norm, bool) or not isinstance(norm, (str, int, float)):
        raise LayoutError(f"norm must be a number or its name, got {norm!r}")
    drawn = DrawnCase(variant, parse_norm_type(str(norm)), float(max_norm), world)
    return drawn, _name(doc["target"], "target")


def _mesh_axis(x: Any) -> tuple[str, int]:
    if not isinstance(x, list) or len(x) != 2:
        raise LayoutError(f"a mesh axis must be [name, size], got {x!r}")
    return _name(x[0], "a mesh axis name"), _int(x[1], "a mesh axis size")


def _param(fields: Any) -> ParamSpec:
    if not isinstance(fields, list) or len(fields) not in (5, 6):
        raise LayoutError("a parameter must be [name, shape, placements, present ranks, trainable(, pieces)], "
                          f"got {fields!r}")
    name, shape, placements, present, trainable, *pieces = fields
    name = _name(name, "a parameter name")
    dims = _list(shape, f"the shape of {name!r}", lambda d: _int(d, f"a dim of {name!r}"))
    if any(d < 1 for d in dims):
        raise LayoutError(f"parameter {name!r} has a dim below 1 in shape {dims}")
    return ParamSpec(name, tuple(dims),
                     tuple((_name(d, "a mesh axis name"), _unplacement(p))
                           for d, p in _dict(placements, f"the placements of {name!r}").items()),
                     None if present is None else frozenset(
                         _list(present, f"the ranks of {name!r}", lambda r: _int(r, "a rank"))),
                     _bool(trainable, f"whether {name!r} is trainable"),
                     None if not pieces else tuple(_list(pieces[0], f"the pieces of {name!r}", _piece)))


def _piece(x: Any) -> Piece | None:
    """A measured parameter's piece on one rank (``Piece``), or None where the rank holds none."""
    if x is None:
        return None
    if not isinstance(x, list) or len(x) != 5:
        raise LayoutError(f"a piece must be [source, start, shape, dtype, norm] or null, got {x!r}")
    source, start, shape, dtype, norm = x
    return Piece(_name(source, "a piece's source"), _int(start, "a piece's start"),
                 tuple(_list(shape, "a piece's shape", lambda d: _int(d, "a piece's dim"))),
                 None if dtype is None else _name(dtype, "a piece's dtype"),
                 None if norm is None else _number(norm, "a piece's norm"))


def _nonfinite(x: Any) -> tuple[str, int, str]:
    if not isinstance(x, list) or len(x) != 3:
        raise LayoutError(f"a non-finite entry must be [parameter, flat index, kind], got {x!r}")
    return _name(x[0], "a parameter name"), _int(x[1], "a flat index"), _name(x[2], "a non-finite kind")


def check_target_allowed(target: str, named_on_command_line: Sequence[str]) -> None:
    """A blob's ``module:function`` / ``file.py:function`` target is code that would be imported or run
    on every rank: only when the command line names that same target."""
    if is_import_path(target) and target not in named_on_command_line:
        raise UsageError(f"the replay blob names the target {target!r}, which is not built in: replaying it would "
                         f"import and run that code on every rank; pass --target {shlex.quote(target)} to allow it")


def decode_trusted(blob: str, named_on_command_line: Sequence[str] = ()) -> tuple[DrawnCase, str]:
    """``decode``, refusing a target the user did not name (``check_target_allowed``)."""
    drawn, target = decode(blob)
    check_target_allowed(target, named_on_command_line)
    return drawn, target


def case_spec(drawn: DrawnCase, target: str, index: int = 0) -> CaseSpec:
    return CaseSpec(index, DrawnScenario.name, drawn.variant, target, drawn.norm_type, drawn.max_norm)


def replay_command(drawn: DrawnCase, target: str) -> str:
    """The command that reruns a case; one whose target is not built in names it (``--target``)."""
    allow = f" --target {shlex.quote(target)}" if is_import_path(target) else ""
    return f"{sys.executable} -m harness --replay {encode(drawn, target)}{allow}"
