"""The CI workflows users copy (examples/ci/clipcheck-cpu.yml and clipcheck-gpu.yml, whose heart
docs/getting-started.md shows): the steps after the clipcheck one run ``if: always()`` (a wrong clip is
when the summary, the user's tests and report.html matter most), the clipcheck step's command line is
one ``clipcheck matrix`` accepts, selecting parallelism kinds that exist, and the summary step writes
the run page's summary with or without the clipcheck step's console. And ``.ci/workflow-steps``, which
runs the CPU one's steps as written in CI (``.ci/installed-product``), runs only the ``if: always()``
steps after a failing one, as Actions does.

The workflows are read with PyYAML where it is installed (the frameworks bring it), else with
``read_plainly``, a reader of the subset these files use, checked against PyYAML where both exist.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import re
import shlex
import subprocess
import textwrap
from pathlib import Path

import pytest

from harness.cases.parallelism import check_kinds
from harness.commands.matrix import build_parser

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = [ROOT / "examples" / "ci" / "clipcheck-cpu.yml", ROOT / "examples" / "ci" / "clipcheck-gpu.yml"]
ids = [path.name for path in EXAMPLES]

Workflow = tuple[dict[str, str], list[dict[str, str]]]
"""A one-job workflow as (its job's env, its steps as {key: text}, keys with a nested value left out)."""


def read_plainly(text: str) -> Workflow:
    """The job's env and steps of a one-job workflow laid out as these files are (the job's keys at 4
    spaces, its env at 6, a step's keys at 8; ``run: |`` blocks; ``# comments``), without PyYAML."""
    env: dict[str, str] = {}
    steps: list[dict[str, str]] = []
    section = key = ""
    block: list[str] | None = None

    def scalar(value: str) -> str:
        return re.sub(r"\s+#.*$", "", value).strip().strip('"')

    for line in text.split("\n"):
        stripped, indent = line.strip(), len(line) - len(line.lstrip(" "))
        if block is not None:
            if not stripped or indent > 8:
                block.append(line)
                continue
            steps[-1][key] = textwrap.dedent("\n".join(block)).strip("\n") + "\n"
            block = None
        if not stripped or stripped.startswith("#"):
            continue
        if indent <= 4:
            section = stripped[:-1] if indent == 4 and stripped in ("env:", "steps:") else ""
        elif section == "env" and indent == 6:
            name, _, value = stripped.partition(":")
            env[name] = scalar(value)
        elif section == "steps":
            if stripped.startswith("- "):
                steps.append({})
                stripped, indent = stripped[2:], indent + 2
            if indent == 8 and ":" in stripped:
                key, _, value = stripped.partition(":")
                if value.strip() in ("|", "|-"):
                    block = []
                elif scalar(value):
                    steps[-1][key] = scalar(value)
    if block is not None:
        steps[-1][key] = textwrap.dedent("\n".join(block)).strip("\n") + "\n"
    return env, steps


def read_workflow(path: Path) -> Workflow:
    try:
        import yaml
    except ImportError:
        return read_plainly(path.read_text(encoding="utf-8"))
    (job,) = yaml.safe_load(path.read_text(encoding="utf-8"))["jobs"].values()
    return ({k: str(v) for k, v in (job.get("env") or {}).items()},
            [{k: v for k, v in step.items() if isinstance(v, str)} for step in job["steps"]])


def clipcheck_step(steps: list[dict[str, str]]) -> int:
    (index,) = [i for i, step in enumerate(steps) if "clipcheck matrix" in step.get("run", "")]
    return index


@pytest.mark.parametrize("path", EXAMPLES, ids=ids)
def test_the_steps_after_clipchecks_run_always(path):
    env, steps = read_workflow(path)
    first = clipcheck_step(steps)
    later = steps[first + 1:]
    assert len(later) >= 3, "the user's tests, the summary and the upload follow the clipcheck step"
    assert [step.get("if") for step in later] == ["always()"] * len(later), [step.get("name") for step in later]
    assert "if" not in steps[first]  # the clipcheck step itself runs only when the install did
    assert any(step.get("uses", "").startswith("actions/upload-artifact") for step in later)
    assert any("GITHUB_STEP_SUMMARY" in step.get("run", "") for step in later)


@pytest.mark.parametrize("path", EXAMPLES, ids=ids)
def test_the_clipcheck_step_is_a_command_line_clipcheck_accepts(path):
    """Its ``clipcheck matrix`` line, the job's env substituted, parses as ``clipcheck matrix``'s
    arguments, selects parallelism kinds that exist, keeps its exit status through ``tee`` and writes
    the console the summary step reads."""
    env, steps = read_workflow(path)
    script = steps[clipcheck_step(steps)]["run"]
    assert script.startswith("set -o pipefail\n")  # Actions runs a step without `shell:` under bash -e alone
    command = script.replace("\\\n", " ")
    (line,) = [x for x in command.split("\n") if x.strip().startswith("clipcheck matrix")]
    argv_text, _, tee = line.partition(" | ")
    assert tee.strip() == "tee clipcheck-results/console.txt"
    argv = [re.sub(r"\$(\w+)", lambda m: env[m.group(1)], word) for word in shlex.split(argv_text)]
    args = build_parser().parse_args(argv[2:])
    assert args.parallelism
    check_kinds(args.parallelism)  # what the planner checks: ddp, fsdp, hsdp, ep, tp, pp, cp
    assert args.targets == (env["CLIP"],) and args.out == "clipcheck-results"
    assert re.search(r"^ *# PYTHONPATH: \$\{\{ github\.workspace \}\}/src", path.read_text(encoding="utf-8"), re.M)


@pytest.mark.parametrize("path", EXAMPLES, ids=ids)
def test_the_summary_step_writes_the_console_or_says_clipcheck_did_not_run(path, tmp_path):
    env, steps = read_workflow(path)
    (script,) = [step["run"] for step in steps if "GITHUB_STEP_SUMMARY" in step.get("run", "")]
    summary = tmp_path / "summary.md"
    run_env = dict(os.environ, **env, GITHUB_STEP_SUMMARY=str(summary))

    def run() -> str:
        proc = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=run_env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return summary.read_text(encoding="utf-8")

    assert "clipcheck did not run" in run()  # the install failed: no console, the step still succeeds
    summary.unlink()
    (tmp_path / "clipcheck-results").mkdir()
    row = "my_clip:clip  dense_dp  20  20  0  0  0/8  0.632172"
    (tmp_path / "clipcheck-results" / "console.txt").write_text(f"target  scenario\n{row}\n")
    written = run()
    assert f"```text\ntarget  scenario\n{row}\n```" in written and env["CLIP"] in written.split("\n")[0]


def test_getting_started_shows_the_cpu_examples_steps_as_they_are():
    """The page's excerpt of clipcheck-cpu.yml: each step it shows is the file's step of that name."""
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed: the page's YAML block is not read")
    page = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    shown = yaml.safe_load(re.search(r"## In CI.*?```yaml\n(.*?)```", page, re.S).group(1))
    env, steps = read_workflow(EXAMPLES[0])
    by_name = {step["name"]: step for step in steps if "name" in step}
    for step in shown["steps"]:
        assert step == by_name[step["name"]], step["name"]
    assert {k: str(v) for k, v in shown["env"].items()}.items() <= env.items()


def test_the_plain_reader_reads_the_examples_as_pyyaml_does():
    pytest.importorskip("yaml", reason="PyYAML is not installed: nothing to compare the plain reader with")
    for path in EXAMPLES:
        assert read_plainly(path.read_text(encoding="utf-8")) == read_workflow(path), path.name


def _workflow_steps():
    pytest.importorskip("yaml", reason="PyYAML is not installed: .ci/workflow-steps needs it")
    path = ROOT / ".ci" / "workflow-steps"
    loader = importlib.machinery.SourceFileLoader("workflow_steps", str(path))
    spec = importlib.util.spec_from_loader("workflow_steps", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_workflow_steps_runs_only_the_always_steps_after_a_failure(tmp_path, capsys, monkeypatch):
    workflow_steps = _workflow_steps()
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)  # under Actions: not this job's own summary
    monkeypatch.chdir(tmp_path)
    steps = [{"uses": "actions/checkout@v4"},
             {"name": "fails", "run": "echo ran >> log; exit 3"},
             {"name": "skipped", "run": "echo skipped >> log"},
             {"name": "always", "if": "always()", "run": "echo always >> log; echo summary >> \"$GITHUB_STEP_SUMMARY\""},
             {"name": "fails too", "if": "always()", "run": "exit 5"}]
    (tmp_path / "workflow.yml").write_text(
        "on: push\njobs:\n  one:\n    runs-on: ubuntu-latest\n    steps:\n"
        + "".join(f"      - {json.dumps(step)}\n" for step in steps))  # JSON: YAML's flow style
    status = workflow_steps.main([str(tmp_path / "workflow.yml")])
    assert status == 3  # the first failure's
    assert (tmp_path / "log").read_text().split() == ["ran", "always"]
    out = capsys.readouterr().out
    assert "skipped (a step before it failed): skipped" in out and "ok" in out
