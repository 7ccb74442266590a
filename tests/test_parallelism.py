"""Choosing what applies: every layout's canonical kinds of parallelism, and the selection by kind
(``parallelism``), by label (``variant``, ``exclude``, as lists) through every door a matrix comes in
by: flags, a matrix file, ``[tool.clipcheck]``, ``harness.check``, a torchrun rank and the launchers."""

from __future__ import annotations

import pytest

import harness
from harness.cases.axes import MeshAxis
from harness.cases.layout import Layout, MeshSpec, Shard, param
from harness.cases.matrix import MatrixSpec, load_matrix, spec_from_mapping
from harness.cases.parallelism import DATA_AXES, KINDS, NAMED_AXES, UNCLASSIFIED_AXES, parallelism_of
from harness.cases.scenario import ScenarioOptions
from harness.commands.launcher import build_parser as run_parser
from harness.commands.main import main
from harness.commands.options import spec_from_args
from harness.errors import ClipcheckInputError, UsageError
from harness.plan.planner import plan_cases
from harness.plan.project import project_defaults
from harness.plan.selection import Emptied, emptied_across_worlds, label_matches
from harness.targets.builtin_scenarios import scenarios_package
from harness_runs import run_cli, run_clipcheck

ONE_BOUND = {"targets": ("reference",), "dtypes": ("fp32",), "norm_types": (2.0,), "clip_ratios": (0.5,)}


def layout(*axes: tuple[str, int], **placements: Shard) -> Layout:
    """Two parameters on a mesh of ``axes``: ``w`` placed by ``placements`` (axis=Shard(dim)), ``b`` replicated."""
    return Layout(MeshSpec(axes), (param("w", (8, 8), **placements), param("b", (8,))))


# -- the kinds of a layout ---------------------------------------------------------------------------------

def test_every_mesh_axis_has_exactly_one_rule():
    rules = [set(NAMED_AXES), set(DATA_AXES), set(UNCLASSIFIED_AXES)]
    for axis in MeshAxis:
        assert sum(axis in rule for rule in rules) == 1, axis
    assert set(NAMED_AXES.values()) <= set(KINDS)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_built_in_layout_gets_kinds_from_the_canonical_set(world):
    seen = set()
    for scenario in scenarios_package().SCENARIOS:
        for variant in scenario().variants(world, ScenarioOptions()):
            found = parallelism_of(variant.layout)
            assert found.kinds <= set(KINDS) and not found.unknown, (scenario.name, variant.label, found)
            if world == 1:
                assert found.kinds == frozenset(), (scenario.name, variant.label)
            seen |= found.kinds
    if world == 4:  # every kind is some built-in layout's at world 4
        assert seen == set(KINDS)


@pytest.mark.parametrize("built, kinds", [
    (layout(("dp", 4)), {"ddp"}),
    (layout(("dp", 4), dp=Shard(0)), {"fsdp"}),
    (layout(("ep", 2), ("ep_fsdp", 2), ep=Shard(0), ep_fsdp=Shard(1)), {"fsdp", "ep"}),
    (layout(("ep", 2), ("efsdp", 2), ep=Shard(0), efsdp=Shard(0)), {"fsdp", "ep"}),
    (layout(("edp", 2), ("ep", 2)), {"ddp", "ep"}),
    (layout(("dp_replicate", 2), ("dp_shard", 2), dp_shard=Shard(0)), {"hsdp"}),
    (layout(("dp", 2), ("dp_shard_cp", 2), dp_shard_cp=Shard(0)), {"hsdp"}),  # replicate x shard, by any name
    (layout(("dp_replicate", 2), ("dp_shard", 1), dp_shard=Shard(0)), {"ddp"}),  # a size-1 axis counts for nothing
    (layout(("pp", 2), ("dp", 2), dp=Shard(1)), {"pp", "fsdp"}),
    (layout(("dp_shard", 2), ("cp", 2), dp_shard=Shard(0)), {"fsdp", "cp"}),
    (layout(("tp", 2), ("ep", 1), tp=Shard(1)), {"tp"}),
    (layout(("dp", 1), ("tp", 1)), set()),
])
def test_the_kinds_of_a_layout(built, kinds):
    assert parallelism_of(built).kinds == kinds


def test_an_axis_of_a_users_own_scenario_is_unknown_and_kept_only_without_a_selection():
    found = parallelism_of(layout(("expert", 2), ("dp", 2), dp=Shard(0)))
    assert found.kinds == {"fsdp"} and found.unknown == ("expert",) and found.label == "fsdp+?expert"
    assert not found.within(KINDS)
    measured = parallelism_of(layout((MeshAxis.WORLD.value, 4)))
    assert measured.unknown == ("world",) and not measured.within(KINDS)


