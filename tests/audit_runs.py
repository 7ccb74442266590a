"""Run a user's training script (tests/audit_jobs/) under torchrun from a test and read what rank 0 wrote
(the ranks forked after the job's imports unless a test asks for torchrun itself: tests/forked_torchrun.py)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness_runs import ROOT
from repro_runs import torchrun_command

JOBS = ROOT / "tests" / "audit_jobs"


@dataclass
class JobRun:
    returncode: int
    stdout: str
    stderr: str
    found: dict[str, Any] | None
    """What rank 0 wrote (None when it wrote nothing)."""

    @property
    def record(self) -> dict[str, Any]:
        assert self.found is not None, f"rank 0 wrote nothing (exit {self.returncode}):\n{self.stderr[-3000:]}"
        return self.found["record"]

    def check(self, name: str) -> dict[str, Any] | None:
        return self.record["checks"].get(name)


def run_job(script: str, nproc: int, args: list[str], tmp_path: Path, timeout: float = 600,
            env: dict[str, str] | None = None, torchrun: bool = False) -> JobRun:
    """``torchrun --standalone --nproc_per_node=nproc tests/audit_jobs/<script> <args> OUT`` on this checkout:
    the ranks forked after the job's imports (tests/forked_torchrun.py), or with ``torchrun``, torchrun itself."""
    out = tmp_path / f"{Path(script).stem}-{nproc}-{abs(hash(tuple(args)))}.json"
    out.unlink(missing_ok=True)
    cmd = [*torchrun_command(nproc, torchrun), str(JOBS / script), args[0], str(out), *args[1:]]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    full_env.update(env or {})
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    found = json.loads(out.read_text()) if out.exists() else None
    return JobRun(proc.returncode, proc.stdout, proc.stderr, found)
