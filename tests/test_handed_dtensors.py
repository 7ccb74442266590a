"""A clip of the user's is handed what ``fully_shard`` hands it on every FSDP2 and HSDP layout: torch's own
``clip_grad_norm_`` on ``model.parameters()``, as a training loop calls it, passes them (it reduces each
DTensor over its own mesh); on the layouts where a real job hands torch two meshes or plain TP shards it fails
as it fails there."""

from __future__ import annotations

import pytest
import torch

from harness.api import check

WORLD = 4
SELF = "tests/test_handed_dtensors.py:torch_own_clip"


def torch_own_clip(model, *, max_norm, norm_type=2.0):
    """torch's own clip on the model's parameters, the call a training loop makes."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)


@pytest.mark.distributed
def test_torch_own_clip_passes_every_fsdp2_and_hsdp_layout(world4):
    report = check(SELF, scenarios=["fsdp2_meshes", "hsdp_cp", "accelerate_fsdp2"], worlds=[WORLD],
                   pools={WORLD: world4}, dtypes=["fp32", "bf16"], norm_types=[2], clip_ratios=[0.5],
                   parallelism=["fsdp", "hsdp", "cp"], exclude="nan")
    judged = [c for c in report.cases if c["verdict"] != "SKIP"]
    labels = {c["layout"] for c in judged}
    assert {"dp_replicate=2 dp_shard=2 hsdp", "dp_replicate=2 dp_shard=2 cp=1 replicas",
            "dp_replicate=1 dp_shard=2 cp=2 replicas", "dp=4 fsdp", "dp_shard=4 fsdp2"} <= labels, labels
    assert report.passed and all(c["verdict"] == "PASS" for c in judged), report.describe()


@pytest.mark.distributed
def test_torch_own_clip_fails_where_a_real_job_hands_it_two_meshes(world4):
    """FSDP2 on dense parameters over every rank and on experts over ``ep_fsdp``: torch's stack of the two
    meshes' norms raises, as in a real job (torch issue #180346)."""
    report = check(SELF, scenarios=["fsdp2_meshes"], worlds=[WORLD], pools={WORLD: world4}, dtypes=["fp32"],
                   norm_types=[2], clip_ratios=[0.5], variant="mixed meshes")
    (case,) = report.cases
    assert case["verdict"] == "FAIL" and "must have the same mesh" in str(case["errors"]), report.describe()
