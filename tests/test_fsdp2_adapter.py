"""torch's own FSDP2 (``fully_shard``) on real multi-rank jobs (``clipcheck run``), gradients through its reduce-scatter:
one mesh and HSDP exact, two meshes raise (pytorch/pytorch #180346), and torch's inf norm drops a
NaN held by a rank other than 0; both findings reproduced by the standalone scripts in
``scenarios/fsdp2/``."""

import math
import re

import pytest

from harness.scenarios.fsdp2 import TARGETS
from harness_runs import failed, run_clipcheck
from repro_runs import stdout_lines

pytestmark = pytest.mark.distributed

MIXED_MESH = "RuntimeError: All operands in aten.stack.default must have the same mesh"


@pytest.fixture(scope="module")
def fsdp2_world4(tmp_path_factory):
    return run_clipcheck(4, ["--scenario", "fsdp2_meshes", "--target", "torch-fsdp2,reference"],
                       tmp_path_factory.mktemp("fsdp2"))


def test_gradients_come_through_fsdp(fsdp2_world4):
    assert TARGETS[0].backward is not None
    assert fsdp2_world4.summary["harness_errors"] == 0  # every layout's gradients arrived bit for bit


def test_one_mesh_and_hsdp_exact(fsdp2_world4):
    for layout in ("dp=4 fsdp", "dp_replicate=2 dp_shard=2 hsdp"):
        cases = fsdp2_world4.cases(target="torch-fsdp2", layout=layout)
        assert len(cases) == 8 and all(c["verdict"] == "PASS" for c in cases), layout
    assert all(c["verdict"] == "PASS" for c in fsdp2_world4.cases(target="reference"))


def test_mixed_meshes_raise(fsdp2_world4):
    cases = fsdp2_world4.cases(target="torch-fsdp2", layout="ep=2 ep_fsdp=2 mixed meshes")
    assert len(cases) == 8
    for case in cases:
        assert case["verdict"] == "FAIL" and failed(case) == {"raised"}
        assert case["checks"]["raised"]["detail"].startswith(f"ranks [0, 1, 2, 3]: {MIXED_MESH}")
        assert case["finding"]["reach"] == "direct-call"
        assert case["finding"]["repro"] == "scenarios/fsdp2/repro_mixed_meshes.py"


def test_inf_norm_drops_the_last_ranks_nan(fsdp2_world4):
    nan = fsdp2_world4.cases(target="torch-fsdp2", layout="dp=4 fsdp nan on last rank")
    assert all(c["verdict"] == "PASS" for c in nan if c["norm"] == "L2")  # a NaN survives a SUM
    linf = [c for c in nan if c["norm"] == "Linf"]
    assert len(linf) == 4
    for case in linf:
        assert case["verdict"] == "FAIL" and failed(case) == {"nonfinite"}
        assert all(math.isfinite(r) for r in case["reported"])
        assert case["finding"]["owner"] == "pytorch/pytorch"
        assert case["finding"]["repro"] == "scenarios/fsdp2/repro_inf_norm_drops_nan.py"


def torchrun(script: str, nproc: int, *args: str) -> str:
    """The last line rank 0 printed, from a standalone run of one of the repository's scripts."""
    return stdout_lines(script, nproc, *args)[-1]


@pytest.mark.parametrize("nproc", [2, 4])
def test_repro_mixed_meshes(nproc):
    last = torchrun("scenarios/fsdp2/repro_mixed_meshes.py", nproc)
    match = re.fullmatch(r"reported=raised true=(\S+) error=(.*)", last)
    assert match and float(match.group(1)) > 0, last
    assert match.group(2).startswith(MIXED_MESH)


@pytest.mark.parametrize("nproc", [2, 4])
def test_repro_inf_norm_drops_nan(nproc):
    last = torchrun("scenarios/fsdp2/repro_inf_norm_drops_nan.py", nproc)
    reported, true, kept = re.fullmatch(r"reported=(\S+) true=(\S+) nan_kept=(\S+)", last).groups()
    assert math.isfinite(float(reported)) and math.isnan(float(true)) and kept == "True"
    # the control: gloo keeps the NaN where rank 0 holds it
    reported, true, _ = re.fullmatch(r"reported=(\S+) true=(\S+) nan_kept=(\S+)",
                                     torchrun("scenarios/fsdp2/repro_inf_norm_drops_nan.py", nproc,
                                              "--nan-rank", "0")).groups()
    assert math.isnan(float(reported)) and math.isnan(float(true))
