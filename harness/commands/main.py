"""``clipcheck`` / ``python -m harness``: which command runs. Without a subcommand it is the run on
every rank of a launch (``harness.commands.run``); each subcommand is a module of its own, imported
only when asked for."""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

SUBCOMMANDS = {
    "run": "harness.commands.launcher",
    "matrix": "harness.commands.matrix",
    "compat": "harness.commands.compat",
    "fuzz": "harness.commands.fuzz",
    "catalogue": "harness.commands.catalogue",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    from harness.commands.run import run_main

    return run_main(argv)


def main_entry() -> None:
    """Console-script entry point (``clipcheck ...``), same as ``python -m harness``."""
    sys.exit(main())
