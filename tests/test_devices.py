"""The GPU decisions, tested where no GPU is: which worlds skip, and how xdist workers split GPUs."""

import pytest

import torch

from harness.run.world.devices import accelerator_for, worker_visible_devices, world_skip_reason, xdist_worker
from harness.run.world.dist_world import process_group_backend


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
    from harness.scenarios.megatron.adapter import cuda_on_cpu

    with cuda_on_cpu(torch.device("cpu")):
        assert torch.zeros(2, device="cuda").device.type == "cpu"


def test_the_matrix_plans_worlds_beyond_the_gpus_as_skips(monkeypatch, tmp_path):
    import harness.commands.matrix as launch

    monkeypatch.setattr(launch, "cuda_device_count", lambda: 2)
    args = launch.build_parser().parse_args(["--nproc-list", "1,2,4", "--backends", "nccl", "--scenario", "dense_dp",
                                             "--target", "reference", "--out", str(tmp_path)])
    launches, skipped = launch.plan_launches(args, tmp_path)
    assert [lc.tag for lc in launches] == ["world 1 nccl", "world 2 nccl"]
    assert skipped == ["world 4 nccl: world size 4 on nccl needs 4 GPUs (one per rank), 2 visible"]


# -- the failure path on nccl (harness/run/world/devices.py docstring): each decision, tested on CPU ----------

def test_nccl_errors_are_made_synchronous_and_never_kill_the_process():
    from harness.run.world.devices import NCCL_ERROR_SETTINGS, nccl_error_environment

    assert NCCL_ERROR_SETTINGS == {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert nccl_error_environment({}) == NCCL_ERROR_SETTINGS
    # a user's own values are overridden: the judge's failure path depends on them
    assert nccl_error_environment({"TORCH_NCCL_BLOCKING_WAIT": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}) == {
        "TORCH_NCCL_BLOCKING_WAIT": "1"}
    assert nccl_error_environment(dict(NCCL_ERROR_SETTINGS)) == {}


def test_an_nccl_world_sets_them_before_its_first_group(monkeypatch):
    import os

    from harness.run.world.dist_world import DistWorld

    for key in ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "MASTER_ADDR", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # torch's default: kill the process
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    world = DistWorld("nccl", start=False)  # no group yet: ProcessGroupNCCL reads them when created
    assert world.device == torch.device("cuda", 0)
    assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT")
    DistWorld("gloo", start=False)
    assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ


class _GuardWorld:
    """What ``guard.guarded`` uses of a world, recording what it was told."""

    def __init__(self, device):
        self.device, self.hang_deadline_s = device, 0.5
        self.hung, self.abandoned = [], 0

    def post_hung(self, topic, payload):
        self.hung.append(payload["error"])

    def abandon(self):
        self.abandoned += 1

    def left_call(self, raised):
        """As a world whose peer is still inside the call: a rank that raised abandons the groups."""
        if raised:
            self.abandon()


def test_gpu_work_is_settled_inside_the_targets_guard(monkeypatch):
    import threading
    import time

    import harness.run.case.guard as guard

    seen = []

    def settle(device):
        seen.append((device, any(t.name == "clipcheck-watchdog" for t in threading.enumerate())))
        time.sleep(1.0)  # a kernel behind an unmatched collective: the watchdog reports it

    monkeypatch.setattr(guard, "settle", settle)
    world = _GuardWorld(torch.device("cuda", 1))
    value, error, _ = guard.guarded(world, "status", lambda: 3.0)
    assert seen == [(torch.device("cuda", 1), True)]  # after the target, while the watchdog runs
    assert value == 3.0 and error is None
    assert len(world.hung) == 1 and "in settle" in world.hung[0]  # the hang names where it is stuck


def test_an_error_surfacing_at_settle_is_the_targets(monkeypatch):
    import harness.run.case.guard as guard

    def settle(device):
        raise RuntimeError("NCCL error: remote process exited or there was a network error")

    monkeypatch.setattr(guard, "settle", settle)
    world = _GuardWorld(torch.device("cuda", 0))
    value, error, _ = guard.guarded(world, "status", lambda: 3.0)
    assert value is None and error.startswith("RuntimeError: NCCL error") and world.abandoned == 1


def test_settle_is_a_no_op_on_cpu():
    from harness.run.world.devices import settle

    settle(torch.device("cpu"))  # would raise without CUDA if it touched torch.cuda


def test_a_single_run_or_fuzz_of_a_world_beyond_the_gpus_is_one_line_before_any_process(monkeypatch, capsys):
    import harness.run.world.devices as devices
    from harness.commands import fuzz

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 2)
    assert fuzz.main(["--target", "reference", "--world", "4", "--backend", "nccl"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "clipcheck: error: world size 4 on nccl needs 4 GPUs (one per rank), 2 visible"


def test_check_skips_the_worlds_this_machine_cannot_run(monkeypatch):
    import harness.api as api
    from harness.errors import ClipcheckInputError

    def short_of_gpus(world, backend):
        return f"world size {world} on nccl needs {world} GPUs (one per rank), 1 visible" if world > 1 else None

    monkeypatch.setattr(api, "world_problem", short_of_gpus)
    report = api.check("reference", scenarios=["dense_dp"], worlds=[1, 4], dtypes=["fp32"], norm_types=["2"],
                       clip_ratios=[2.0], backend="gloo")
    assert report.skipped == ["world 4 gloo: world size 4 on nccl needs 4 GPUs (one per rank), 1 visible"]
    assert report.passed and {c["world_size"] for c in report.cases} == {1}
    assert report.describe().startswith("skipped: world 4 gloo:")
    with pytest.raises(ClipcheckInputError, match="nothing to run; world 4 gloo: world size 4"):
        api.check("reference", scenarios=["dense_dp"], worlds=[4], backend="gloo")
