"""Run a framework's standalone reproduction (``scenarios/<framework>/repro_<finding>.py``) under
torchrun, as its docstring says to, and read back the machine-readable last line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAST_LINE = re.compile(r"reported=(\S+) true=(\S+) ratio=(\S+)")


def run_repro(relative: str, nproc: int, timeout: float = 300) -> tuple[str, float, float, str]:
    """(stdout, reported, true, ratio as printed) of ``torchrun --nproc_per_node=nproc <relative>``."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                          str(ROOT / relative)], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    match = LAST_LINE.fullmatch(out.stdout.strip().splitlines()[-1])
    assert match, out.stdout
    return out.stdout, float(match[1]), float(match[2]), match[3]
