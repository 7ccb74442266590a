"""Run a standalone script of the repository (a framework's reproduction ``scenarios/<framework>/repro_<finding>.py``,
a user-shaped job) under torchrun, as its docstring says to, and read back what rank 0 printed.

The ranks are forked from a process that has already imported the script's imports (tests/forked_torchrun.py:
torch's elastic agent, torchrun's environment, the script unchanged), unless a test asks for ``torchrun``
itself, each rank importing afresh; tests/test_torch_repros.py keeps that path, with nothing of clipcheck on
the path, as an upstream reader runs a repro."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAST_LINE = re.compile(r"reported=(\S+) true=(\S+) ratio=(\S+)")


def torchrun_command(nproc: int, torchrun: bool = False, nested_imports: bool = True) -> list[str]:
    """The launcher's part of ``torchrun --standalone --nproc_per_node=nproc SCRIPT``: the ranks forked after
    the script's imports (tests/forked_torchrun.py; ``nested_imports``: those inside its functions too), or
    with ``torchrun``, torchrun itself."""
    if torchrun:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [sys.executable, str(ROOT / "tests" / "forked_torchrun.py"), "--nproc", str(nproc),
            *(["--nested-imports"] if nested_imports else [])]


def run_script(relative: str, nproc: int, *args: str, nested_imports: bool = True, torchrun: bool = False,
               standalone: bool = False, env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=nproc <relative> <args>``; it must exit 0. ``nested_imports``:
    what the script imports inside its functions is imported before the ranks are forked too (off for a
    script that prepares something first); ``standalone`` (with ``torchrun``): run from ``/`` with clipcheck
    off the path."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    if standalone:
        assert torchrun, "a forked launch imports clipcheck's launcher"
        full_env.pop("PYTHONPATH", None)
    else:
        full_env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    proc = subprocess.run([*torchrun_command(nproc, torchrun, nested_imports), str(ROOT / relative), *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd="/" if standalone else ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def stdout_lines(relative: str, nproc: int, *args: str, **options: object) -> list[str]:
    """The lines rank 0 printed (``run_script``'s options)."""
    return run_script(relative, nproc, *args, **options).stdout.strip().splitlines()  # type: ignore[arg-type]


def run_repro(relative: str, nproc: int, *args: str, **options: object) -> tuple[str, float, float, str]:
    """(stdout, reported, true, ratio as printed) of a repro whose last line is ``reported=.. true=.. ratio=..``."""
    out = run_script(relative, nproc, *args, **options).stdout  # type: ignore[arg-type]
    match = LAST_LINE.fullmatch(out.strip().splitlines()[-1])
    assert match, out
    return out, float(match[1]), float(match[2]), match[3]
