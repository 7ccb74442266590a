"""The matrix: spec files, expansion with counted drop reasons, JUnit output, and the multi-world
launcher (planned before anything starts, merged after)."""

import json
import xml.etree.ElementTree as ET

import pytest

from harness.report.junit import junit_xml
from harness.cases.layout import LayoutError
from harness.cases.matrix import MatrixSpec, load_matrix, spec_from_mapping
from harness.errors import UsageError
from harness.plan.planner import plan_cases
from harness_runs import run_cli


def test_matrix_files_toml_and_json(tmp_path):
    toml = tmp_path / "m.toml"
    toml.write_text('scenarios = ["dense_dp"]\nworlds = [2, 4]\nnorm_types = ["2", "inf"]\ndtypes = ["bf16"]\n')
    spec = load_matrix(str(toml))
    assert spec.scenarios == ("dense_dp",) and spec.worlds == (2, 4) and spec.dtypes == ("bf16",)
    assert spec.norm_types == (2.0, float("inf"))
    js = tmp_path / "m.json"
    js.write_text(json.dumps({"targets": ["reference"], "ep_sizes": [1, 2]}))
    assert load_matrix(str(js)) == MatrixSpec(targets=("reference",), ep_sizes=(1, 2))


@pytest.mark.parametrize("raw, message", [
    ({"scenario": ["x"]}, "unknown key"),
    ({"worlds": ["two"]}, "worlds: expected an integer"),
    ({"backends": ["mpi"]}, "unknown backend 'mpi'"),
    ({"norm_types": ["-1"]}, "norm type must be positive"),
])
def test_bad_matrix_values(raw, message):
    with pytest.raises(LayoutError, match=message):
        spec_from_mapping(raw)


def test_invalid_combinations_are_dropped_and_counted():
    spec = MatrixSpec(
        scenarios=("xorl_ep_lora", "deepspeed_autoep", "dense_dp"),
        targets=("reference", "xorl-style", "torch-dtensor"),
        ep_sizes=(2, 3, 4),
    )
    plan = plan_cases(spec, world_size=4, backend="gloo")
    dropped = dict(plan.dropped)
    assert dropped["xorl_ep_lora: ep_size 3 does not divide the world size 4"] == len(spec.dtypes)
    assert dropped["target xorl-style runs with xorl_ep_lora, not deepspeed_autoep"] == 1
    assert any(r.startswith("target torch-dtensor needs every parameter on every rank") for r in dropped)
    lines = plan.drop_lines()
    assert lines[0] == f"dropped {sum(dropped.values())} invalid combination(s):"
    eps = {c.variant.ep_size for c in plan.cases if c.scenario != "dense_dp"}
    assert eps == {2, 4}
    assert "ep_size does not apply to dense_dp (no expert parallelism)" in plan.notes


def test_world_and_backend_axes_filter_a_launch():
    spec = MatrixSpec(scenarios=("dense_dp",), worlds=(2, 4), backends=("nccl",))
    with pytest.raises(UsageError, match="world size 3 is not in the matrix"):
        plan_cases(spec, 3, "nccl")
    with pytest.raises(UsageError, match="backend gloo is not in the matrix"):
        plan_cases(spec, 2, "gloo")
    assert plan_cases(spec, 2, "nccl").cases


def test_junit_counts_failures_and_errors():
    case = {"type": "case", "world_size": 2, "backend": "gloo", "scenario": "s", "layout": "dp=2", "target": "t",
            "norm_type": 2.0, "norm": "L2", "dtype": "fp32", "seconds": 0.01, "reported": [1.0], "true_norm": 2.0,
            "ratio": 0.5,
            "signature": ["0.500000 = 1/sqrt(4): ..."], "verdict": "FAIL",
            "checks": {"norm": {"passed": False, "detail": "off"}, "agree": {"passed": True, "detail": ""}}}
    error = dict(case, verdict="ERROR", target="u")
    good = dict(case, verdict="PASS", target="v", checks={"norm": {"passed": True, "detail": ""}})
    meta = {"type": "metamorphic", "world_size": 2, "backend": "gloo", "scenario": "s", "target": "t", "norm": "L2",
            "dtype": "fp32", "invariance_key": "k", "coefficients": {"a": 0.1, "b": 0.2}, "gap": 0.1, "passed": False}
    root = ET.fromstring(junit_xml([case, error, good, meta]).split("\n", 1)[1])
    suite = root.find("testsuite")
    assert suite.get("tests") == "4" and suite.get("failures") == "2" and suite.get("errors") == "1"
    names = [tc.get("name") for tc in suite.iter("testcase")]
    assert names[0] == "s [dp=2] t L2 fp32"
    assert suite.find("testcase/failure").get("message") == "norm"


def test_launcher_rejects_bad_input_before_launching(tmp_path):
    proc = run_cli(["matrix", "--nproc-list", "4", "--scenario", "xorl_ep_lora", "--ep-size", "3",
                    "--out", str(tmp_path)])
    assert proc.returncode == 2 and "ep_size 3 does not divide the world size 4" in proc.stdout + proc.stderr
    assert "launch:" not in proc.stdout and not list(tmp_path.glob("*.log"))


def test_launcher_runs_each_world_and_merges(tmp_path):
    proc = run_cli(["matrix", "--nproc-list", "1,2", "--scenario", "dense_dp", "--target", "reference,torch",
                    "--out", str(tmp_path)], timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # torch (rank-local) fails the sharded layouts
    merged = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    cases = [r for r in merged if r["type"] == "case"]
    assert {r["world_size"] for r in cases} == {1, 2}
    assert all(r["verdict"] == "PASS" for r in cases if r["target"] == "reference" or r["world_size"] == 1)
    assert any(r["verdict"] == "FAIL" for r in cases if r["target"] == "torch" and r["world_size"] == 2)
    suites = ET.parse(tmp_path / "junit.xml").getroot().findall("testsuite")
    assert len(suites) == 2
    assert "matrix: 2 launches" in proc.stdout and "=> FAIL" in proc.stdout

    passing = run_cli(["matrix", "--nproc-list", "2", "--scenario", "dense_dp", "--targets", "reference",
                       "--out", str(tmp_path / "ok")], timeout=300)
    assert passing.returncode == 0 and "=> PASS" in passing.stdout


SYNTHETIC_SCENARIOS = ("deepspeed_autoep", "torchtitan_ep", "veomni_ep", "automodel_ep")


@pytest.mark.parametrize("scenario", SYNTHETIC_SCENARIOS)
def test_synthetic_layouts_are_opt_in_for_user_targets_and_adapters(scenario):
    """A user's clip runs the synthetic layouts (no trainer reaches them) only with --synthetic, so their
    FAILs cannot count toward exit 1; the harness's own targets keep running them: they are its regressions."""
    user = "tests/correct_targets.py:torch_primitives"
    spec = MatrixSpec(scenarios=(scenario,), targets=("reference", user), dtypes=("fp32",))

    def synthetic_cases(plan):
        return {t: sum(1 for c in plan.cases if c.target == t and c.variant.synthetic is not None)
                for t in ("reference", user)}

    default = plan_cases(spec, 4, "gloo")
    assert synthetic_cases(default)[user] == 0 and synthetic_cases(default)["reference"] > 0
    assert any("synthetic layouts of" in reason and user in reason for reason in default.dropped)
    asked = plan_cases(spec.merged({"synthetic": True}), 4, "gloo")
    assert synthetic_cases(asked)[user] == synthetic_cases(asked)["reference"] > 0
