"""What CI tools read: JUnit testcases unique within a run, a failure's text short
and ending in the command that replays that one case, report.describe() the failing cases only,
report.html a replay command for each failing case, a skip reason (an install hint) printed once."""

from __future__ import annotations

import os
import shlex
import sys
import xml.etree.ElementTree as ET
from collections import Counter

import pytest

import harness
from harness.cases.matrix import load_matrix
from harness.errors import UsageError
from harness.plan.planner import plan_cases
from harness.plan.selection import label_matches
from harness.commands.matrix import default_matrix_path
from harness.report.failures import failures_text, replay_command
from harness.report.html import render_html
from harness.report.junit import junit_xml
from harness_runs import harness_process


def _record(case, world: int, backend: str, verdict: str = "PASS") -> dict:
    """A case record as the reporter writes it, for naming: what the plan decides, no numbers."""
    return {"type": "case", "index": case.index, "scenario": case.scenario, "layout": case.variant.label,
            "target": case.target, "norm_type": case.norm_type, "norm": case.norm_label,
            "dtype": case.injection.dtype, "max_norm": case.max_norm, "clip_ratio": case.clip_ratio,
            "seed": case.injection.seed, "world_size": world, "backend": backend, "verdict": verdict,
            "checks": {}, "seconds": 0.0, "reported": [], "true_norm": 1.0, "ratio": 1.0}


def test_junit_testcases_are_unique_on_the_default_matrix():
    spec = load_matrix(default_matrix_path())
    records = []
    for backend in spec.backends:
        for world in spec.worlds:
            try:
                plan = plan_cases(spec, world, backend)
            except UsageError:  # a world the matrix skips (no case fits it)
                continue
            records += [_record(case, world, backend) for case in plan.cases]
    assert len(records) > 1000
    root = ET.fromstring(junit_xml(records))
    names = Counter((tc.get("classname"), tc.get("name")) for tc in root.iter("testcase"))
    repeated = [key for key, n in names.items() if n > 1]
    assert not repeated, repeated[:5]
    assert sum(names.values()) == len(records)
    # the bound is in the name: clipping and not clipping are two testcases of one layout
    assert any(" x0.5" in name for _, name in names) and any(" x2" in name for _, name in names)


def test_variant_equals_selects_one_layout_exactly():
    assert label_matches("dp_shard=2 fsdp", "=dp_shard=2 fsdp")
    assert not label_matches("dp_shard=2 fsdp nan", "=dp_shard=2 fsdp")
    assert label_matches("dp_shard=2 fsdp nan", "fsdp")


@pytest.mark.distributed
def test_describe_lists_only_failing_cases_each_with_a_replay_that_runs_that_case(tmp_path):
    report = harness.check("mutant-local-root-mean", scenarios=["dense_dp"], worlds=[2], dtypes=["fp32"],
                           norm_types=[2])
    assert not report.passed and report.failures and len(report.failures) < len(report.cases)
    text = report.describe()
    assert "summary: " in text and "=> FAIL" in text
    assert " PASS" not in text.replace("=> PASS", "")  # no passing row
    assert text.count("replay: clipcheck run --nproc 2 ") == len(report.failures)
    assert len(text.splitlines()) < 12 * len(report.failures) + 5
    assert report.text.count(" PASS\n") == len(report.cases) - len(report.failures)  # report.text has every row

    first = report.failures[0]
    command = shlex.split(replay_command(first))
    assert command[:2] == ["clipcheck", "run"]
    replayed = harness_process([sys.executable, "-m", "harness", *command[1:], "--json", str(tmp_path / "r.jsonl")],
                               dict(os.environ), timeout=300, cwd=tmp_path)
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert "1 cases, 0 passed, 1 failed" in replayed.stdout, replayed.stdout
    again = [line for line in replayed.stdout.splitlines() if line.startswith("dense_dp ")]
    assert len(again) == 1 and first["layout"] in again[0] and "FAIL" in again[0]


def test_junit_failure_and_html_carry_the_replay_command():
    failing = {"type": "case", "index": 3, "scenario": "dense_dp", "layout": "dp_shard=2 fsdp", "target": "mine:clip",
               "norm_type": "inf", "norm": "Linf", "dtype": "bf16", "max_norm": 1.5, "clip_ratio": 0.5, "seed": 0,
               "world_size": 2, "backend": "gloo", "verdict": "FAIL", "seconds": 0.1, "reported": [2.0, 2.0],
               "true_norm": 3.0, "ratio": 0.666667,
               "checks": {"norm": {"passed": False, "detail": "x" * 5000}, "agree": {"passed": True, "detail": ""}},
               "signature": ["each rank reports its rank-local norm"], "blame": [], "errors": [None, None]}
    expected = "clipcheck run --nproc 2 --scenario dense_dp --target mine:clip --variant '=dp_shard=2 fsdp' " \
               "--dtype bf16 --norm-type inf --clip-ratio 0.5"
    assert replay_command(failing) == expected
    failure = ET.fromstring(junit_xml([failing])).find(".//failure")
    assert failure is not None and failure.get("message") == "norm"
    assert failure.text is not None and f"replay: {expected}" in failure.text
    assert len(failure.text) < 1000  # the 5000-character detail is cut (the JSON record keeps it)
    assert "replay" in failures_text([failing])
    page = render_html([failing])
    assert "--variant &#39;=dp_shard=2 fsdp&#39;" in page  # autoescaped, as every value of the page


@pytest.mark.distributed
def test_a_skip_reason_is_printed_once_per_run(tmp_path):
    scenario = tmp_path / "needs_missing.py"
    scenario.write_text(
        "from harness.scenarios.dense_dp import DenseDP\n"
        "from harness.cases.frameworks import Framework\n\n"
        "class NeedsMissing(DenseDP):\n"
        "    name = 'needs_missing'\n"
        "    requires = Framework('not-a-real-framework', 'not_a_real_module_xyz', None,\n"
        "                         'pip install not-a-real-framework')\n")
    run = harness_process([sys.executable, "-m", "harness", "run", "--nproc", "1",
                           "--scenario", f"{scenario}:NeedsMissing", "--dtype", "fp32,bf16"], dict(os.environ),
                          timeout=300)
    out = run.stdout
    assert run.returncode == 4, out + run.stderr  # nothing judged
    assert out.count("pip install not-a-real-framework") == 1, out
    assert out.count("skipped: the same reason as above") >= 1
