"""The GPU decisions, tested where no GPU is: which worlds skip, and how xdist workers split GPUs."""

import pytest

import torch

from harness.devices import accelerator_for, worker_visible_devices, world_skip_reason, xdist_worker
from harness.world import process_group_backend


@pytest.mark.parametrize("world, backend, devices, reason", [
    (4, "gloo", 0, None),
    (4, "nccl", 0, "backend nccl needs CUDA"),
    (4, "nccl", 2, "world size 4 on nccl needs 4 GPUs (one per rank), 2 visible"),
    (2, "nccl", 2, None),
    (1, "nccl", 8, None),
])
def test_which_worlds_skip(world, backend, devices, reason):
    got = world_skip_reason(world, backend, devices)
    assert (got is None) if reason is None else (reason in got)


@pytest.mark.parametrize("worker, workers, devices, visible, expect", [
    (0, 1, 8, None, None),            # no xdist split with one worker
    (0, 2, 8, None, "0,1,2,3"),
    (1, 2, 8, None, "4,5,6,7"),
    (3, 4, 8, None, "6,7"),
    (2, 4, 2, None, "0"),              # more workers than GPUs: shared round-robin
    (1, 2, 4, "3,5,6,7", "6,7"),       # an existing CUDA_VISIBLE_DEVICES is split, not ignored
    (0, 2, 0, None, None),
])
def test_xdist_workers_get_disjoint_gpus(worker, workers, devices, visible, expect):
    assert worker_visible_devices(worker, workers, devices, visible) == expect


def test_xdist_worker_from_the_environment(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    assert xdist_worker() == (3, 4)
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert xdist_worker() is None


def test_the_default_group_on_gpus_also_carries_cpu_tensors():
    assert process_group_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert process_group_backend("gloo") == "gloo"


def test_adapters_allocate_on_the_worlds_device_not_wherever_cuda_exists():
    assert accelerator_for(torch.device("cpu")) == "cpu"       # a gloo world, even on a GPU machine
    assert accelerator_for(torch.device("cuda", 3)) == "cuda"


def test_megatrons_cuda_allocations_follow_the_world():
    from harness.adapters.megatron import cuda_on_cpu

    with cuda_on_cpu(torch.device("cpu")):
        assert torch.zeros(2, device="cuda").device.type == "cpu"


def test_the_matrix_plans_worlds_beyond_the_gpus_as_skips(monkeypatch, tmp_path):
    import harness.launch as launch

    monkeypatch.setattr(launch, "cuda_device_count", lambda: 2)
    args = launch.build_parser().parse_args(["--nproc-list", "1,2,4", "--backends", "nccl", "--scenario", "dense_dp",
                                             "--target", "reference", "--out", str(tmp_path)])
    launches, skipped = launch.plan_launches(args, tmp_path)
    assert [lc.tag for lc in launches] == ["world 1 nccl", "world 2 nccl"]
    assert skipped == ["world 4 nccl: world size 4 on nccl needs 4 GPUs (one per rank), 2 visible"]
