"""``clipcheck`` / ``python -m harness``: which command runs. Without a subcommand it is the run on
every rank of a launch (``harness.commands.run``); each subcommand is a module of its own, imported
only when asked for. ``clipcheck --help`` lists them and the exit statuses; ``--version`` says which
clipcheck and torch are running."""

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
    "layouts": "harness.commands.layouts",
}


EXIT_INTERRUPTED = 130

SUMMARIES = {
    "run": "launch N ranks on this machine and run the selected cases (clipcheck run --nproc 4 --scenario dense_dp)",
    "matrix": "the matrix at every world size, merged: summary, JSON Lines, JUnit, report.html",
    "fuzz": "hypothesis over drawn layouts against clip functions, on a warm world",
    "compat": "the real frameworks' compatibility table from results; --sweep FRAMEWORK over its releases",
    "catalogue": "every known clipping mistake against its fixed scenario and the fuzzer",
    "layouts": "what a clip is handed on each selected layout (parameters, DTensor or plain, placements); no process",
}


def top_level_help() -> str:
    """``clipcheck --help``: the commands, and the exit statuses they share."""
    from harness.judge.verdicts import EXIT_STATUSES

    lines = ["usage: clipcheck COMMAND [ARGS]   (COMMAND --help for its own options)", "",
             "Checks that a gradient-norm clip counts every logical gradient exactly once across "
             "EP / FSDP / TP / PP / DP ranks.", "", "commands:"]
    lines += [f"  {name:<10} {SUMMARIES[name]}" for name in SUBCOMMANDS]
    lines += [f"  {'(none)':<10} one rank of a launch: torchrun --nproc_per_node=N -m harness [selection]; "
              "the selection flags are clipcheck run's (--list lists scenarios and targets, --replay BLOB)",
              "", "options:", "  -h, --help  this help", "  --version   clipcheck's version and torch's", "",
              "exit statuses (every command):"]
    lines += [f"  {status}  {meaning}" for status, meaning in EXIT_STATUSES.items()]
    return "\n".join(lines)


def version() -> str:
    import importlib.metadata

    try:
        mine = importlib.metadata.version("clipcheck")
    except importlib.metadata.PackageNotFoundError:  # a checkout on the path, not installed
        mine = "unknown (not installed)"
    torch = importlib.metadata.version("torch")
    return f"clipcheck {mine} (torch {torch}, Python {sys.version.split()[0]})"


def main(argv: Sequence[str] | None = None) -> int:
    """The command's exit status; an interruption (Ctrl-C) that reaches this far is 130, quietly
    (the commands that stop ranks record what the interruption cut short themselves)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["--help"], ["-h"]):
        print(top_level_help())
        return 0
    if argv == ["--version"]:
        print(version())
        return 0
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
    from harness.run.guards.family import end_descendants, keep_together

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
    caches), paid by the launcher and by each rank of a ``torchrun -m harness`` launch (its cost:
    docs/performance.md, "Where it stands", item 7). Frozen objects are left out of those
    collections; atexit handlers still run, and the operating system takes the memory back. So every
    file a command writes must be closed (or flushed) before it returns: a writer left open in a
    reference cycle would lose its buffer here."""
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()
    sys.exit(status)
