"""The bug catalogue: every §6 row is a mechanism, reproduced elsewhere, or out of scope with a reason;
every mutant is one mechanism; each fails its fixed scenario and the fuzzer finds it within its
recorded bound, with the signature that names its factor where one exists."""

import pytest

from harness.commands.catalogue import run_mechanism
from harness.targets.mutants import MUTANTS
from harness.targets.mutants.catalogue import (BUG_ROWS, CATALOGUE, FUZZ_BUDGET, FUZZ_WORLD, OUT_OF_SCOPE,
                                                REPRODUCED_ELSEWHERE)
from harness.targets.registry import builtin_scenarios
from harness_runs import run_cli

# the phrase the judge must show for mechanisms whose factor belongs to one mesh axis (it names that axis)
AXIS_SIGNATURES = {
    "mutant-stage-local-norm": "each pp coordinate reports its own norm",
    "mutant-pp-max-reduce": "norms merged with MAX over pp",
    "mutant-tied-counted-twice": "pp replicas summed",
    "mutant-cp-replicas-summed": "cp replicas summed",
    "mutant-hsdp-replicas-summed": "dp_replicate replicas summed",
    "mutant-tp-replicas-summed": "tp replicas summed",
    "mutant-missing-ep-reduction": "no reduction over ep",
    "mutant-fallback-replicated": "declared Replicate on ep, measured distinct",
}


def test_rows_are_partitioned_completely():
    mechanism_rows = {row for m in CATALOGUE for row in m.rows}
    assert mechanism_rows | set(REPRODUCED_ELSEWHERE) | set(OUT_OF_SCOPE) == set(BUG_ROWS)
    assert not (mechanism_rows | set(REPRODUCED_ELSEWHERE)) & set(OUT_OF_SCOPE)
    assert all(why.strip() for why in {**REPRODUCED_ELSEWHERE, **OUT_OF_SCOPE}.values())


def test_every_mutant_is_one_mechanism_caught_by_a_built_in_scenario():
    names = [m.mutant for m in CATALOGUE]
    assert sorted(names) == sorted(MUTANTS) and len(set(names)) == len(names)
    assert len(CATALOGUE) >= 25
    for m in CATALOGUE:
        assert m.caught_by in builtin_scenarios(), m
        assert m.upstream and m.factor and 1 <= m.fuzz_needed <= FUZZ_BUDGET, m


def test_the_list_prints_every_mechanism_and_every_row_left_out():
    listed = run_cli(["catalogue", "--list"])
    assert listed.returncode == 0, listed.stderr
    for m in CATALOGUE:
        assert f"{m.mutant} |" in listed.stdout
    for row in (*REPRODUCED_ELSEWHERE, *OUT_OF_SCOPE):
        assert f"row {row}:" in listed.stdout


@pytest.mark.parametrize("mechanism", CATALOGUE, ids=lambda m: m.mutant)
def test_each_mechanism_is_caught_by_its_scenario_and_within_its_fuzz_bound(world4, mechanism):
    got = run_mechanism(mechanism, world4)
    assert got.failed > 0, f"{mechanism.mutant} passed every case of {mechanism.caught_by}"
    # the budget, not the recorded bound: the seeded search's count was seen to depend on which mechanisms ran
    # before it in the same warm world (124 alone, 21 after the other 26, for mutant-pp-max-reduce), so a test
    # that runs a subset cannot hold it; `clipcheck catalogue` prints both
    assert got.found, f"{mechanism.mutant}: not found within {FUZZ_BUDGET} fuzz examples"
    if mechanism.mutant in AXIS_SIGNATURES:  # among its failures' signatures (a lying-plan layout has its own)
        assert any(AXIS_SIGNATURES[mechanism.mutant] in s for s in got.signatures), got.signatures


def test_reference_passes_every_scenario_the_catalogue_uses(world4):
    from harness.api import check

    scenarios = sorted({m.caught_by for m in CATALOGUE})
    report = check("reference", scenarios=scenarios, worlds=[FUZZ_WORLD], pools={FUZZ_WORLD: world4})
    assert report.passed and report.cases, report.describe()
