"""A matrix spec: which scenarios, targets, EP sizes, world sizes, dtypes, norm types and backends.

It comes from a small TOML or JSON file (``--matrix PATH``) and/or command-line flags, flags winning.
An empty axis means "the natural default": every built-in scenario, each scenario's own targets and
norm types, every valid EP size, whatever world size and backend the launch has.

    # matrix.toml
    scenarios  = ["xorl_ep_lora", "deepspeed_autoep", "dense_dp"]
    targets    = []                 # each scenario's defaults
    ep_sizes   = []                 # every valid size
    worlds     = [1, 2, 4, 8]
    dtypes     = ["fp32", "bf16"]
    norm_types = ["2", "inf"]
    backends   = ["gloo", "nccl"]
    max_norm   = 0.5
    seed       = 0
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .case import parse_norm_type
from .layout import LayoutError


@dataclass(frozen=True)
class MatrixSpec:
    scenarios: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    ep_sizes: tuple[int, ...] | None = None
    worlds: tuple[int, ...] = ()
    dtypes: tuple[str, ...] = ("fp32",)
    norm_types: tuple[float, ...] = ()
    backends: tuple[str, ...] = ()
    max_norm: float = 0.5
    seed: int = 0
    variant: str | None = None

    def merged(self, overrides: Mapping[str, Any]) -> "MatrixSpec":
        """This spec with every non-None override applied (command-line flags over the file)."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})


_FIELDS = {f.name for f in dataclasses.fields(MatrixSpec)}


def load_matrix(path: str) -> MatrixSpec:
    """Read a TOML (``.toml``) or JSON matrix file; unknown keys and bad values are errors."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise LayoutError(f"cannot read matrix file {path!r}: {exc.strerror}") from None
    try:
        raw = json.loads(text) if file.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise LayoutError(f"matrix file {path!r} is not valid {file.suffix.lstrip('.') or 'TOML'}: {exc}") from None
    return spec_from_mapping(raw, source=path)


def spec_from_mapping(raw: Mapping[str, Any], source: str = "matrix") -> MatrixSpec:
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise LayoutError(f"{source}: unknown key(s) {unknown}; known: {sorted(_FIELDS)}")
    values: dict[str, Any] = {}
    try:
        for key in ("scenarios", "targets", "dtypes", "backends"):
            if key in raw:
                values[key] = tuple(str(x) for x in raw[key])
        if "worlds" in raw:
            values["worlds"] = tuple(int(x) for x in raw["worlds"])
        if "ep_sizes" in raw:
            values["ep_sizes"] = tuple(int(x) for x in raw["ep_sizes"]) or None
        if "norm_types" in raw:
            values["norm_types"] = tuple(parse_norm_type(str(x)) for x in raw["norm_types"])
        if "max_norm" in raw:
            values["max_norm"] = float(raw["max_norm"])
        if "seed" in raw:
            values["seed"] = int(raw["seed"])
        if "variant" in raw:
            values["variant"] = str(raw["variant"]) or None
    except (TypeError, ValueError) as exc:
        raise LayoutError(f"{source}: {exc}") from None
    for backend in values.get("backends", ()):
        if backend not in ("gloo", "nccl"):
            raise LayoutError(f"{source}: unknown backend {backend!r} (known: gloo, nccl)")
    return MatrixSpec(**values)
