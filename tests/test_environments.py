"""Every launcher under the thread settings users' shells have: ``OMP_NUM_THREADS`` unset, empty,
1, 2 and 8. A launcher that had computed with more than one OpenMP thread and then forked its ranks hung
them in their first parallel region; every run here must end with its verdict within ``BOUND_S``, and every
rank must compute with the threads asked for (a positive count as given, else one:
``harness.run.world.openmp.rank_threads``), which ``tests/thread_count_target.py`` checks from inside the
clip. The launchers as users start them: ``clipcheck`` from the venv's bin, torchrun, and pytest with the
plugin, each a fresh process with the environment under test (no launch server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THREADS_TARGET = f"{ROOT / 'tests' / 'thread_count_target.py'}:clip"
BOUND_S = 240
"""What each run may take here (2 cores): a hang ends the test at this bound, not at the suite's."""

SETTINGS = [pytest.param(None, id="unset"), pytest.param("", id="empty"), pytest.param("1", id="1"),
            pytest.param("2", id="2"), pytest.param("8", id="8")]

README_EXAMPLE = ["--scenario", "xorl_ep_lora", "--dtype", "fp32", "--clip-ratio", "0.5",
                  "--variant", "minimax_m3 hybrid_shared=False"]
"""The README's first example (its targets given by each test)."""


def expected_threads(setting: str | None) -> int:
    return int(setting) if setting and setting.isdigit() and int(setting) > 0 else 1


