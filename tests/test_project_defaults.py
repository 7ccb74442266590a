"""``[tool.clipcheck]`` in a project's pyproject.toml: defaults for ``clipcheck run`` / ``matrix`` /
``fuzz`` and ``harness.check``, the command line over them, bad keys and types refused with one line
(exit 2) before any rank starts, and the layers' order: flags > ``--matrix`` file > ``[tool.clipcheck]``
> the built-in defaults (docs/matrix.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import harness
from harness.commands import fuzz as fuzz_command
from harness.commands import launcher
from harness.commands import matrix as matrix_command
from harness.commands.options import spec_from_args
from harness.plan.project import ProjectDefaults, find_pyproject, project_defaults
from harness.errors import ClipcheckInputError
from harness_runs import harness_process

ROOT = Path(__file__).resolve().parents[1]

PROJECT = """\
[project]
name = "my-trainer"

[tool.clipcheck]
scenarios = ["dense_dp"]
targets = ["reference"]
worlds = [2, 4]
dtypes = ["fp32"]
norm_types = ["2"]
plans = "honest"
timeout = 45
"""


def project(tmp_path: Path, text: str = PROJECT) -> Path:
    (tmp_path / "pyproject.toml").write_text(text)
    return tmp_path


def clipcheck(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("NPROC_LIST", None)
    return harness_process([sys.executable, "-m", "harness", *args], env, timeout, cwd=cwd)


# -- reading the table ----------------------------------------------------------------------------------

def test_the_table_is_read_from_the_nearest_pyproject_and_checked_like_a_matrix_file(tmp_path):
    project(tmp_path)
    (tmp_path / "src" / "deep").mkdir(parents=True)
    assert find_pyproject(tmp_path / "src" / "deep") == tmp_path / "pyproject.toml"
    found = project_defaults(tmp_path / "src" / "deep")
    assert found.axes == {"scenarios": ("dense_dp",), "targets": ("reference",), "worlds": (2, 4),
                          "dtypes": ("fp32",), "norm_types": (2.0,), "plans": "honest"}
    assert found.timeout == 45.0 and found.worlds == (2, 4)
    assert str(tmp_path / "pyproject.toml") in str(found.source)


def test_a_pyproject_without_the_table_sets_nothing_and_is_the_boundary(tmp_path):
    project(tmp_path)
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert project_defaults(inner) == ProjectDefaults()  # the first pyproject.toml found decides


@pytest.mark.parametrize("table, message", [
    ("wolds = [2]", "unknown key(s) ['wolds']; known: ["),
    ('worlds = ["2"]', "worlds: expected an integer, got '2'"),
    ("worlds = 4", "worlds: expected a list, got int 4"),
    ('dtypes = "fp32"', "dtypes: expected a list"),
    ('timeout = "60"', "timeout must be a positive number of seconds"),
    ("timeout = 1e12", "timeout must be a positive number of seconds, at most 86400"),
    ('plans = "sometimes"', "plans must be one of all, honest"),
])
def test_a_bad_key_or_type_is_one_line_naming_the_file_and_the_key(tmp_path, table, message):
    project(tmp_path, f"[tool.clipcheck]\n{table}\n")
    with pytest.raises(ClipcheckInputError) as raised:
        project_defaults(tmp_path)
    text = str(raised.value)
    assert message in text and "pyproject.toml [tool.clipcheck]" in text and "\n" not in text


@pytest.mark.parametrize("command", [["run", "--nproc", "2"], ["matrix", "--out", "m"], ["fuzz", "--examples", "1"],
                                     ["--scenario", "dense_dp"]])
def test_every_command_refuses_a_bad_table_with_exit_2_before_any_rank_starts(tmp_path, command):
    project(tmp_path, '[tool.clipcheck]\nworlds = [2]\ntimout = 30\n')
    proc = clipcheck(command, tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown key(s) ['timout']" in lines[0], proc.stderr
    assert "cases on" not in proc.stdout and not (tmp_path / "m").exists()


def test_harness_check_refuses_a_bad_table_before_starting_a_world(tmp_path, monkeypatch):
    project(tmp_path, '[tool.clipcheck]\ndtypes = ["fp32"]\nseed = "zero"\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ClipcheckInputError, match=r"\[tool.clipcheck\]: seed: expected an integer"):
        harness.check("reference")


# -- defaults applied, the command line over them ---------------------------------------------------------

def parse(module, argv):
    return module.build_parser().parse_args(argv)


def test_run_takes_the_tables_axes_and_timeout_and_the_flags_win(tmp_path):
    defaults = project_defaults(project(tmp_path))
    args = parse(launcher, ["--nproc", "8"])
    spec = spec_from_args(args, defaults, project_keys_off=("worlds",))
    assert (spec.scenarios, spec.targets, spec.dtypes, spec.norm_types, spec.plans) == (
        ("dense_dp",), ("reference",), ("fp32",), (2.0,), "honest")
    assert spec.worlds == ()  # --nproc names the world: the table's worlds do not filter it out
    args = parse(launcher, ["--nproc", "2", "--dtype", "bf16", "--plans", "all", "--target", "torch"])
    spec = spec_from_args(args, defaults, project_keys_off=("worlds",))
    assert (spec.dtypes, spec.plans, spec.targets, spec.scenarios) == (("bf16",), "all", ("torch",), ("dense_dp",))


def test_the_matrix_takes_its_worlds_from_the_table_unless_given(tmp_path, monkeypatch):
    monkeypatch.delenv("NPROC_LIST", raising=False)
    defaults = project_defaults(project(tmp_path))
    args = parse(matrix_command, [])
    spec = matrix_command.matrix_spec(args, defaults)
    assert args.nproc_list == "2,4" and spec.worlds == (2, 4)
    assert spec.scenarios == ("dense_dp",) and spec.backends == ("gloo", "nccl")  # the rest: the default matrix
    args = parse(matrix_command, ["--nproc-list", "8"])
    spec = matrix_command.matrix_spec(args, defaults)
    assert args.nproc_list == "8" and spec.worlds == (1, 2, 4, 8)  # the default matrix's filter, not the table's
    args = parse(matrix_command, [])
    assert matrix_command.matrix_spec(args, ProjectDefaults()).scenarios[:2] == ("xorl_ep_lora", "deepspeed_autoep")
    assert args.nproc_list == "1,2,4,8"


def test_layers_flags_over_the_matrix_file_over_the_table_over_the_default_matrix(tmp_path, monkeypatch):
    monkeypatch.delenv("NPROC_LIST", raising=False)
    defaults = project_defaults(project(tmp_path))
    matrix_file = tmp_path / "nightly.toml"
    matrix_file.write_text('dtypes = ["bf16"]\nep_sizes = []\nseed = 7\n')
    args = parse(matrix_command, ["--matrix", str(matrix_file), "--seed", "9"])
    spec = matrix_command.matrix_spec(args, defaults)
    assert spec.seed == 9                       # flag over the file
    assert spec.dtypes == ("bf16",)             # file over the table
    assert spec.scenarios == ("dense_dp",)      # table
    assert spec.backends == ()                  # --matrix replaces the default matrix: no backend filter
    assert spec.ep_sizes is None
    # a file's `ep_sizes = []` ("every valid size") replaces the table's list, also in what launches read
    (tmp_path / "pyproject.toml").write_text(PROJECT + "ep_sizes = [2]\n")
    spec = matrix_command.matrix_spec(parse(matrix_command, ["--matrix", str(matrix_file)]), project_defaults(tmp_path))
    assert spec.ep_sizes is None and spec.to_mapping()["ep_sizes"] == []


def test_fuzz_takes_targets_the_largest_world_plans_and_timeout(tmp_path):
    defaults = project_defaults(project(tmp_path))
    args = parse(fuzz_command, [])
    assert fuzz_command.apply_project_defaults(args, defaults) == ["reference"]
    assert (args.world, args.plans, args.timeout) == (4, "honest", 45.0)
    args = parse(fuzz_command, ["--target", "torch", "--world", "2", "--plans", "all", "--timeout", "5"])
    assert fuzz_command.apply_project_defaults(args, defaults) == ["torch"]
    assert (args.world, args.plans, args.timeout) == (2, "all", 5.0)
    args = parse(fuzz_command, [])
    with pytest.raises(ClipcheckInputError, match="--target is required"):
        fuzz_command.apply_project_defaults(args, ProjectDefaults())
    args = parse(fuzz_command, ["--target", "reference"])
    fuzz_command.apply_project_defaults(args, ProjectDefaults())
    assert (args.world, args.plans, args.timeout) == (4, "all", 30.0)


@pytest.mark.distributed
def test_clipcheck_run_applies_the_table_and_a_flag_overrides_it(tmp_path):
    project(tmp_path, PROJECT.replace('norm_types = ["2"]', 'norm_types = ["2"]\nvariant = "dp=2 replicated"'))
    proc = clipcheck(["run", "--nproc", "2", "--json", "r.jsonl"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cases = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    cases = [c for c in cases if c["type"] == "case"]
    assert cases and {(c["scenario"], c["target"], c["dtype"], c["norm"]) for c in cases} == {
        ("dense_dp", "reference", "fp32", "L2")}
    proc = clipcheck(["run", "--nproc", "2", "--dtype", "bf16", "--json", "r.jsonl"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dtypes = {json.loads(line).get("dtype") for line in (tmp_path / "r.jsonl").read_text().splitlines()}
    assert dtypes - {None} == {"bf16"}


def test_harness_check_takes_the_tables_worlds_and_an_argument_wins(tmp_path, monkeypatch):
    """Seen without starting a world: nccl on a machine without CUDA makes every world unrunnable, and
    the one-line refusal names the worlds the call would have run."""
    monkeypatch.setattr("harness.api.default_backend", lambda: "nccl")
    monkeypatch.setattr("harness.run.world.devices.cuda_device_count", lambda: 0)
    project(tmp_path, PROJECT.replace("worlds = [2, 4]", "worlds = [3, 5]"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ClipcheckInputError, match=r"nothing to run; world 3 nccl: .*; world 5 nccl: "):
        harness.check("reference")
    with pytest.raises(ClipcheckInputError, match=r"nothing to run; world 6 nccl: [^;]*$"):
        harness.check("reference", worlds=[6])
