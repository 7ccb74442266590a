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


EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """The command's exit status; an interruption (Ctrl-C) that reaches this far is 130, quietly
    (the commands that stop ranks record what the interruption cut short themselves)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in SUBCOMMANDS:
            return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
        from harness.commands.run import run_main

        return run_main(argv)
    except KeyboardInterrupt:
        print("clipcheck: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def process_main() -> int:
    """``main`` as this process's own entry point (``clipcheck``, ``python -m harness``): the process
    dies with the launcher that started it, if one did, and leaves none of its descendants behind
    (``run.family``: a rank's or a clip's children, a launch's orphans)."""
    from harness.run.family import end_descendants, keep_together

    keep_together()
    try:
        return main()
    finally:
        end_descendants()


def main_entry() -> None:
    """Console-script entry point (``clipcheck ...``), same as ``python -m harness``."""
    leave(process_main())


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
