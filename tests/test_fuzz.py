"""Fuzzing: the strategies draw valid cases, the reference survives the budget every mutant is found
within (tests/test_catalogue.py), failures shrink to a minimal case, and the replay blob reproduces it."""

import json
import math

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings

from harness.fuzz import FuzzReport, describe, fuzz, fuzz_record
from harness.cases.injection import local_grad
from harness.cases.layout import box_contains, unravel
from harness.targets.mutants.catalogue import FUZZ_BUDGET, FUZZ_WORLD
from harness.cases.blob import decode, encode
from harness.strategies import drawn_cases
from harness_runs import run_cli

# every mutant is found within its recorded bound at this budget: tests/test_catalogue.py
BUDGET = FUZZ_BUDGET
WORLD = FUZZ_WORLD


@settings(max_examples=60, deadline=None)
@given(drawn_cases(world_size=WORLD))
def test_drawn_cases_are_valid_and_round_trip_through_a_blob(drawn):
    layout = drawn.variant.layout
    layout.check_world(WORLD)
    assert drawn.max_norm > 0
    for spec in layout.trainable:
        for rank in range(WORLD):
            box = layout.local_box(spec, rank)
            if box is not None:
                assert math.prod(b - a for a, b in box) >= 4  # no 1-element slices that could collide
    again, target = decode(encode(drawn, "reference"))
    assert target == "reference"
    assert again.variant.layout == layout and again.variant.injection == drawn.variant.injection
    assert dict(again.variant.declared) == dict(drawn.variant.declared)
    assert again.variant.dtensor == drawn.variant.dtensor
    assert (again.norm_type, again.max_norm, again.world_size) == (drawn.norm_type, drawn.max_norm, WORLD)
    for spec in layout.trainable:
        for rank in range(WORLD):
            a = local_grad(layout, drawn.variant.injection, spec, rank)
            b = local_grad(again.variant.layout, again.variant.injection, again.variant.layout.param(spec.name), rank)
            assert (a is None) == (b is None)