USER_SCENARIO = """
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, Shard, param
from harness.cases.scenario import Scenario
from harness.cases.variant import Variant, declared_from_layout


class Experts(Scenario):
    name = "my_experts"
    summary = "a mesh axis named as no framework of the harness names it"

    def variants(self, world_size, options):
        layout = Layout(MeshSpec((("expert", world_size),)), (param("w", (8, 4), expert=Shard(0)),))
        return [Variant(label=f"expert={world_size}", layout=layout,
                        injection=Injection(seed=options.seed, dtype=options.dtype),
                        declared=declared_from_layout(layout))]
"""


def test_a_users_axis_of_no_kind_plans_without_a_selection_and_is_named_by_one(tmp_path, capsys):
    path = tmp_path / "my_scenario.py"
    path.write_text(USER_SCENARIO)
    spec = MatrixSpec(scenarios=(f"{path}:Experts",), **ONE_BOUND)
    assert [c.variant.label for c in plan_cases(spec, 2, "gloo").cases] == ["expert=2"]
    with pytest.raises(UsageError, match=r"parallelism ep leaves no layout of .*my_scenario.py:Experts "
                                         r"\(their kinds: \?expert\)"):
        plan_cases(spec.merged({"parallelism": ("ep",)}), 2, "gloo")
    assert main(["layouts", "--scenario", f"{path}:Experts", "--nproc", "2"]) == 0
    assert "  expert=2  [?expert]  mesh expert=2" in capsys.readouterr().out


# -- the selection ---------------------------------------------------------------------------------------

def test_a_parallelism_selection_keeps_only_the_layouts_within_it():
    spec = MatrixSpec(scenarios=("xorl_ep_lora", "dense_dp", "hsdp_cp", "megatron_moe_tp"), **ONE_BOUND)
    every = plan_cases(spec, 4, "gloo")
    kept = plan_cases(spec.merged({"parallelism": ("ep", "fsdp")}), 4, "gloo")
    assert 0 < len(kept.cases) < len(every.cases)
    assert all(parallelism_of(c.layout).kinds <= {"ep", "fsdp"} for c in kept.cases)
    left_out = [c for c in every.cases if not parallelism_of(c.layout).kinds <= {"ep", "fsdp"}]
    assert len(kept.cases) == len(every.cases) - len(left_out)
    assert {parallelism_of(c.layout).label for c in left_out} >= {"hsdp", "ddp", "tp"}


def test_exclude_and_variant_lists_match_labels_as_variant_does():
    assert label_matches("dp=2 fsdp nan on last rank", "nan") and label_matches("dp=2 fsdp", "dp=? fsdp")
    assert label_matches("dp=2 fsdp", "=dp=2 fsdp") and not label_matches("dp=2 fsdp nan", "=dp=2 fsdp")
    spec = MatrixSpec(scenarios=("dense_dp",), **ONE_BOUND)
    labels = {c.variant.label for c in plan_cases(spec, 2, "gloo").cases}
    excluded = {c.variant.label for c in plan_cases(spec.merged({"exclude": ("nan", "inf")}), 2, "gloo").cases}
    assert excluded == {label for label in labels if "nan" not in label and "inf" not in label}
    either = {c.variant.label for c in plan_cases(spec.merged({"variant": ("replicated", "=dp=2 fsdp")}), 2,
                                                  "gloo").cases}
    assert either == {"dp=2 replicated", "dp=2 fsdp"}
    both = plan_cases(spec.merged({"variant": ("fsdp",), "exclude": ("=dp=2 fsdp",)}), 2, "gloo")
    assert "dp=2 fsdp" not in {c.variant.label for c in both.cases} and both.cases


def test_repeated_flags_accumulate_and_replace_the_files_lists(tmp_path):
    matrix = tmp_path / "m.toml"
    matrix.write_text('variant = ["fsdp"]\nexclude = "nan"\nparallelism = ["fsdp"]\n')
    args = run_parser().parse_args(["--matrix", str(matrix), "--variant", "a, b", "--variant", "c",
                                    "--parallelism", "ep,fsdp"])
    spec = spec_from_args(args)
    assert spec.variant == ("a, b", "c") and spec.exclude == ("nan",) and spec.parallelism == ("ep", "fsdp")
    assert load_matrix(str(matrix)).variant == ("fsdp",)
    assert spec_from_mapping(spec.to_mapping()) == spec  # what a launcher hands its launches


def test_lists_in_tool_clipcheck(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.clipcheck]\nvariant = ["replicated", "fsdp"]\nexclude = ["nan"]\nparallelism = ["ddp", "fsdp"]\n')
    axes = project_defaults(tmp_path).axes
    assert axes["variant"] == ("replicated", "fsdp") and axes["exclude"] == ("nan",)
    assert axes["parallelism"] == ("ddp", "fsdp")
    (tmp_path / "pyproject.toml").write_text('[tool.clipcheck]\nvariant = "replicated"\n')
    assert project_defaults(tmp_path).axes["variant"] == ("replicated",)  # a string is a list of one
    (tmp_path / "pyproject.toml").write_text('[tool.clipcheck]\nexclude = [1]\n')
    with pytest.raises(ClipcheckInputError, match=r"\[tool.clipcheck\]: exclude: expected a string"):
        project_defaults(tmp_path)


