"""``torchrun --standalone --nproc_per_node=N SCRIPT ARGS`` with the ranks forked from a process that has
already imported what they import, for the test suite.

    python tests/forked_torchrun.py --nproc 2 --preload deepspeed -- scenarios/deepspeed/repro_engine_mean_of_norms.py

Why: a framework's standalone repro or a user's training job under torchrun spends most of its time
importing (each rank imports torch and the framework afresh; ColossalAI's import, for one:
docs/performance.md, "Figures cited by the code"), and the suite runs dozens of them. Here the script's
imports (``imports_of``) and ``--preload`` are imported once, then each rank is forked with torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR / MASTER_PORT of a store this process hosts on
loopback, as torchrun's agent does),
made like a fresh rank (``harness.commands.forked.like_a_fresh_rank``) and runs the script unchanged
(``runpy``, as ``__main__``). Not torch's elastic agent with a function entry point: it waits for a return
value that a script ending in ``os._exit`` never sends. Exit status: 0, or the first failing rank's (the
others are then killed, as torchrun does). Real torchrun stays tested where its own start matters
(tests/test_distributed.py, the launchers' tests, tests/test_torch_repros.py)."""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import runpy
import signal
import sys
import uuid

STORE_TIMEOUT_S = 300.0


def imports_of(script: str, nested: bool) -> list[str]:
    """The modules ``script`` imports by name (``import``, ``from ... import``, ``importlib.import_module`` of
    a literal): at its top level, what every rank imports first anyway; with ``nested``, in its functions
    too. Not by default: a script may prepare something before such an import (the automodel repro puts CPU
    stand-ins for GPU-only modules in place first); where nothing is, a test asks for them."""
    with open(script, encoding="utf-8") as f:
        tree = ast.parse(f.read(), script)
    modules = []
    for node in ast.walk(tree) if nested else tree.body:
        if isinstance(node, ast.Expr):
            node = node.value
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module != "__future__":
            modules.append(node.module)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            modules.append(node.args[0].value)
    return modules


def _rank(rank: int, world: int, port: int, run_id: str, script: str, argv: list[str]) -> None:
    from harness.commands.forked import like_a_fresh_rank

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                      TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0")
    like_a_fresh_rank()
    # whole lines into the pipe the ranks share: a block-buffered rank wrote 8 KiB pieces, cut mid-line
    sys.stdout.reconfigure(line_buffering=True, write_through=False)
    sys.argv = [script, *argv]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    except BaseException:  # noqa: BLE001 - printed as torchrun's worker would, then the rank fails
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--preload", default="",
                   help="modules to import before forking besides the script's top-level imports, comma separated")
    p.add_argument("--nested-imports", action="store_true",
                   help="import before forking what the script imports inside its functions too")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))  # as a rank's path starts
    for module in [*imports_of(args.script, args.nested_imports), *filter(None, args.preload.split(","))]:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - the ranks import it again and fail there, as under torchrun
            pass
    from harness.run.guards.family import children_die_with_this_process
    from harness.run.hosts.pool import loopback_store

    store = loopback_store(args.nproc, STORE_TIMEOUT_S)  # the ranks' store, hosted here as torchrun's agent does
    children_die_with_this_process()
    run_id = uuid.uuid4().hex
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = {}
    for rank in range(args.nproc):
        pid = os.fork()
        if pid == 0:
            _rank(rank, args.nproc, store.port, run_id, args.script, args.args)
        ranks[pid] = rank
    status = 0
    while ranks:
        pid, code = os.wait()
        if pid not in ranks:
            continue
        del ranks[pid]
        code = os.waitstatus_to_exitcode(code)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            print(f"forked_torchrun: a rank failed (exit code {code}); stopping the others", file=sys.stderr)
            for other in ranks:
                try:
                    os.kill(other, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return status


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # without the interpreter's last collections over every framework object
