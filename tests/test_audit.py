"""``harness.audit`` on a user's own job: the measured truth without a mesh, the real call judged
by the case's checks, a clip that raises on one rank, ``restore``, what a failure says without it, and the
capture-and-replay round trip (of DTensor jobs: tests/test_audit_replay.py).

The jobs are real training steps (tests/audit_jobs/toy.py: a forward, a backward, DDP-like and tied
all-reduces) under torchrun on gloo; the pure parts (classes of copies, audit files) are tested in-process.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import typing

import pytest
import torch

import harness
from audit_runs import run_job
from harness.cases.layout import LayoutError
from harness.cases.measured import Holding, candidates, class_tokens, read_audit, world_mesh
from harness.judge.blame import tied_groups
from harness.judge.records import Evidence, Replication, StatsTable
from harness.judge.signatures import one_group_readings
from harness.run.audit.session import UNBLAMED
from harness.judge.truth import measured_norm
from harness_runs import harness_process


def _holding(rank: int, name: str, words: tuple[int, ...], zero: bool = False, sq: float = 1.0) -> Holding:
    return Holding(rank, name, (4,), "fp32", 4, 4, sq, zero, words, None, sq)


def test_copies_are_hashed_only_where_shape_dtype_and_samples_agree():
    held = [_holding(0, "embed", (1, 2)), _holding(1, "head", (1, 2)),
            _holding(0, "w", (3, 4)), _holding(1, "w", (5, 6))]
    assert candidates(held, 2) == [["embed"], ["head"]]  # w differs in its sampled bits: never hashed


def test_a_tie_is_one_class_and_all_zero_gradients_stay_with_their_own_name():
    held = [_holding(0, "embed", (1,)), _holding(1, "head", (1,)), _holding(0, "e0", (0,), zero=True, sq=0.0),
            _holding(1, "e1", (0,), zero=True, sq=0.0)]
    digests = [{"embed": "d1", "e0": "z"}, {"head": "d1", "e1": "z"}]
    tokens = class_tokens(held, digests)
    assert tokens[(0, "embed")] == tokens[(1, "head")]  # tied: one logical gradient
    assert tokens[(0, "e0")] != tokens[(1, "e1")]  # two experts without tokens are not "tied"


def test_the_truth_counts_each_class_once_whatever_its_names():
    stats = StatsTable(names=["embed", "head", "w"], numel=[[4, -1, 4], [-1, 4, 4]], itemsize=[[4, 0, 4], [0, 4, 4]],
                       pow_sum=[[9.0, 0.0, 16.0], [0.0, 9.0, 16.0]])
    tied = Replication({}, {"embed": ["t", None], "head": [None, "t"], "w": ["a", "b"]})
    assert measured_norm(stats, tied, world_mesh(2), 2.0) == pytest.approx(math.sqrt(9 + 16 + 16))
    untied = Replication({}, {"embed": ["t", None], "head": [None, "u"], "w": ["a", "a"]})
    assert measured_norm(stats, untied, world_mesh(2), 2.0) == pytest.approx(math.sqrt(9 + 9 + 16))


def test_a_file_that_is_not_an_audit_is_refused_in_one_line(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": "clipcheck-audit/1", "world": 2, "norm": 2.0, "max_norm": 1.0,
                                "case": {"mesh": [["world", 2]], "params": 3}}))
    with pytest.raises(LayoutError, match="audit"):
        read_audit(str(path))


def test_audit_without_a_process_group_and_restore():
    """World of one (no torch.distributed): torch's clip passes, an L1 clip audited as L2 fails, and
    ``restore=True`` gives every gradient back bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    report = harness.audit(model, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01), max_norm=0.01,
                           restore=True)
    assert report.passed, report.describe()
    assert all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters()))
    wrong = harness.audit(model, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type=1.0),
                          max_norm=0.01)
    assert not wrong.passed and "norm: reported/true" in wrong.describe()


