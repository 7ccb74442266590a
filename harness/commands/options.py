"""Options and checks shared by every command that plans cases (run, matrix, the launcher)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from harness.report.safe_text import one_line
from harness.judge.blame import BLAME_MODES
from harness.cases.matrix import MatrixSpec, add_axis_flags, flag_overrides, load_matrix_values
from harness.plan.project import ProjectDefaults
from harness.errors import ClipcheckInputError
from harness.plan.project import timeout_problem

DEFAULT_TIMEOUT_S = 60.0


def add_selection_options(p: argparse.ArgumentParser) -> None:
    """What to run: the matrix axes (``matrix.AXES``). Shared by every command that plans cases."""
    _add_matrix_option(p)
    add_axis_flags(p)
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds a collective may block before the case fails (default: [tool.clipcheck] timeout, "
                        f"else {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--blame", nargs="?", choices=BLAME_MODES, const="all", default="auto",
                   help="for a case with a wrong norm, re-run the target one parameter group at a time and print "
                        "the weight it gives each: auto (the default) weighs each layout, target, norm and dtype "
                        "once and reuses it for the same failing norm under another bound; --blame (all) weighs "
                        "every failing case afresh; --blame off never, and runs no group of a right norm alone "
                        "either (counting established per group: those its band cannot see are recorded as not "
                        "established); each costs one run per parameter group")


LAYOUT_AXES = ("scenarios", "ep_sizes", "dtypes", "seed", "variant", "exclude", "parallelism", "plans", "synthetic")
"""The axes that choose layouts, as against cases (targets, bounds, norms): ``clipcheck layouts``'s flags."""


def add_layout_selection_options(p: argparse.ArgumentParser) -> None:
    """Which layouts: ``--matrix`` and the flags of ``LAYOUT_AXES``."""
    _add_matrix_option(p)
    add_axis_flags(p, only=LAYOUT_AXES)


def _add_matrix_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--matrix", metavar="PATH", default=None, help="matrix file (TOML or JSON); flags override it")


def add_spawn_ranks_option(p: argparse.ArgumentParser) -> None:
    """``clipcheck run`` and ``clipcheck matrix``: start ranks as fresh interpreters, as torchrun does."""
    p.add_argument("--spawn-ranks", action="store_true",
                   help="start every rank as a fresh Python process, as torchrun does, instead of forking it from "
                        "the launcher (the default on CPU/gloo; slower: each rank imports and plans again). For a "
                        "target whose import differs per rank")


def spec_from_args(args: argparse.Namespace, project: ProjectDefaults | None = None,
                   base_matrix: str | None = None, project_keys_off: tuple[str, ...] = ()) -> MatrixSpec:
    """The spec of a command, layer over layer, each replacing what it sets: ``base_matrix`` (a
    command's built-in matrix file), ``[tool.clipcheck]`` less ``project_keys_off`` (what the command
    decides itself), the ``--matrix`` file, the flags."""
    spec = MatrixSpec()
    if base_matrix:
        spec = spec.updated(load_matrix_values(base_matrix))
    if project is not None:
        spec = spec.updated(project.without(*project_keys_off))
    if args.matrix:
        spec = spec.updated(load_matrix_values(args.matrix))
    return spec.merged(flag_overrides(args))


def resolve_timeout(args: argparse.Namespace, project: ProjectDefaults, default: float = DEFAULT_TIMEOUT_S) -> None:
    """``args.timeout``: the flag, else ``[tool.clipcheck]``'s, else ``default``; one that cannot be a
    timeout is a ClipcheckInputError (one line)."""
    if args.timeout is None:
        args.timeout = project.timeout if project.timeout is not None else default
    problem = timeout_problem(args.timeout)
    if problem:
        raise ClipcheckInputError(problem)


def world_sizes(text: str, flag: str) -> list[int]:
    """World sizes given as text, comma or space separated (``--nproc-list 1,2,4``, ``NPROC_LIST="2 4"``,
    ``clipcheck layouts --nproc 2,4``); anything else is one line naming ``flag``."""
    try:
        worlds = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise ClipcheckInputError(f"{flag} needs whole numbers, got {text!r}") from None
    if not worlds or min(worlds) < 1:
        raise ClipcheckInputError(f"{flag} needs positive world sizes, got {text!r}")
    return worlds


def unwritable(path: str | None) -> str | None:
    """Why a results file cannot be written there (checked before any process starts), or None."""
    if path is None:
        return None
    target = Path(path)
    if target.is_dir():
        return "is a directory"
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        return f"no such directory {str(folder)!r}"
    existed = target.exists()
    try:  # the only honest test of writability (root passes os.access on /proc, say)
        with open(target, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        return f"not writable ({exc.strerror or exc})"
    if not existed:
        target.unlink(missing_ok=True)
    return None


def results_files_problem(args: argparse.Namespace) -> str | None:
    """Why ``--json`` or ``--junit`` cannot be written (one line), or None."""
    for flag, path in (("--json", args.json), ("--junit", args.junit)):
        problem = unwritable(path)
        if problem:
            return f"{flag} {path}: {problem}"
    return None


def print_error(message: object) -> None:
    """The one line bad input gets (on stderr). The message may quote a file or a blob: escaped."""
    print(f"clipcheck: error: {one_line(message)}", file=sys.stderr, flush=True)


def quiet_torch_warnings() -> None:
    # DTensor warns on every multi-dim norm reduction; it is noise for this tool
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
