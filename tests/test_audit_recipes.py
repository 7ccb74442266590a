"""The recipes of docs/audit.md as tests: each framework's own clip audited in a real job
(tests/audit_jobs/), a real forward and backward at world 2 and 4 on gloo; the audit agrees with the framework
where it is right and catches it where our findings say it is wrong. A framework that is not installed is a
skip with its install hint."""

from __future__ import annotations

import pytest

from audit_runs import JobRun, run_job
from harness.cases.frameworks import Framework
from harness.scenarios.accelerate import FRAMEWORK as ACCELERATE
from harness.scenarios.deepspeed import FRAMEWORK as DEEPSPEED
from harness.scenarios.megatron import FRAMEWORK as MEGATRON

pytestmark = pytest.mark.distributed
WORLDS = [2, 4]


def _needs(framework: Framework) -> None:
    why = framework.unavailable()
    if why is not None:
        pytest.skip(why)


def _job(script: str, nproc: int, args: list[str], tmp_path, **env: str) -> JobRun:  # type: ignore[no-untyped-def]
    run = run_job(script, nproc, args, tmp_path, timeout=300, env=env or None)
    assert run.found is not None, f"exit {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    return run


def _failed(run: JobRun) -> set[str]:
    return {name for name, check in run.record["checks"].items() if check and not check["passed"]}


@pytest.mark.parametrize("nproc", WORLDS)
def test_deepspeed_engine_owner_sharded_is_the_mean_of_the_rank_norms(nproc, tmp_path):
    """DeepSpeed 0.19.8, #8475: through engine.step()'s own clip_fp32_gradients (auditing()), the ratio the
    audit measures is the mean of the per-rank norms over the true norm, computed here without the harness."""
    _needs(DEEPSPEED)
    run = _job("deepspeed_engine.py", nproc, [str(nproc)], tmp_path, DS_ACCELERATOR="cpu")
    assert run.found["verdict"] == "FAIL", run.found["text"]
    assert run.record["ratio"] == pytest.approx(run.found["predicted_ratio"], rel=1e-5)
    assert run.record["ratio"] < 0.99
    assert any("mean of the rank-local norms" in line for line in run.record["signature"]), run.found["text"]


@pytest.mark.parametrize("nproc", WORLDS)
def test_deepspeed_engine_with_replicated_experts_passes(nproc, tmp_path):
    _needs(DEEPSPEED)
    run = _job("deepspeed_engine.py", nproc, ["1"], tmp_path, DS_ACCELERATOR="cpu")
    assert run.found["verdict"] == "PASS", run.found["text"]


@pytest.mark.parametrize("nproc", WORLDS)
@pytest.mark.parametrize("mode", ["ddp", "tp-dtensor"])
def test_accelerate_is_right_on_replicas_and_dtensor_shards(mode, nproc, tmp_path):
    _needs(ACCELERATE)
    run = _job("accelerate_clip.py", nproc, [mode], tmp_path)
    assert run.found["verdict"] == "PASS", run.found["text"]
    if mode == "tp-dtensor":  # the declared placement, audited against the bits
        assert run.record["measured_placements"]["expert"] == "distinct on tp"
        assert run.record["declared_mismatches"] == []


@pytest.mark.parametrize("nproc", WORLDS)
def test_accelerate_counts_plain_tp_shards_rank_locally(nproc, tmp_path):
    _needs(ACCELERATE)
    run = _job("accelerate_clip.py", nproc, ["tp-plain"], tmp_path)
    assert run.found["verdict"] == "FAIL" and {"norm", "agree"} <= _failed(run), run.found["text"]
    assert any("rank-local" in line for line in run.record["signature"]), run.found["text"]


@pytest.mark.parametrize("nproc", WORLDS)
def test_fsdp2_ep(nproc, tmp_path):
    right = _job("fsdp2_ep.py", nproc, ["per-mesh"], tmp_path)
    assert right.found["verdict"] == "PASS", right.found["text"]
    # the experts are DTensors on the ep_fsdp sub-mesh, the dense layers on a mesh of every rank: a saved layout
    # keeps each on its sub-mesh of the job's mesh, so no note says its replay would build them plain
    assert not any("torch-dtensor cannot run" in note for note in right.found["notes"]), right.found
    wrong = _job("fsdp2_ep.py", nproc, ["no-ep-reduce"], tmp_path)
    assert wrong.found["verdict"] == "FAIL" and "norm" in _failed(wrong), wrong.found["text"]
    assert "experts.weight" in str(wrong.record["blame"])
    torch_clip = _job("fsdp2_ep.py", nproc, ["torch"], tmp_path)  # pytorch #180346: every rank raises
    assert torch_clip.found["verdict"] == "FAIL" and "same mesh" in torch_clip.found["text"]


@pytest.mark.parametrize("nproc", WORLDS)
def test_megatron_clip_and_an_unmarked_tp_shard(nproc, tmp_path):
    _needs(MEGATRON)
    stock = _job("megatron_clip.py", nproc, ["stock"], tmp_path)
    assert stock.found["verdict"] == "PASS", stock.found["text"]
    unmarked = _job("megatron_clip.py", nproc, ["unmarked"], tmp_path)
    assert unmarked.found["verdict"] == "FAIL" and unmarked.record["ratio"] < 1.0, unmarked.found["text"]
    assert "fc1.weight" in str(unmarked.record["blame"])
