"""Replay blobs: one drawn case (layout, plan, gradients, norm, bound, target, world size) in a
single copy-pasteable token, so a shrunk fuzz failure is one command away from being rerun.

    python -m harness --replay <blob>                               # starts the ranks it needs
    torchrun --nproc_per_node=N -m harness --replay <blob>          # or under torchrun

This module is the blob format (and the one-case spec it stands for); running one is
``harness.commands.replay``.

The blob is zlib-compressed JSON in URL-safe base64. It names a *target*, and a target is code:
a registered name is harmless, a ``module:function`` is imported, and a ``path/to/file.py:function``
is executed on every rank. A blob is data from someone else, so a file-path target is refused unless
``--allow-target-path`` is given; a blob's world size and decompressed size are capped, and its norm
type and bound get the same validation as the command line's.
"""

from __future__ import annotations

import base64
import json
import math
import os
import sys
import zlib
from typing import Any, Mapping

from harness.cases.variant import CaseSpec, Variant, parse_norm_type
from harness.cases.injection import Injection
from harness.cases.layout import Layout, LayoutError, MeshSpec, ParamSpec, Piece, Placement, Replicate, Shard
from harness.cases.plan import UsageError
from harness.targets.loading import is_import_path
from harness.strategies import DrawnCase, DrawnScenario

_PREFIX = "cc1."
MAX_WORLD = 64
MAX_DECOMPRESSED = 1 << 20


def _placement(p: Placement) -> Any:
    return p.dim if isinstance(p, Shard) else "R"


def _unplacement(x: Any) -> Placement:
    return Replicate() if x == "R" else Shard(int(x))


def _num(x: float) -> Any:
    return x if math.isfinite(x) else str(x)


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
    return doc


def variant_from_doc(doc: Mapping[str, Any]) -> Variant:
    """The variant ``variant_doc`` wrote (LayoutError, KeyError, TypeError or ValueError if it is not one)."""
    mesh = MeshSpec(tuple((str(n), int(s)) for n, s in doc["mesh"]))
    params = tuple(
        ParamSpec(name, tuple(shape), tuple((d, _unplacement(p)) for d, p in placements.items()),
                  None if present is None else frozenset(present), trainable,
                  None if not pieces else tuple(None if q is None else Piece(str(q[0]), int(q[1]), tuple(q[2]),
                                                                           q[3], None if q[4] is None else float(q[4]))
                                                for q in pieces[0]))
        for name, shape, placements, present, trainable, *pieces in doc["params"]
    )
    inj = doc["injection"]
    injection = Injection(seed=inj["seed"], dtype=inj["dtype"], scale=inj["scale"], zero=frozenset(inj["zero"]),
                          none_on=tuple((n, frozenset(r)) for n, r in inj["none_on"].items()),
                          nonfinite=tuple(tuple(x) for x in inj["nonfinite"]),
                          zero_on=tuple((n, frozenset(r)) for n, r in inj.get("zero_on", {}).items()))
    declared = {n: {d: _unplacement(p) for d, p in axes.items()} for n, axes in doc["declared"].items()}
    return Variant(doc["label"], Layout(mesh, params), injection, declared,
                   dtensor=bool(doc.get("dtensor", False)), plain=frozenset(map(str, doc.get("plain", []))))


def encode(drawn: DrawnCase, target: str) -> str:
    doc = {"world": drawn.world_size, "target": target, "norm": _num(drawn.norm_type), "max_norm": drawn.max_norm,
           **variant_doc(drawn.variant)}
    raw = zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 9)
    return _PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode(blob: str) -> tuple[DrawnCase, str]:
    """The drawn case and target a blob holds; UsageError for anything that is not a valid blob."""
    try:
        if not blob.startswith(_PREFIX):
            raise ValueError("unknown format")
        body = blob[len(_PREFIX):]
        inflater = zlib.decompressobj()
        raw = inflater.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)), MAX_DECOMPRESSED)
        if inflater.unconsumed_tail:
            raise ValueError(f"it decompresses to more than {MAX_DECOMPRESSED} bytes")
        doc = json.loads(raw)
        variant = variant_from_doc(doc)
        world = int(doc["world"])
        if not 1 <= world <= MAX_WORLD:
            raise LayoutError(f"world size {world} is outside 1..{MAX_WORLD}")
        max_norm = float(doc["max_norm"])
        if not (math.isfinite(max_norm) and max_norm > 0):
            raise LayoutError(f"max_norm must be a positive finite number, got {doc['max_norm']!r}")
        drawn = DrawnCase(variant, parse_norm_type(str(doc["norm"])), max_norm, world)
        return drawn, str(doc["target"])
    except LayoutError as exc:
        raise UsageError(f"replay blob describes an invalid case: {exc}") from None
    except (ValueError, KeyError, TypeError, zlib.error, json.JSONDecodeError) as exc:
        raise UsageError(f"not a replay blob ({exc.__class__.__name__}: {exc})") from None


def check_target_allowed(target: str, allow_target_path: bool) -> None:
    """A blob's file-path target runs that file on every rank: only when the user says so."""
    location = target.rpartition(":")[0]
    if is_import_path(target) and (location.endswith(".py") or "/" in location or os.sep in location) \
            and not allow_target_path:
        raise UsageError(f"the replay blob names the file {location!r} as its target, which would be executed "
                         "on every rank; pass --allow-target-path if you trust it")


def decode_trusted(blob: str, allow_target_path: bool) -> tuple[DrawnCase, str]:
    drawn, target = decode(blob)
    check_target_allowed(target, allow_target_path)
    return drawn, target


def case_spec(drawn: DrawnCase, target: str, index: int = 0) -> CaseSpec:
    return CaseSpec(index, DrawnScenario.name, drawn.variant, target, drawn.norm_type, drawn.max_norm)


def replay_command(drawn: DrawnCase, target: str) -> str:
    return f"{sys.executable} -m harness --replay {encode(drawn, target)}"
