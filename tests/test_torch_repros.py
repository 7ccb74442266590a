"""The standalone reproductions of torch's own findings (``scenarios/fsdp2/repro_*.py``): plain torchrun
scripts that use torch alone, no clipcheck, and print reported vs true on rank 0; each is run here and
its figures checked, so a finding can be filed upstream as it stands."""

from __future__ import annotations

import math

import pytest

from harness_runs import ROOT
from repro_runs import run_script

pytestmark = pytest.mark.distributed


def run_repro(script: str, nproc: int = 2) -> list[dict[str, float]]:
    """The ``key=value`` lines rank 0 printed, as numbers; the script must exit 0."""
    # torchrun itself, from /, nothing of clipcheck on the path: the script stands alone, as upstream runs it
    proc = run_script(script, nproc, torchrun=True, standalone=True)
    rows = [dict(kv.split("=", 1) for kv in line.split()) for line in proc.stdout.splitlines() if "ratio=" in line]
    return [{k: float(v) for k, v in row.items()} for row in rows]


def test_fp16_norm_partial_overflows_and_underflows():
    large, tiny = run_repro("scenarios/fsdp2/repro_fp16_norm_partial.py")
    assert large["scale"] == 64 and math.isinf(large["reported"]) and math.isfinite(large["true"])
    assert large["true"] < 65504  # the norm itself fits in fp16: only its square does not
    assert tiny["scale"] < 1e-4 and abs(tiny["ratio"] - 1) > 2e-3  # outside fp16's norm tolerance


def test_a_repro_imports_nothing_of_clipcheck():
    for script in sorted((ROOT / "scenarios").glob("*/repro_*.py")):
        text = script.read_text()
        assert "import harness" not in text and "from harness" not in text, script
        assert 'if __name__ == "__main__":' in text, script


def test_fp16_total_past_65504_is_inf_and_zeroes_every_gradient():
    (row,) = run_repro("scenarios/fsdp2/repro_fp16_total_overflow.py")
    assert math.isinf(row["reported"]) and 65504 < row["true"] < 2 * 65504 and row["zeroed"] == 1
