"""A matrix spec: which scenarios, targets, EP sizes, world sizes, dtypes, norm types, clip bounds and
backends. Each axis is described once (``AXES``), and that one description drives the matrix file's
validation, the command-line flags and the serialized spec a launcher hands its children.

It comes from a small TOML or JSON file (``--matrix PATH``) and/or command-line flags, flags winning.
An empty axis means "the natural default": every built-in scenario, each scenario's own targets and
norm types, every valid EP size, whatever world size and backend the launch has.

    # matrix.toml
    scenarios   = ["xorl_ep_lora", "deepspeed_autoep", "dense_dp"]
    targets     = []                 # each scenario's defaults
    ep_sizes    = []                 # every valid size
    worlds      = [1, 2, 4, 8]
    dtypes      = ["fp32", "bf16"]
    norm_types  = ["2", "inf"]
    clip_ratios = [0.5, 2.0]         # max_norm = ratio x each case's true norm: clipping on, and off
    max_norm    = 0.5                # an absolute bound instead of clip_ratios
    backends    = ["gloo", "nccl"]
    seed        = 0
    variant     = ["ep=2"]           # only layouts whose label matches one of these (a string: one)
    exclude     = ["nan"]            # no layout whose label matches one of these
    parallelism = ["ep", "fsdp"]     # only layouts built from these kinds (cases.parallelism)
    synthetic   = false              # also run the frameworks' synthetic (regression) layouts
    plans       = "all"              # "honest": every declared plan replaced by the truth
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from harness.cases.variant import parse_norm_type
from harness.cases.layout import LayoutError
from harness.cases.parallelism import KINDS

DEFAULT_CLIP_RATIOS = (0.5, 2.0)
"""A bound below the true norm (clipping happens) and one above it (the no-clip branch)."""


@dataclass(frozen=True)
class MatrixSpec:
    scenarios: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    ep_sizes: tuple[int, ...] | None = None
    worlds: tuple[int, ...] = ()
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    norm_types: tuple[float, ...] = ()
    clip_ratios: tuple[float, ...] = DEFAULT_CLIP_RATIOS
    max_norm: float | None = None
    backends: tuple[str, ...] = ()
    seed: int = 0
    variant: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    parallelism: tuple[str, ...] = ()
    synthetic: bool = False
    plans: str = "all"

    def merged(self, overrides: Mapping[str, Any]) -> "MatrixSpec":
        """This spec with every non-None override applied (command-line flags over the file)."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def updated(self, values: Mapping[str, Any]) -> "MatrixSpec":
        """This spec with every key a file gave replaced (``parse_mapping``'s values: a file's
        ``ep_sizes = []`` is None, "every valid size", and replaces a lower layer's list)."""
        return dataclasses.replace(self, **values)

    def to_mapping(self) -> dict[str, Any]:
        """The spec as a matrix-file mapping (JSON-safe), read back by ``spec_from_mapping``."""
        out: dict[str, Any] = {}
        for axis in AXES:
            value = getattr(self, axis.key)
            if value is None:
                if axis.key == "ep_sizes":  # "every valid size" must replace a lower layer's list
                    out[axis.key] = []
                continue
            if axis.key == "norm_types":
                value = [str(v) for v in value]
            out[axis.key] = list(value) if axis.many else value
        return out


def _positive_int(text: Any) -> int:
    value = _strict(int)(text)
    if value < 1:
        raise ValueError(f"must be positive, got {value}")
    return value


def _positive_float(text: Any) -> float:
    value = _strict(float)(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"must be a positive finite number, got {text!r}")
    return value