def test_auditing_wraps_the_clip_someone_else_calls():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    model(torch.randn(3, 4)).sum().backward()

    class Engine:
        def clip(self) -> torch.Tensor:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)

        def step(self) -> torch.Tensor:
            return self.clip()

    engine = Engine()
    with harness.auditing(model, engine, "clip", max_norm=0.01) as hook:
        value = engine.step()
    assert hook.report is not None and hook.report.passed and isinstance(value, torch.Tensor)
    assert "clip" not in engine.__dict__  # the method is its class's again


def test_every_audited_call_keeps_the_user_s_label():
    """``auditing(..., calls=2, label=...)`` once popped the label from the shared options inside the
    wrapper: the first audited call took it and the second was named after the owner."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    model(torch.randn(3, 4)).sum().backward()

    class Engine:
        def clip(self) -> torch.Tensor:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)

    engine = Engine()
    with harness.auditing(model, engine, "clip", max_norm=0.01, calls=2, label="my clip") as hook:
        engine.clip()
        engine.clip()
    assert [r.result.case.target for r in hook.reports] == ["my clip", "my clip"]
    with harness.auditing(model, engine, "clip", max_norm=0.01, calls=2) as hook:
        engine.clip()
        engine.clip()
    assert [r.result.case.target for r in hook.reports] == ["Engine.clip", "Engine.clip"]


def test_the_audit_has_one_report_type_given_by_name():
    """``run_audit`` returns the public ``AuditReport`` itself (once a field-for-field copy built by
    position, where one added field shifted the rest); its fields are given by name only."""
    from harness.auditor import AuditReport
    from harness.run.audit import session

    assert harness.AuditReport is AuditReport is session.AuditReport
    assert typing.get_type_hints(session.run_audit)["return"] is AuditReport
    with pytest.raises(TypeError):
        AuditReport("PASS", "text", 0, 1, "gloo")  # type: ignore[misc]
    report = AuditReport(verdict="PASS", text="line", rank=0, world_size=1, backend="gloo", notes=["n"])
    assert report.passed and report.describe() == "line\nnote: n" and report.record() is None


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [2, 4])
def test_a_correct_clip_passes_from_a_real_backward(nproc, tmp_path):
    """Under torchrun itself (each rank importing afresh), as a user's job runs; the other jobs of the suite
    fork their ranks after the imports."""
    run = run_job("toy.py", nproc, ["correct", "restore"], tmp_path, torchrun=True)
    assert run.found is not None and run.found["verdict"] == "PASS", run.stderr[-3000:]
    assert run.found["restored"]  # restore=True: every rank's gradients bit for bit as before the audit
    assert run.record["scenario"] == "audit"


@pytest.mark.distributed
def test_a_rank_local_clip_fails_with_the_case_signature(tmp_path):
    run = run_job("toy.py", 4, ["local"], tmp_path)
    assert run.found["verdict"] == "FAIL"
    failed = {name for name, check in run.record["checks"].items() if check and not check["passed"]}
    assert {"norm", "agree", "replicas"} <= failed
    assert any("rank-local" in line for line in run.record["signature"]), run.record["signature"]
    assert not run.found["restored"]  # without restore the audit's call is the step's clip


@pytest.mark.distributed
def test_a_tie_counted_on_both_stages_is_caught_and_blamed(tmp_path):
    run = run_job("toy.py", 4, ["tied-twice", "restore"], tmp_path)
    assert run.found["verdict"] == "FAIL" and run.found["restored"]
    assert not run.check("norm")["passed"] and run.record["ratio"] > 1.0
    blamed = " ".join(str(b) for b in run.record["blame"])
    assert "embed" in blamed or "head" in blamed, run.found["text"]
    assert TIE_TWICE in run.record["signature"], run.found["text"]  # the tie is one group: embed's run alone cannot see it
    assert UNBLAMED not in run.found["text"]  # the groups were weighed


TIE_TWICE = "embed (ranks 0) + head (ranks 3): counted 2 times instead of once; every other group counted once"


@pytest.mark.distributed
def test_without_restore_a_failure_says_why_and_how_to_name_the_groups(tmp_path):
    """``restore=False``: no copy, so no one-group runs; the signature still says why, from the measured
    statistics (here one group's mistake: the tie counted on both stages, which no reading of the whole
    case prices), and a line says that ``restore=True`` names the groups. A correct clip's PASS has neither."""
    run = run_job("toy.py", 4, ["tied-twice"], tmp_path)
    assert run.found["verdict"] == "FAIL" and not run.record["blame"], run.found["text"]
    assert f"signature: {TIE_TWICE}" in run.found["text"], run.found["text"]
    assert f"note: {UNBLAMED}" in run.found["text"]
    right = run_job("toy.py", 4, ["correct"], tmp_path)
    assert right.found["verdict"] == "PASS", right.found["text"]
    assert "signature" not in right.found["text"] and UNBLAMED not in right.found["text"]