def test_a_named_scenario_the_selection_empties_is_said_once():
    spec = MatrixSpec(scenarios=("dense_dp", "torchtune_tp"), parallelism=("ddp",), **ONE_BOUND)
    plan = plan_cases(spec, 2, "gloo")
    assert {c.scenario for c in plan.cases} == {"dense_dp"}
    said = [line for line in plan.header_lines() if "torchtune_tp" in line]
    assert said == ["scenario torchtune_tp: parallelism ddp leaves none of its layouts at world 2 "
                    "(their kinds: fsdp, tp)"]
    excluded = plan_cases(MatrixSpec(scenarios=("dense_dp", "torchtune_tp"), exclude=("tp",), **ONE_BOUND), 2, "gloo")
    assert any(line.startswith("scenario torchtune_tp: exclude 'tp' leaves none") for line in excluded.header_lines())
    everything = plan_cases(MatrixSpec(parallelism=("ddp",), **ONE_BOUND), 2, "gloo")  # none named: no line
    assert not any(line.startswith("scenario ") for line in everything.header_lines())


def test_a_selection_that_leaves_nothing_is_one_usage_error_naming_it():
    with pytest.raises(UsageError, match=r"no valid cases at world size 2: parallelism tp leaves no layout of "
                                         r"dense_dp \(their kinds: ddp, fsdp\)"):
        plan_cases(MatrixSpec(scenarios=("dense_dp",), parallelism=("tp",), **ONE_BOUND), 2, "gloo")
    with pytest.raises(UsageError, match="unknown parallelism kind 'zero' \\(valid: ddp, fsdp, hsdp, ep, tp, pp, cp\\)"):
        plan_cases(MatrixSpec(scenarios=("dense_dp",), parallelism=("zero",), **ONE_BOUND), 2, "gloo")


def test_a_matrix_says_each_emptied_scenario_once_over_its_worlds():
    lines = emptied_across_worlds([Emptied("a", 2, "parallelism ep", ("ddp",)), Emptied("a", 4, "parallelism ep", ("tp",)),
                                   Emptied("b", 2, "parallelism ep", named=False)])
    assert lines == ["scenario a: parallelism ep leaves none of its layouts at world 2, 4 (their kinds: ddp, tp)"]


# -- every door ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--parallelism", "zero"], "unknown parallelism kind 'zero' (valid: ddp, fsdp, hsdp, ep, tp, pp, cp)"),
    (["--scenario", "dense_dp", "--parallelism", "ep"], "parallelism ep leaves no layout of dense_dp"),
    (["--scenario", "dense_dp", "--exclude", "dp"], "exclude 'dp' leaves no layout of dense_dp"),
])
def test_a_torchrun_rank_refuses_a_bad_or_empty_selection_in_one_line(args, message, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("command", [["run", "--nproc", "2"], ["matrix", "--nproc-list", "1,2"]])
def test_the_launchers_refuse_a_bad_kind_before_any_process_starts(command, tmp_path):
    proc = run_cli([*command, "--scenario", "dense_dp", "--parallelism", "ddp,zero", *(
        ["--out", str(tmp_path)] if command[0] == "matrix" else [])])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "unknown parallelism kind 'zero' (valid: ddp, fsdp, hsdp, ep, tp, pp, cp)" in proc.stderr
    assert "launch:" not in proc.stdout and not list(tmp_path.glob("*.log"))


def test_harness_check_takes_parallelism_and_exclude_before_any_rank_starts():
    with pytest.raises(ClipcheckInputError, match="parallelism tp leaves no layout of dense_dp"):
        harness.check("reference", scenarios=["dense_dp"], worlds=[2], parallelism=["tp"])
    with pytest.raises(ClipcheckInputError, match="exclude 'dp=2' leaves no layout of dense_dp"):
        harness.check("reference", scenarios=["dense_dp"], worlds=[2], exclude="dp=2")
    with pytest.raises(ClipcheckInputError, match="unknown parallelism kind 'zero'"):
        harness.check("reference", scenarios=["dense_dp"], worlds=[2], parallelism=["zero"])


def test_a_run_launch_runs_only_the_kept_layouts(tmp_path):
    run = run_clipcheck(2, ["--scenario", "dense_dp,torchtune_tp", "--target", "reference", "--dtype", "fp32",
                            "--norm-type", "2", "--clip-ratio", "0.5", "--parallelism", "ddp"], tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert {(c["scenario"], c["layout"]) for c in run.cases()} == {("dense_dp", "dp=2 replicated"),
                                                                   ("dense_dp", "dp=2 stage on rank 0")}
    assert "scenario torchtune_tp: parallelism ddp leaves none of its layouts at world 2" in run.stdout