def _strict(cast: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``cast`` that refuses booleans (``int(True)`` is 1) and strings (a file's ``"4"`` is a mistake;
    command-line text is converted before it gets here)."""
    def parse(value: Any) -> Any:
        if isinstance(value, (bool, str)) or (cast is int and isinstance(value, float)):
            raise ValueError(f"expected {'an integer' if cast is int else 'a number'}, got {value!r}")
        return cast(value)
    return parse


def _norm_type(value: Any) -> float:
    return parse_norm_type(str(value))


def _backend(value: Any) -> str:
    if value not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {value!r} (known: gloo, nccl)")
    return str(value)


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


PLAN_PROFILES = ("all", "honest")


def _plans(value: Any) -> str:
    if value not in PLAN_PROFILES:
        raise ValueError(f"plans must be one of {', '.join(PLAN_PROFILES)}, got {value!r}")
    return str(value)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


@dataclass(frozen=True)
class Axis:
    """One matrix axis: its spec field (= matrix-file key), flag, element parser and help."""

    key: str
    flags: tuple[str, ...]
    item: Callable[[Any], Any]
    many: bool
    help: str
    from_text: Callable[[str], Any] = str  # command-line text -> the value ``item`` checks
    switch: bool = False  # a flag without a value (``--synthetic``): present means True
    repeat: bool = False
    """A list whose flag is given once per value, never split on commas (a layout label may hold one);
    in a file, a lone string is a list of one (``variant = "replicated"``)."""

    def parse_file_value(self, raw: Any, source: str) -> Any:
        try:
            if self.repeat and isinstance(raw, str):
                raw = [raw]
            if self.many:
                if not isinstance(raw, list):
                    raise ValueError(f"expected a list, got {type(raw).__name__} {raw!r}")
                values = tuple(self.item(x) for x in raw)
                return (values or None) if self.key == "ep_sizes" else values
            if raw is None:
                return None
            return self.item(raw)
        except (TypeError, ValueError, LayoutError) as exc:
            raise LayoutError(f"{source}: {self.key}: {exc}") from None

    def parse_flag(self, text: str) -> Any:
        try:
            if self.many and not self.repeat:
                return tuple(self.item(self.from_text(part.strip())) for part in text.split(",") if part.strip())
            return self.item(self.from_text(text))
        except (TypeError, ValueError, LayoutError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None


AXES: tuple[Axis, ...] = (
    Axis("scenarios", ("--scenario", "--scenarios"), _text, True,
         "scenario name(s), comma separated, or module:Class / file.py:Class (default: all)"),
    Axis("targets", ("--target", "--targets"), _text, True,
         "target name(s) or module:function / file.py:function (default: the scenario's)"),
    Axis("ep_sizes", ("--ep-size",), _positive_int, True,
         "expert-parallel size(s), comma separated (default: every valid size)", int),
    Axis("worlds", (), _positive_int, True, "world sizes the matrix applies to", int),
    Axis("dtypes", ("--dtype",), _text, True, "gradient dtype(s): fp32, bf16, fp16, fp64 (default: fp32,bf16)"),
    Axis("norm_types", ("--norm-type",), _norm_type, True, "norm type(s): 2, 1, inf, ... (default: the scenario's)"),
    Axis("clip_ratios", ("--clip-ratio",), _positive_float, True,
         "clip bound(s) as multiples of each case's true norm (default 0.5,2.0: clipping on and off)", float),
    Axis("max_norm", ("--max-norm",), _positive_float, False, "an absolute clip bound instead of --clip-ratio",
         float),
    Axis("backends", (), _backend, True, "backends the matrix applies to"),
    Axis("seed", ("--seed",), _strict(int), False, "seed of the gradient values (default 0)", int),
    Axis("variant", ("--variant",), _text, True,
         "run only layout variants whose label contains this text (* and ? as in shell patterns; =LABEL: that one "
         "layout exactly); repeat the flag for several, a layout matching any of them runs", repeat=True),
    Axis("exclude", ("--exclude",), _text, True,
         "leave out layout variants whose label matches this text, as --variant matches; repeat the flag for "
         "several", repeat=True),
    Axis("parallelism", ("--parallelism",), _text, True,
         f"run only the layouts built from these kinds of parallelism, comma separated: {', '.join(KINDS)} "
         "(default: every layout)"),
    Axis("synthetic", ("--synthetic",), _boolean, False,
         "also run the frameworks' adapters and your own targets on synthetic layouts: regression layouts no known "
         "trainer path reaches (the harness's own targets run them always)", switch=True),
    Axis("plans", ("--plans",), _plans, False,
         "all (default): layouts whose declared plan lies too, a failure that only the lie causes labelled so; "
         "honest: every declared plan replaced by the truth (is a plan-trusting clip's arithmetic right?)"),
)
_BY_KEY = {axis.key: axis for axis in AXES}


def add_axis_flags(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """One flag per axis that has one (their destinations are the axis keys); ``only``: those axes'
    alone (a command that plans layouts, not cases, takes no bounds or targets)."""
    for axis in AXES:
        if not axis.flags or (only is not None and axis.key not in only):
            continue
        if axis.switch:
            parser.add_argument(*axis.flags, dest=axis.key, action="store_const", const=True, default=None,
                                help=axis.help)
        elif axis.repeat:
            parser.add_argument(*axis.flags, dest=axis.key, type=axis.parse_flag, action="append", default=None,
                                help=axis.help)
        else:
            parser.add_argument(*axis.flags, dest=axis.key, type=axis.parse_flag, default=None, help=axis.help)


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The axes the flags set (None: not given); a repeated flag's values as one tuple."""
    values = {axis.key: getattr(args, axis.key, None) for axis in AXES if axis.flags}
    return {key: tuple(value) if isinstance(value, list) else value for key, value in values.items()}


def load_matrix(path: str) -> MatrixSpec:
    """Read a TOML (``.toml``) or JSON matrix file; unknown keys and bad values are errors."""
    return MatrixSpec().updated(load_matrix_values(path))


def load_matrix_values(path: str) -> dict[str, Any]:
    """The axes a TOML (``.toml``) or JSON matrix file sets, parsed (``parse_mapping``); unknown keys
    and bad values are errors."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise LayoutError(f"matrix file {path!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise LayoutError(f"cannot read matrix file {path!r}: {exc.strerror}") from None
    try:
        raw = json.loads(text) if file.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise LayoutError(f"matrix file {path!r} is not valid {file.suffix.lstrip('.') or 'TOML'}: {exc}") from None
    except RecursionError:  # the parsers recurse once per level of nesting
        raise LayoutError(f"matrix file {path!r} nests too deeply to be a matrix") from None
    if not isinstance(raw, dict):
        raise LayoutError(f"matrix file {path!r} must hold a table of axes, got {type(raw).__name__}")
    return parse_mapping(raw, source=path)


def spec_from_mapping(raw: Mapping[str, Any], source: str = "matrix") -> MatrixSpec:
    return MatrixSpec(**parse_mapping(raw, source))


def parse_mapping(raw: Mapping[str, Any], source: str = "matrix", also_known: tuple[str, ...] = ()) -> dict[str, Any]:
    """Each axis a matrix mapping (a matrix file, ``[tool.clipcheck]``, ``harness.check``'s arguments)
    sets, parsed and checked: an unknown key or a value of the wrong type is a ``LayoutError`` (one
    line, naming ``source`` and the key). ``also_known``: keys the caller reads itself (named in the
    message, never parsed here)."""
    unknown = sorted(set(raw) - set(_BY_KEY) - set(also_known))
    if unknown:
        raise LayoutError(f"{source}: unknown key(s) {unknown}; known: {sorted([*_BY_KEY, *also_known])}")
    return {key: _BY_KEY[key].parse_file_value(value, source) for key, value in raw.items() if key in _BY_KEY}