@pytest.mark.distributed
def test_a_small_group_counted_twice_is_established_on_a_copy_of_the_real_gradients(tmp_path):
    """bf16: the dense biases counted twice move the norm 0.8%, inside bf16's band. With ``restore=True`` the
    audit runs each group its band cannot see alone (the others zero, the tie's two names together): the
    biases' run fails ``counting`` in the blame's words, and a correct clip passes with every group
    established. Without a copy the PASS says which groups it could not see, and how to see them."""
    run = run_job("toy.py", 4, ["biases-twice", "restore", "bf16"], tmp_path)
    assert run.found["verdict"] == "FAIL" and run.found["restored"], run.found["text"]
    assert run.check("norm")["passed"] and abs(run.record["ratio"] - 1) < 0.01
    assert "dense.*.bias (ranks 0, 1, 2, 3): counted 2 times" in run.check("counting")["detail"], run.found["text"]
    right = run_job("toy.py", 4, ["correct", "restore", "bf16"], tmp_path)
    assert right.found["verdict"] == "PASS", right.found["text"]
    hows = right.record["counting"]
    assert hows["embed (ranks 0) + head (ranks 3)"] == "in its own run", hows
    assert all(how.startswith(("by the case", "in its own run")) for how in hows.values()), hows
    unseen = run_job("toy.py", 4, ["biases-twice", "bf16"], tmp_path)
    assert unseen.found["verdict"] == "PASS", unseen.found["text"]  # what its band can see is right
    assert "counting not established for 2 of 4 parameter groups" in unseen.found["text"], unseen.found["text"]
    assert unseen.record["counting"]["dense.*.bias (ranks 0, 1, 2, 3)"].startswith("not established")


def test_one_group_readings_price_one_group_s_mistake_and_nothing_else():
    """A group counted twice, priced from the groups' own evidence (its part of the p-th power sum doubled,
    the rest kept); a report no single group's mistake gives reads as nothing."""
    mesh = world_mesh(4)

    def evidence(truth: float, local: list[float]) -> Evidence:
        return Evidence(truth, 2.0, mesh, local, truth, [], replica_counts=frozenset({2}))

    groups = {"tie": evidence(3.0, [3.0, 0.0, 0.0, 3.0]), "rest": evidence(4.0, [2.0] * 4)}
    readings = one_group_readings([math.sqrt(25 + 9)] * 4, 5.0, groups, 1e-6)
    assert readings[0] == "tie: counted 2 times instead of once; every other group counted once", readings
    assert one_group_readings([5.5] * 4, 5.0, groups, 1e-6) == []


def test_a_tie_spanning_two_groups_is_one_group():
    groups = {"embed (ranks 0)": ["embed"], "head (ranks 3)": ["head"], "w": ["w"]}
    classes = {"embed": ["t", None], "head": [None, "t"], "w": ["a", "b"]}
    assert tied_groups(groups, classes) == {"embed (ranks 0) + head (ranks 3)": ["embed", "head"], "w": ["w"]}


