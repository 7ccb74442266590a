"""What the harness says about a real framework's FAIL, and when it says nothing at all: a finding
carries who reaches it (stock / direct-call / synthetic); a layout no trainer reaches runs for an
adapter only when asked; gradients an adapter's own path did not deliver bit for bit make the case a
harness error, never a verdict on the clip; a framework whose setup raises is a SKIP with the error.
Through a stand-in adapter (tests/fake_framework.py) on a real 2-rank launch."""

from __future__ import annotations

import pytest

from harness_runs import failed, run_clipcheck
from harness.cases.target import Finding, Reach, direct_call, stock, synthetic

pytestmark = pytest.mark.distributed

FAKE = ["--scenario", "tests/fake_framework.py:FakeFramework", "--dtype", "fp32", "--norm-type", "2",
        "--clip-ratio", "0.5"]


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    return run_clipcheck(2, [*FAKE, "--targets", "fake-good,fake-badpath,fake-setup,fake-half,reference"],
                         tmp_path_factory.mktemp("fake"))


def test_gradients_delivered_through_the_path_bit_for_bit_are_judged(fake_run):
    case = fake_run.one(target="fake-good", layout_has="stock")
    assert case["verdict"] == "PASS", case["checks"]


def test_gradients_the_path_changed_are_a_harness_error_naming_them(fake_run):
    case = fake_run.one(target="fake-badpath", layout_has="stock")
    assert case["verdict"] == "ERROR" and "truth" in failed(case)
    detail = case["checks"]["truth"]["detail"]
    assert "did not deliver" in detail and "w: 12 of 12 elements differ" in detail
    assert case["finding"] is None


def test_a_framework_whose_setup_raises_is_a_skip_with_the_error(fake_run):
    case = fake_run.one(target="fake-setup", layout_has="stock")
    assert case["verdict"] == "SKIP"
    assert "setup raised" in case["skip_reason"] and "ImportError: cannot import name 'Thing'" in case["skip_reason"]
    assert fake_run.summary["skipped"] == 1


def test_a_fail_carries_its_finding_and_who_reaches_it(fake_run):
    case = fake_run.one(target="fake-half", layout_has="stock")
    assert case["verdict"] == "FAIL" and case["ratio"] == pytest.approx(0.5)
    assert case["finding"]["reach"] == "stock" and case["finding"]["how"] == "the fake trainer's default config"
    assert case["finding"]["text"] == "new finding: reports half the norm"
    assert "finding [stock: the fake trainer's default config]: new finding: reports half the norm" in fake_run.stdout
    assert "reproduce without clipcheck: tests/fake_framework.py" in fake_run.stdout


def test_synthetic_layouts_run_for_an_adapter_only_when_asked(fake_run, tmp_path):
    assert not fake_run.cases(target="fake-half", layout_has="unreachable")
    assert fake_run.one(target="reference", layout_has="unreachable")["verdict"] == "PASS"  # the harness's own
    assert "synthetic layouts of" in fake_run.stdout and "run only with --synthetic" in fake_run.stdout
    asked = run_clipcheck(2, [*FAKE, "--targets", "fake-half,fake-badpath", "--synthetic"], tmp_path)
    case = asked.one(target="fake-half", layout_has="unreachable")
    assert case["verdict"] == "FAIL" and case["synthetic"] == "the fake trainer never lays gradients out so"
    assert case["finding"]["reach"] == "synthetic"
    assert case["finding"]["text"] == "synthetic regression layout: reports half the norm"
    # a synthetic layout's gradients are injected after the setup: the path that would change them never runs
    assert asked.one(target="fake-badpath", layout_has="unreachable")["verdict"] == "PASS"


def test_a_reach_says_how_and_only_a_reached_finding_is_new():
    with pytest.raises(ValueError):
        Reach("sometimes", "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        stock(" ")
    assert Finding("*", None, "m", stock("cfg")).describe() == "new finding: m"
    assert Finding("*", None, "m", direct_call("a call")).describe() == "new finding: m"
    assert Finding("*", None, "m", synthetic("no path")).describe() == "synthetic regression layout: m"
    assert Finding("*", "org/repo #1", "m", stock("cfg"), owner="pytorch/pytorch").describe() == \
        "org/repo #1: m (filed under pytorch/pytorch)"