def user_env(setting: str | None, mkl: str | None = None) -> dict[str, str]:
    """A user's shell: the venv's bin first on PATH, ``OMP_NUM_THREADS`` as ``setting`` says and
    ``MKL_NUM_THREADS`` as ``mkl`` says (None: unset); the checkout importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if setting is not None:
        env["OMP_NUM_THREADS"] = setting
    if mkl is not None:
        env["MKL_NUM_THREADS"] = mkl
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env["CLIPCHECK_TEST_THREADS"] = str(expected_threads(setting))
    return env


def run(cmd: list[str], setting: str | None, cwd: Path, mkl: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, env=user_env(setting, mkl), cwd=cwd, capture_output=True, text=True,
                              timeout=BOUND_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} did not end within {BOUND_S} s with OMP_NUM_THREADS={setting!r}:\n"
                    f"{(exc.stdout or b'')[-3000:]!r}")


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def verdicts(path: Path) -> dict[tuple[str, str], set[str]]:
    """(layout, target) -> the verdicts of its cases."""
    out: dict[tuple[str, str], set[str]] = {}
    for rec in records(path):
        if rec.get("type") == "case":
            out.setdefault((rec["layout"], rec["target"]), set()).add(rec["verdict"])
    return out


def clipcheck() -> str:
    return str(Path(sys.executable).parent / "clipcheck")


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_readme_first_example_ends_with_its_verdict(setting, tmp_path):
    out = tmp_path / "results.jsonl"
    proc = run([clipcheck(), "run", "--nproc", "2", *README_EXAMPLE,
                "--target", f"xorl-style,reference,{THREADS_TARGET}", "--json", str(out)], setting, tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = verdicts(out)
    fail = ("ep=2 ep_fsdp=1 plan=minimax_m3 hybrid_shared=False", "xorl-style")
    assert found.pop(fail) == {"FAIL"}
    assert len(found) == 5 and all(v == {"PASS"} for v in found.values()), found


@pytest.mark.parametrize("setting", [None, "1"], ids=["omp-unset", "omp-1"])
def test_mkl_threads_in_the_shell_do_not_hang_the_ranks(setting, tmp_path):
    """``MKL_NUM_THREADS=2``: the launcher's matrix products ran on two threads of the same OpenMP pool."""
    out = tmp_path / "results.jsonl"
    proc = run([clipcheck(), "run", "--nproc", "2", *README_EXAMPLE, "--target", f"reference,{THREADS_TARGET}",
                "--json", str(out)], setting, tmp_path, mkl="2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(verdicts(out)) == 4 and all(v == {"PASS"} for v in verdicts(out).values())


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_framework_scenario_ends_with_its_verdict(setting, tmp_path):
    """torch's own FSDP2 (``fsdp2_meshes``) on the layout where torch's clip raises (a known finding)."""
    out = tmp_path / "results.jsonl"
    proc = run([clipcheck(), "run", "--nproc", "2", "--scenario", "fsdp2_meshes", "--variant", "mixed meshes",
                "--target", f"torch-fsdp2,{THREADS_TARGET}", "--dtype", "fp32", "--norm-type", "2", "--json", str(out)],
               setting, tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = {target: v for (_, target), v in verdicts(out).items()}
    assert found == {"torch-fsdp2": {"FAIL"}, THREADS_TARGET: {"PASS"}}, proc.stdout[-3000:]


@pytest.mark.parametrize("setting", SETTINGS)
def test_clipcheck_matrix_ends_with_its_verdict(setting, tmp_path):
    proc = run([clipcheck(), "matrix", "--nproc-list", "2", *README_EXAMPLE, "--target", f"xorl-style,{THREADS_TARGET}",
                "--out", str(tmp_path / "out")], setting, tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = verdicts(tmp_path / "out" / "results.jsonl")
    assert found.pop(("ep=2 ep_fsdp=1 plan=minimax_m3 hybrid_shared=False", "xorl-style")) == {"FAIL"}
    assert len(found) == 3 and all(v == {"PASS"} for v in found.values()), found


@pytest.mark.parametrize("setting", SETTINGS)
def test_torchrun_ends_with_its_verdict(setting, tmp_path):
    out = tmp_path / "results.jsonl"
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "harness",
                "--scenario", "dense_dp", "--variant", "=dp=2 fsdp", "--target", f"reference,{THREADS_TARGET}",
                "--dtype", "fp32", "--json", str(out)], setting, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = verdicts(out)
    assert len(found) == 2 and all(v == {"PASS"} for v in found.values()), found


AUDITS_ON_A_WARM_WORLD = '''
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import harness


def job():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    model(torch.randn(4, 16)).sum().backward()
    for p in model.parameters():  # DDP's all-reduce: replicas
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    return model


@pytest.mark.world_size(4, timeout=60)
@pytest.mark.parametrize("mode", ["twice", "correct", "raises-on-rank-1", "correct-again"])
def test_audit(mode):
    assert torch.get_num_threads() == int(os.environ["CLIPCHECK_TEST_THREADS"]), torch.get_num_threads()
    model = job()

    def clip():
        if mode == "raises-on-rank-1" and dist.get_rank() == 1:
            raise ValueError("planted on rank 1")
        total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], 2.0)
        total = total * 2 if mode == "twice" else total
        coefficient = torch.clamp(0.1 / (total + 1e-6), max=1.0)
        for p in model.parameters():
            p.grad.mul_(coefficient)
        return total

    report = harness.audit(model, clip, max_norm=0.1)
    print(f"AUDIT {mode} rank {dist.get_rank()}: {report.verdict}")
    assert report.passed, report.text
'''


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_pytest_plugin_judges_each_audit_on_its_own(setting, tmp_path):
    """A warm world of 4 ranks runs a failing audit, a correct one, one whose clip raises on rank 1 and a
    correct one again: each judged on its own (the failing audits did not break the next ones: they once
    hung in the next audit's first exchange), the raise reported as raised, never as a hang."""
    (tmp_path / "test_audits.py").write_text(AUDITS_ON_A_WARM_WORLD)
    proc = run([sys.executable, "-m", "pytest", "-p", "harness.pytest_plugin", "-p", "no:cacheprovider", "-q", "-s",
                "test_audits.py"], setting, tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-4000:]
    assert "2 failed, 2 passed" in output, output[-4000:]
    for mode, verdict in (("twice", "FAIL"), ("correct", "PASS"), ("correct-again", "PASS")):
        assert all(f"AUDIT {mode} rank {r}: {verdict}" in output for r in range(4)), output[-4000:]
    assert "raised: rank 1: ValueError: planted on rank 1" in output, output[-4000:]
    assert "hung" not in output and "hang:" not in output, output[-4000:]


FORK_AFTER_A_PARALLEL_REGION = '''
import os, sys
import torch
import harness.run.world.openmp as openmp  # releases the pool before every fork

torch.set_num_threads(2)
torch.arange(10**7).sum()  # a parallel region: GNU OpenMP now keeps a pool of threads
pid = os.fork()
if pid == 0:
    torch.set_num_threads(openmp.rank_threads({"OMP_NUM_THREADS": "2"}))
    torch.arange(10**7).sum()  # hung here, waiting for the parent's pool, before the release
    os._exit(0 if torch.get_num_threads() == 2 else 1)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
'''


def test_a_rank_forked_after_a_parallel_region_computes_with_two_threads():
    proc = subprocess.run([sys.executable, "-c", FORK_AFTER_A_PARALLEL_REGION], env=user_env("2"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_thread_count_a_rank_takes():
    from harness.run.world.openmp import name_rank_threads, rank_threads

    settings = ("", "0", "abc", "4,2", " 3 ", "1", "8")
    assert [rank_threads({"OMP_NUM_THREADS": v}) for v in settings] == [1, 1, 1, 1, 3, 1, 8]
    assert rank_threads({}) == 1
    environ = {"OMP_NUM_THREADS": ""}
    name_rank_threads(environ)
    assert environ == {"OMP_NUM_THREADS": "1"}
    environ = {"OMP_NUM_THREADS": "2"}
    name_rank_threads(environ)
    assert environ == {"OMP_NUM_THREADS": "2"}
