"""``clipcheck`` / ``python -m harness``: which command runs. Without a subcommand it is the run on
every rank of a launch (``harness.commands.run``); each subcommand is a module of its own, imported
only when asked for."""

from __future__ import annotations

import gc
import importlib
import sys
from typing import NoReturn, Sequence

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
    leave(main())


def leave(status: int | None) -> NoReturn:
    """End the process with ``status``, skipping the interpreter's final garbage collections.

    When a command returns, every result file is written and closed; what the interpreter's shutdown
    would still do is walk every object torch and the frameworks created (modules, op registrations,
    caches): 1.3-1.5 s of CPU per process with the frameworks imported, measured here, paid by the
    launcher and by each rank of a ``torchrun -m harness`` launch. Frozen objects are left out of those
    collections; atexit handlers still run, and the operating system takes the memory back. So every
    file a command writes must be closed (or flushed) before it returns: a writer left open in a
    reference cycle would lose its buffer here."""
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()
    sys.exit(status)
