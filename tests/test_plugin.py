"""The pytest plugin: test bodies on N ranks of a warm world, with per-rank failure reports."""

import os

import pytest
import torch
import torch.distributed as dist

from harness_runs import ROOT



@pytest.mark.world_size(2)
@pytest.mark.parametrize("value", [1.0, 2.5])
def test_body_runs_on_every_rank(value):
    x = torch.tensor([value * (dist.get_rank() + 1)])
    dist.all_reduce(x)
    assert dist.get_world_size() == 2
    assert float(x) == value * 3


@pytest.mark.world_size(2)
@pytest.mark.parametrize("tensor", [torch.ones(3)])
def test_a_tensor_parameter_reaches_every_rank(tensor):
    """Pickled once for all ranks, a CPU tensor travelled as a shared-memory handle only one rank
    could claim: the other died (a false FAIL of a correct test; found in review)."""
    assert float(tensor.sum()) == 3.0


@pytest.mark.world_size(4)
def test_four_ranks_see_a_four_rank_world():
    ranks = [None] * 4
    dist.all_gather_object(ranks, dist.get_rank())
    assert ranks == [0, 1, 2, 3]


def test_rank_pool_fixture_reuses_one_warm_world(rank_pool):
    pool = rank_pool(2)
    before = pool.starts
    for _ in range(5):
        assert [r.value for r in pool.run(dist.get_rank)] == [0, 1]
    assert pool.starts == max(before, 1)


INNER = '''
import os, time
import pytest
import torch.distributed as dist

@pytest.mark.world_size(2)
def test_fails_on_rank_one():
    assert dist.get_rank() != 1, "rank one is wrong"

@pytest.mark.world_size(2, timeout=3)
def test_hangs_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(600)

@pytest.mark.world_size(2)
def test_skips_everywhere():
    pytest.skip("nothing to do here")

@pytest.mark.world_size(2)
def test_recovers_after_the_hang():
    x = [None, None]
    dist.all_gather_object(x, os.getpid())
    assert len(set(x)) == 2
'''


@pytest.fixture
def inner(pytester, monkeypatch):
    """An inner pytest run in a subprocess that can import this checkout."""
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return pytester


def test_failures_hangs_and_skips_are_reported_per_rank(inner):
    pytester = inner
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "harness.pytest_plugin", "-q")
    result.assert_outcomes(passed=1, failed=2, skipped=1)
    out = result.stdout.str()
    assert "1 of 2 ranks failed" in out and "---- rank 1 (error) ----" in out and "rank one is wrong" in out
    assert "---- rank 0 (hung) ----" in out and "no answer within 3 s" in out and "test_hangs_on_rank_zero" in out


def test_works_under_xdist(inner):
    pytester = inner
    pytester.makepyfile(test_inner='''
import pytest, torch, torch.distributed as dist

@pytest.mark.world_size(2)
@pytest.mark.parametrize("i", range(4))
def test_sum(i):
    x = torch.ones(1) * i
    dist.all_reduce(x)
    assert float(x) == 2 * i
''')
    result = pytester.runpytest_subprocess("-p", "harness.pytest_plugin", "-n", "2", "-q")
    result.assert_outcomes(passed=4)


PARITY = '''
import time
import pytest
import torch.distributed as dist

@pytest.mark.world_size([1, 2])
def test_each_size():
    assert dist.get_world_size() in (1, 2)

@pytest.mark.world_size(2, backend="nccl")
def test_wants_gpus():
    raise AssertionError("must not run without CUDA")

@pytest.mark.world_size(2)
def test_hangs_past_the_command_line_timeout():
    if dist.get_rank() == 1:
        time.sleep(600)

def test_rank_pool_uses_the_configured_timeout(rank_pool):
    assert rank_pool(2).timeout_s == 2.0

def test_no_database_unless_asked(fuzz_database):
    assert fuzz_database is None
'''


def test_plugin_parity_sizes_gpu_skips_and_command_line_timeout(inner):
    pytester = inner
    pytester.makepyfile(test_parity=PARITY)
    result = pytester.runpytest_subprocess("-p", "harness.pytest_plugin", "-v", "-rs", "--clipcheck-timeout", "2")
    result.assert_outcomes(passed=4, failed=1, skipped=1)
    out = result.stdout.str()
    assert "test_each_size[world1] PASSED" in out and "test_each_size[world2] PASSED" in out
    assert "backend nccl needs CUDA" in out
    assert "no answer within 2 s" in out


def test_an_opt_in_example_database(inner):
    pytester = inner
    pytester.makeini("[pytest]\nclipcheck_fuzz_database = .clipcheck-examples\n")
    pytester.makepyfile(test_db='''
from hypothesis.database import DirectoryBasedExampleDatabase

def test_database(fuzz_database):
    assert isinstance(fuzz_database, DirectoryBasedExampleDatabase)
''')
    result = pytester.runpytest_subprocess("-p", "harness.pytest_plugin", "-q")
    result.assert_outcomes(passed=1)


def test_the_plugin_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, harness.pytest_plugin; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout.strip() == "False", proc.stderr