def _derandomized_draws(strategy, world_size):
    drawn = []

    @settings(max_examples=40, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        drawn.append(case)

    collect()
    return drawn


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_reused_strategy_objects_draw_what_fresh_ones_draw(monkeypatch, world_size):
    """The strategies keep one object per distinct arguments (harness.strategies._reused, for speed):
    built afresh on every call instead, a derandomized run draws exactly the same cases."""
    import harness.strategies as strategies

    reused = _derandomized_draws(strategies.drawn_cases(world_size), world_size)
    for name in ("meshes", "stage_ranks", "_stages", "param_specs", "layouts", "_integers", "_subsets"):
        monkeypatch.setattr(strategies, name, getattr(strategies, name).__wrapped__)
    fresh = _derandomized_draws(strategies.drawn_cases.__wrapped__(world_size), world_size)
    assert len(fresh) == len(reused) == 40

    def drawn(d):
        return d.variant.layout, d.variant.injection, dict(d.variant.declared), d.norm_type, d.max_norm

    assert [drawn(d) for d in fresh] == [drawn(d) for d in reused]


def test_strategies_still_take_unhashable_arguments():
    """A caller's list (not a tuple) of parameter kinds gets a fresh strategy instead of a TypeError
    from the cache of reused ones."""
    from harness.cases.layout import MeshSpec
    from harness.strategies import param_specs

    from harness.cases.model_names import NAMES

    spec = find(param_specs(MeshSpec.of(fsdp=1, ep=2, tp=1), 0, 2, None, ["dense"]), lambda p: True)
    assert spec.name in {name.format(i=0) for group in NAMES["dense"] for name in group}


@pytest.mark.parametrize("group", ["biases", "norms", "router", "embeddings", "output_head", "lora_factors",
                                   "shared_experts"])
def test_a_clip_that_miscounts_one_named_group_is_found(world4, group):
    """A clip that miscounts one group it picks by name is found within the fuzzer's budget: drawn
    parameters carry real models' names (named dense0, experts0, ..., a clip counting every bias twice would
    pass every example)."""
    report = fuzz(f"tests/broken_targets.py:double_counts_{group}", world4, FUZZ_BUDGET, seed=0, shrink=False,
                  blame=False)
    assert not report.passed, f"{group}: {report.examples} examples passed"


@pytest.mark.parametrize("target", ["coefficient_in_bf16", "int_norm_type", "total_in_gradient_dtype"])
def test_the_default_draws_reach_a_coefficient_rounded_to_bf16_and_a_non_integer_norm(world4, target):
    """Three clips the power-of-two bounds, the integer norm types and totals that fit their dtype let through:
    a coefficient held in bf16 is exact at 0.5 x the norm and 0.26% off at 0.3 x; int(p) is p for every integer
    p; a total held in the gradient dtype is a rounding until fp16 gradients whose norms fit one by one add up
    past 65504. The drawn bounds include 0.3, the drawn norm types 1.5, the drawn scales fp16's edge."""
    report = fuzz(f"tests/broken_targets.py:{target}", world4, FUZZ_BUDGET, seed=0, shrink=False, blame=False)
    assert not report.passed, f"{target}: {report.examples} examples passed"


def _lies(variant):
    return any(p != variant.layout.param(name).placement(axis)
               for name, axes in variant.declared.items() for axis, p in axes.items())


def _nan_away_from_rank_zero(drawn):
    layout, injection = drawn.variant.layout, drawn.variant.injection
    for name, flat, kind in injection.nonfinite:
        box = layout.local_box(layout.param(name), 0)
        if kind == "nan" and (box is None or not box_contains(box, unravel(flat, layout.param(name).shape))):
            return math.isinf(drawn.norm_type)
    return False


@pytest.mark.parametrize("wanted", [
    lambda d: d.variant.dtensor and _lies(d.variant),          # DTensors placed as a lying plan says
    lambda d: d.variant.dtensor and not _lies(d.variant),      # ... and as an honest one
    _nan_away_from_rank_zero,                                   # where gloo's float MAX drops a NaN
    lambda d: d.variant.layout.mesh.has("pp") and any(         # a weight tied across pipeline stages
        s.present_ranks is not None and len(s.present_ranks) > d.variant.layout.mesh.world_size
        // d.variant.layout.mesh.size("pp") for s in d.variant.layout),
], ids=["dtensor-lying", "dtensor-honest", "nan-away-from-rank-0", "tied-stages"])
def test_the_strategies_reach_what_the_fixed_scenarios_reach(wanted):
    found = find(drawn_cases(world_size=WORLD), wanted, settings=settings(max_examples=2000, deadline=None,
                                                                          database=None))
    assert wanted(found)


def test_a_dtensor_minimal_case_reads_on_its_own(world4):
    report = fuzz("mutant-dtensor-copy-scaled", world4, BUDGET, derandomize=True)
    assert not report.passed and report.minimal.variant.dtensor
    text = report.describe()
    assert "DTensor parameters placed as declared" in text and "coefficient: " in text


def test_reference_survives_the_budget(world4):
    """The reference passes the whole budget, and the warm world's ranks hold few process groups after it:
    fuzzing draws a new layout, so a new mesh, for most examples, and a generation holding more than
    GROUP_BUDGET groups is renewed before the next layout (without that, groups pile up in every rank, each
    with three threads, one waking every few ms: docs/performance.md, "Figures cited by the code");
    every gloo group alive in a rank is one of its current generation's (tests/test_group_lifetime.py)."""
    from harness.run.world.dist_world import GROUP_BUDGET
    from harness_runs import gloo_groups_held

    report = fuzz("reference", world4, BUDGET, derandomize=True, shrink=False)
    assert report.passed and report.examples == BUDGET, report.describe()
    for result in world4.run(gloo_groups_held):
        alive, loops = result.value
        assert alive <= GROUP_BUDGET + 16, result  # at most one layout's groups past the budget
        assert loops <= alive, result


def test_a_failure_is_shrunk_and_its_replay_reproduces_it(world4, tmp_path):
    report = fuzz("mutant-local-root-mean", world4, BUDGET, derandomize=True)
    assert not report.passed and report.shrink_steps > 0
    minimal = report.minimal.variant.layout
    assert len(minimal.params) == 1  # one parameter is enough to show a root taken before the mean
    assert any("mean of the rank-local norms" in s for s in report.result.signature)
    text = report.describe()
    with pytest.deprecated_call():  # the old module function: the same lines
        assert describe(report) == text.split("\n")
    assert report.record() == fuzz_record(report, report.backend) and report.record()["replay"] == report.replay
    assert "replay: " in text and " -m harness --replay cc1." in text
    # the minimal case reads on its own: its injection in words, and the weight given to its one group
    assert "  gradients: seed " in text
    (group,) = report.result.blame
    assert group.group == minimal.params[0].name and group.weight is not None and group.weight < 1
    assert f"blame: {group.group}: counted" in text

    blob = report.replay.split("--replay ", 1)[1]
    proc = run_cli(["--replay", blob, "--json", str(tmp_path / "replay.jsonl")])
    assert proc.returncode == 1, proc.stderr
    assert "mutant-local-root-mean" in proc.stdout and "FAIL" in proc.stdout


def test_fuzz_command_line(tmp_path):
    found = run_cli(["fuzz", "--target", "mutant-inf-norm-summed", "--examples", str(FUZZ_BUDGET), "--world", "2",
                     "--seed", "3", "--no-shrink"])
    assert found.returncode == 1 and "FAIL (first failure at example" in found.stdout
    assert "replay: " in found.stdout
    bad = run_cli(["fuzz", "--target", "nope"])
    assert bad.returncode == 2 and "unknown target 'nope'" in bad.stderr


def test_fuzz_writes_one_json_record_per_target(tmp_path):
    out = tmp_path / "fuzz.jsonl"
    proc = run_cli(["fuzz", "--target", "mutant-scales-up,reference", "--examples", "30", "--world", "2",
                    "--seed", "1", "--json", str(out)])
    assert proc.returncode == 1, proc.stderr
    found, survived = [json.loads(line) for line in out.read_text().splitlines()]
    assert found["type"] == "fuzz" and found["target"] == "mutant-scales-up" and not found["passed"]
    assert found["minimal"][0].startswith("minimal case: mesh ") and found["replay"].count("--replay cc1.") == 1
    assert found["result"]["verdict"] == "FAIL" and not found["result"]["checks"]["coefficient"]["passed"]
    assert survived["target"] == "reference" and survived["passed"] and survived["examples"] == 30
    assert survived["result"] is None and survived["minimal"] == []
    bad = run_cli(["fuzz", "--target", "reference", "--json", str(tmp_path / "no" / "such.jsonl")])
    assert bad.returncode == 2 and "--json" in bad.stderr and "no such directory" in bad.stderr


def test_a_stateful_target_is_a_fail_with_its_record_and_the_next_target_is_fuzzed(tmp_path):
    out = tmp_path / "fuzz.jsonl"
    proc = run_cli(["fuzz", "--target", "tests/broken_targets.py:reports_the_previous_norm,reference",
                    "--examples", "30", "--world", "2", "--seed", "0", "--json", str(out)])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    stateful, survived = [json.loads(line) for line in out.read_text().splitlines()]
    assert not stateful["passed"] and stateful["failed_at"] is not None and stateful["crash"] is None
    assert "keeps state between calls" in stateful["flaky"] and "keeps state between calls" in proc.stdout
    assert stateful["result"]["verdict"] == "FAIL" and not stateful["result"]["checks"]["norm"]["passed"]
    assert survived["target"] == "reference" and survived["passed"] and survived["examples"] == 30


def test_a_bad_blob_is_a_clean_error():
    proc = run_cli(["--replay", "cc1.not-a-blob"])
    assert proc.returncode == 2 and "not a replay blob" in proc.stderr and "Traceback" not in proc.stderr


def test_a_fuzz_report_describes_itself_and_gives_its_record():
    """``FuzzReport`` reads as ``CheckReport`` and ``AuditReport``: ``describe()`` is a string (the old module
    function ``describe(report)``, deprecated, gives its lines), ``record()`` the ``--json`` record."""
    report = FuzzReport("reference", 2, 10, 2.0, backend="gloo")
    assert report.describe() == "reference on 2 rank(s): 10 examples in 2.0 s (5.0/s): PASS"
    with pytest.deprecated_call():
        assert describe(report) == [report.describe()]
    record = report.record()
    assert record["type"] == "fuzz" and record["passed"] and record["backend"] == "gloo"
    assert fuzz_record(report, "nccl")["backend"] == "nccl" and report.backend == "gloo"