@pytest.mark.distributed
def test_a_clip_that_returns_nothing_is_judged_by_its_coefficient(tmp_path):
    run = run_job("toy.py", 2, ["silent"], tmp_path)
    assert run.found["verdict"] == "PASS", run.found["text"]
    assert any("returned no norm" in note for note in run.found["notes"])


@pytest.mark.distributed
def test_a_clip_that_raises_on_one_rank_is_reported_with_rank_and_cause_in_bounded_time(tmp_path):
    start = time.monotonic()
    run = run_job("toy.py", 4, ["raise"], tmp_path, timeout=180)
    elapsed = time.monotonic() - start
    out = run.stdout + run.stderr
    assert "rank 1 raised RuntimeError: this rank's clip gave up" in out, out[-3000:]
    assert "hang" in out and "ERROR" in out
    assert run.returncode != 0 and elapsed < 120


@pytest.mark.distributed
def test_a_clip_that_hangs_on_one_rank_is_reported_in_bounded_time(tmp_path):
    start = time.monotonic()
    run = run_job("toy.py", 4, ["hang"], tmp_path, timeout=180)
    out = run.stdout + run.stderr
    assert "hang" in out and "ERROR" in out, out[-3000:]
    assert "rank 1 hung in" in out and "time.sleep(3600)" in out  # where the stuck rank is, not only its peers
    assert run.returncode != 0 and time.monotonic() - start < 120


@pytest.mark.distributed
def test_capture_and_replay_round_trip(tmp_path):
    """The layout measured on 4 ranks, saved, replayed on CPU ranks with injected gradients: the replay's
    truth is the audit's (to the rounding of the injected fp32 values), a correct clip passes there and
    the rank-local one fails there as it did in the job."""
    saved = tmp_path / "audit.json"
    run = run_job("toy.py", 4, ["correct", f"save={saved}"], tmp_path)
    assert run.found["verdict"] == "PASS"
    found = json.loads(saved.read_text())["found"]
    for target, verdict in (("reference", "PASS"), ("torch", "FAIL")):
        jsonl = tmp_path / f"replay-{target}.jsonl"
        proc = harness_process([sys.executable, "-m", "harness", "run", "--from-audit", str(saved), "--target", target,
                                "--json", str(jsonl)], {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
        case = next(rec for rec in map(json.loads, jsonl.read_text().splitlines()) if rec.get("type") == "case")
        assert case["verdict"] == verdict, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert case["true_norm"] == pytest.approx(found["truth"], rel=1e-6)


def test_the_blocked_coefficient_is_the_harness_s_own():
    """``restore=True`` measures the coefficient in float64 blocks (one block of scratch memory): the same
    numbers as ``effects.applied_coefficients``, which converts every gradient to float64 at once."""
    from harness.run.audit import with_copy as audit_exact
    from harness.run.case.effects import applied_coefficients

    g = torch.Generator().manual_seed(3)
    pre = {"a": torch.randn(3000, generator=g), "b": torch.randn(70, generator=g), "z": torch.zeros(5),
           "n": torch.tensor([1.0, float("nan")]), "gone": torch.ones(3)}
    post = {"a": pre["a"] * 0.25, "b": pre["b"] * 0.5 + torch.randn(70, generator=g) * 1e-3, "z": torch.zeros(5),
            "n": pre["n"] * 0.5, "gone": None}
    old_block = audit_exact.BLOCK
    audit_exact.BLOCK = 256  # several blocks per gradient
    try:
        scale, vanished = audit_exact.blocked_coefficients(pre, post)
    finally:
        audit_exact.BLOCK = old_block
    whole = applied_coefficients(pre, post)
    assert vanished == whole["vanished"] == ["gone"]
    assert scale.keys() == whole["scale"].keys() == {"a", "b"}
    for name in ("a", "b"):
        assert scale[name] == pytest.approx(whole["scale"][name], rel=1e-12)
