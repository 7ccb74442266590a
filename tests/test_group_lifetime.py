"""Process groups end with their generation: a renewal frees the groups it drops, with their threads,
whatever torch or a framework cached of them.

Every live gloo group keeps three threads; a generation's groups were once only forgotten, not freed
(reference cycles that only a full collection breaks, DTensor's planner and topology caches, frameworks'
module globals: DeepSpeed's groups, VeOmni's and xorl's parallel states, accelerate's singleton state,
adapters' own caches), and a long run piled up threads in every rank until it stalled (docs/performance.md,
"Process groups: freed, not only forgotten")."""

from __future__ import annotations

import pytest

import subprocess
import sys

from harness_runs import ROOT, gloo_groups_held, harness_env, most_threads

pytestmark = pytest.mark.distributed

THREAD_CEILING = 64
GROUP_BUILDERS = "deepspeed_autoep,accelerate_fsdp2,veomni_ep,colossalai_moe,automodel_ep,xorl_ep_lora"
"""The framework scenarios whose frameworks build process groups of their own (and keep them in globals)."""


def test_framework_scenarios_hold_few_threads_through_many_renewals(tmp_path):
    """The framework scenarios whose frameworks build groups, at world 4, one dtype, norm and bound per layout
    (so many layouts, and a renewal at most of them): no rank ever holds more than 64 threads (the code
    before the groups were freed fails it: docs/performance.md, "Process groups: freed, not only forgotten")."""
    args = ["-m", "harness", "run", "--nproc", "4", "--scenario", GROUP_BUILDERS, "--dtype", "fp32",
            "--norm-type", "2", "--clip-ratio", "0.5", "--no-progress", "--json", str(tmp_path / "r.jsonl")]
    with open(tmp_path / "out.txt", "w+") as out:  # a pipe nobody reads while sampling would fill and block
        proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=harness_env(), stdout=out,
                                stderr=subprocess.STDOUT, text=True)
        most, names = most_threads(proc.pid)
        proc.wait(timeout=60)
        out.seek(0)
        text = out.read()
    assert proc.returncode in (0, 1), text[-3000:]
    assert "0 harness errors" in text, text[-2000:]
    assert most <= THREAD_CEILING, (most, names)


def test_a_renewal_leaves_no_dropped_group_alive(world4):
    """On a warm world, after cases on many meshes (renewals among them) and a last renewal, every gloo
    group alive in a rank's process is one of its current generation."""
    import harness

    report = harness.check("reference", scenarios=["dense_edges", "fsdp2_meshes", "hsdp_cp"], worlds=[4],
                           pools={4: world4}, dtypes=["fp32"], norm_types=[2], clip_ratios=[0.5])
    assert report.passed, report
    for result in world4.run(gloo_groups_held):
        alive, loops = result.value
        assert loops <= alive, (result.rank, alive, loops)
