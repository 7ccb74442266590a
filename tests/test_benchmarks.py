"""The benchmarks' own instruments keep measuring what they say as the code they time changes.

``bench/case_split.py`` wraps the runner's phase functions by name (``overhead_bench.py --split``): a function
renamed or moved would fail the split at its start, and one that stopped being called would leave its phase
out of the accounting. What is checked here is the instrument, never a timing: the phases are found, every
second of rank 0's cases is charged to one of them, and the start-up is split. And every benchmark starts:
they import the harness and the tests' helpers by module name, and a module renamed or moved broke one
(``main_job_bench.py`` imported ``tests.harness_runs``, which imports its siblings as top-level modules).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import case_split  # noqa: E402


def test_the_split_charges_all_of_rank_0s_wall_to_named_phases(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead_bench.py"), "--worlds", "2", "--scenario",
                          "dense_dp", "--split", "--by-scenario", "--keep", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode in (0, 1), run.stdout + run.stderr  # 1: the ratio goal not met, which is not the point
    ranks = case_split.read_split(tmp_path / "split-world2")
    assert [r["rank"] for r in ranks] == [0, 1]
    zero = ranks[0]
    charged = sum(zero["wall"].values())
    assert abs(charged - zero["cases_wall"]) <= 0.01 * zero["cases_wall"] + 0.01, (charged, zero["cases_wall"])
    for phase in ("target", "exchange (stats)", "exchange (status)", "exchange (record)", "exchange (late)",
                  "exchange (diagnose)", "build", "build (groups)", "inject", "snapshot", "measure", "effects",
                  "effects (state)", "judge", "write", "late check"):
        assert zero["calls"].get(phase, 0) > 0, f"no call charged to {phase!r}: {sorted(zero['calls'])}"
    assert set(zero["startup_phases"]) == {"start-up: planning", "start-up: frameworks' imports"}
    assert 0 < sum(zero["startup_phases"].values()) < zero["startup"]
    assert "world 2: dense_dp" in run.stdout and "start-up" in run.stdout, run.stdout


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "bench").glob("*.py")))
def test_every_benchmark_starts(script: str) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT.parent)
    assert run.returncode == 0, run.stderr[-2000:]
