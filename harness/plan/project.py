"""A project's defaults: the ``[tool.clipcheck]`` table of the ``pyproject.toml`` in the current
directory, or else in the nearest parent that has one (the first ``pyproject.toml`` found; its table,
if it has none, means no defaults).

    [tool.clipcheck]
    targets   = ["my_pkg.clip:clip_grad_norm"]
    scenarios = ["dense_dp", "fsdp2_meshes"]
    worlds    = [2, 4]
    dtypes    = ["fp32"]
    parallelism = ["ep", "fsdp"]          # the layouts the clip was written for
    exclude   = ["nan"]                   # label patterns; variant and exclude take a list or one string
    timeout   = 120

Its keys are a matrix file's (``harness.cases.matrix.AXES``, checked by the same ``parse_mapping``)
and ``timeout`` (checked by ``timeout_problem``, as ``--timeout`` is). An unknown key or a value of
the wrong type is a ``ClipcheckInputError``: one line, exit status 2, before any rank starts. Which
layer wins (docs/matrix.md): flags over ``--matrix FILE`` over ``[tool.clipcheck]`` over the built-in
defaults (for ``clipcheck matrix``, ``harness/default_matrix.toml``). ``worlds`` is the list of world
sizes of ``clipcheck matrix`` (unless ``--nproc-list`` or ``NPROC_LIST`` gives one) and of
``harness.check``; ``clipcheck fuzz`` takes the largest; ``clipcheck run --nproc N`` and a torchrun
launch run the world they are given.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.cases.matrix import parse_mapping
from harness.errors import ClipcheckInputError

MAX_TIMEOUT_S = 86400.0
"""The longest collective timeout a run takes (a day). Every deadline is a multiple of it, and what
holds them (timedelta, the C++ stores' milliseconds) overflows somewhere past 1e9 s: uncapped,
``--timeout inf`` makes every case a crash under ``clipcheck run`` and an OverflowError traceback under
torchrun."""


def timeout_problem(seconds: float, what: str = "--timeout") -> str | None:
    """Why ``seconds`` cannot be a collective timeout (one line), or None."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
        return f"{what} must be a positive number of seconds, at most {MAX_TIMEOUT_S:g}; got {seconds!r}"
    return None


TABLE = "tool.clipcheck"
OWN_KEYS = ("timeout",)
"""Keys of ``[tool.clipcheck]`` that are not matrix axes."""


@dataclass(frozen=True)
class ProjectDefaults:
    """What ``[tool.clipcheck]`` sets: ``axes`` (parsed, by matrix key) and ``timeout``; empty when
    there is no such table."""

    source: str | None = None
    axes: dict[str, Any] = field(default_factory=dict)
    timeout: float | None = None

    @property
    def worlds(self) -> tuple[int, ...]:
        return tuple(self.axes.get("worlds") or ())

    def without(self, *keys: str) -> dict[str, Any]:
        """The axes less ``keys`` (the ones a command's own arguments decide)."""
        return {k: v for k, v in self.axes.items() if k not in keys}


def find_pyproject(start: Path | None = None) -> Path | None:
    """The ``pyproject.toml`` of ``start`` (the current directory) or of its nearest parent."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def project_defaults(start: Path | None = None) -> ProjectDefaults:
    """Read and check ``[tool.clipcheck]`` (see the module's docstring); raises ClipcheckInputError."""
    path = find_pyproject(start)
    if path is None:
        return ProjectDefaults()
    source = f"{path} [{TABLE}]"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ClipcheckInputError(f"cannot read {path} for [{TABLE}]: {exc}") from None
    table = data.get("tool", {}).get("clipcheck") if isinstance(data.get("tool"), dict) else None
    if table is None:
        return ProjectDefaults()
    if not isinstance(table, dict):
        raise ClipcheckInputError(f"{source} must be a table, got {type(table).__name__}")
    axes = parse_mapping({k: v for k, v in table.items() if k not in OWN_KEYS}, source, also_known=OWN_KEYS)
    timeout = table.get("timeout")
    if timeout is not None:
        problem = timeout_problem(timeout, f"{source}: timeout")
        if problem:
            raise ClipcheckInputError(problem)
        timeout = float(timeout)
    return ProjectDefaults(source, axes, timeout)
