"""``python -m harness ARGS`` as the suite runs it, some hundred times: forked from a process that has
imported torch, the harness and every installed framework once, instead of a fresh interpreter that
imports them again (most of what a small launch costs: docs/performance.md, "Figures cited by the
code").

    python tests/launch_server.py SOCKET       # started by tests/harness_runs.py, one per pytest worker

One request at a time over a Unix socket: a JSON line ``{"argv", "cwd", "env", "out", "err"}``; the server
forks a child that takes that working directory, environment (``sys.path`` as ``python -m`` would build it
from ``PYTHONPATH``), standard output and error files and fresh signal handlers, and runs
``harness.commands.main.process_main`` as ``python -m harness`` does; the server answers ``{"pid"}`` at once
and ``{"status"}`` (the exit code, negative for a signal) when the child has ended. The client kills the pid
itself when its own timeout passes. What is not exercised here is the interpreter's start: tests of it
(the launchers' process handling, signals, the error paths answered before torch is imported) start real
processes (``harness_runs.start_harness``, ``subprocess``). The server dies with the worker that started it.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import socket
import sys


def preload() -> None:
    """torch, the harness's commands and every installed framework (as ``clipcheck run`` preloads the
    ones its plan needs), so that a child starts with all of it."""
    importlib.import_module("torch._dynamo")
    for module in ("harness.commands.main", "harness.commands.run", "harness.commands.launcher",
                   "harness.commands.matrix", "harness.commands.fuzz", "harness.commands.catalogue",
                   "harness.commands.compat", "harness.commands.replay"):
        importlib.import_module(module)
    from harness.targets.registry import builtin_scenarios, registered_targets

    for target in registered_targets(list(builtin_scenarios().values())).values():
        framework = target.requires
        if framework is not None and framework.unavailable() is None:
            try:
                importlib.import_module(framework.probe)
            except Exception:  # noqa: BLE001 - a child imports it again and reports what happens
                pass


def child(request: dict) -> None:
    """Become ``python -m harness ARGV`` in the requested directory and environment; never returns."""
    os.setpgid(0, 0)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    inherited = [p for p in sys.path[1:] if p]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *(p for p in inherited if p not in extra)]  # python -m: the cwd first
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = [os.path.join(os.path.dirname(sys.modules["harness"].__file__ or ""), "__main__.py"),
                *request["argv"]]
    status = 1
    try:
        from harness.commands.main import process_main

        status = process_main()
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - as an interpreter would print it
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def serve(path: str) -> None:
    from harness.run.guards.family import die_with_parent

    die_with_parent()
    saved = os.dup(1)
    os.dup2(2, 1)  # what the frameworks print on import goes to the log; the client reads "ready" only
    try:
        preload()
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    gc.freeze()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        with conn, conn.makefile("rwb") as stream:
            line = stream.readline()
            if not line:
                continue
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                child(request)
            stream.write(json.dumps({"pid": pid}).encode() + b"\n")
            stream.flush()
            _, status = os.waitpid(pid, 0)
            try:
                stream.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                stream.flush()
            except OSError:  # the client gave up on it (its timeout) and left
                pass


if __name__ == "__main__":
    serve(sys.argv[1])
