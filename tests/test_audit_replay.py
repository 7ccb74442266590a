"""A saved audit replayed with DTensor clips: where the job's gradients were DTensors on its mesh or on
sub-meshes of it, the measured layout keeps them DTensors (``Variant.dtensor``), each on the sub-mesh of the
axes its own mesh spanned (``Variant.dtensor_axes``), so ``torch-dtensor`` replays on CPU ranks and reaches
the job's verdict; where it cannot (the job's mesh unknown, a DTensor on a mesh that is not a sub-mesh of
the job's, a parameter on some ranks only) the replay refuses in one line, before any rank starts.

The jobs are real FSDP2 steps under torchrun on gloo (tests/audit_jobs/fsdp2_dtensor.py, fsdp2_ep.py); the
layouts and refusals are also built in-process from fabricated records (``measured_variant`` is pure).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping

import pytest

from audit_runs import run_job
from harness.cases.layout import MeshSpec, Placement, Replicate, Shard
from harness.cases.measured import audit_doc, measured_variant, not_as_dtensors, world_mesh
from harness.cases.variant import DTensorAxes, Variant, whole_mesh_dims
from harness.commands.replay import audit_plan
from harness.errors import ClipcheckInputError, UsageError
from harness_runs import harness_process


def _variant(mesh: MeshSpec, declared: Mapping[str, Mapping[str, Placement]], held_by: tuple[int, ...] = (0, 1),
             spans: DTensorAxes | None = None) -> Variant:
    """A job of two ranks: ``w`` distinct on each rank that holds it, ``b`` a replica on both; each DTensor
    parameter on the whole mesh unless ``spans`` says otherwise."""
    def grad(sq: float, words: tuple[int, ...]) -> list[Any]:
        return [[4], "fp32", 4, 4, sq, False, list(words), None, sq]

    records: list[dict[str, Any]] = [{"params": [["b", "fp32", True, [4]]], "grads": {"b": grad(1.0, (7,))}}
                                     for _ in range(2)]
    for r in held_by:
        records[r]["params"].append(["w", "fp32", True, [4]])
        records[r]["grads"]["w"] = grad(1.0 + r, (r,))
    tokens = {(0, "b"): "c", (1, "b"): "c", **{(r, "w"): f"w{r}" for r in held_by}}
    distinct = {axis: {"w": len(held_by) > 1, "b": False} for axis in mesh.names}
    whole = {name: whole_mesh_dims(mesh.names) for name in declared}
    return measured_variant(records, tokens, mesh, declared, distinct, whole if spans is None else spans)


def _saved(tmp_path: Path, variant: Variant) -> str:
    path = tmp_path / "audit.json"
    path.write_text(json.dumps(audit_doc(variant, 2.0, 1.0, 2, {"truth": 2.0, "verdict": "PASS"})))
    return str(path)


def test_dtensors_on_the_job_s_mesh_stay_dtensors_and_plain_ones_plain(tmp_path):
    variant = _variant(MeshSpec.of(fsdp=2), {"w": {"fsdp": Shard(0)}})
    assert variant.dtensor and variant.plain == {"b"}
    plan, _ = audit_plan(_saved(tmp_path, variant), ["torch-dtensor"], None)
    assert plan.cases[0].variant.dtensor and plan.cases[0].variant.declared["w"]["fsdp"] == Shard(0)


@pytest.mark.parametrize("spans", [
    {"w": (("tp",),)},  # a sub-mesh: mesh["tp"]
    {"w": (("ep", "tp"),)},  # every rank on one flattened dim, as fsdp2_ep's dense layers
])
def test_dtensors_on_a_sub_mesh_keep_it_through_a_saved_file(tmp_path, spans):
    variant = _variant(MeshSpec.of(ep=2, tp=1), {"w": {axis: Replicate() for axis in spans["w"][0]}}, spans=spans)
    assert variant.dtensor and variant.dtensor_axes == spans
    plan, _ = audit_plan(_saved(tmp_path, variant), ["torch-dtensor"], None)
    assert plan.cases[0].variant.dtensor_axes == spans
    doc = json.loads(Path(_saved(tmp_path, variant)).read_text())
    del doc["case"]["dtensor_axes"]  # a file written before sub-meshes: every DTensor on the whole mesh
    (tmp_path / "old.json").write_text(json.dumps(doc))
    assert audit_plan(str(tmp_path / "old.json"), ["torch-dtensor"], None)[0].cases[0].variant.dtensor_axes == {}


@pytest.mark.parametrize("forged, why", [
    ({"w": "ep"}, "a sub-mesh must be a list"),
    ({"w": [["fsdp"]]}, "axes the mesh does not have: fsdp"),
    ({"b": [["ep"]]}, "need a DTensor variant naming its own DTensor parameters"),  # b is plain
    ({"w": [["tp"], ["ep"]]}, "in the mesh's order"),
])
def test_a_forged_sub_mesh_is_refused_in_one_line(tmp_path, forged, why):
    doc = json.loads(Path(_saved(tmp_path, _variant(MeshSpec.of(ep=2, tp=1), {"w": {"ep": Shard(0)}}))).read_text())
    doc["case"]["dtensor_axes"] = forged
    (tmp_path / "forged.json").write_text(json.dumps(doc))
    with pytest.raises(ClipcheckInputError, match=why) as refused:
        audit_plan(str(tmp_path / "forged.json"), ["torch-dtensor"], None)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("mesh, declared, held_by, spans, why", [
    (world_mesh(2), {}, (0, 1), None, "the job's mesh is unknown"),
    (MeshSpec.of(fsdp=2), {}, (0, 1), None, "no DTensor parameters"),
    (MeshSpec.of(ep=2, tp=1), {"w": {}}, (0, 1), {}, "not a sub-mesh of the job's mesh: w"),
    (MeshSpec.of(ep=2, tp=1), {"w": {"tp": Replicate(), "ep": Shard(0)}}, (0, 1), {"w": (("tp",), ("ep",))},
     "the sub-mesh of DTensor parameter w cannot be sliced"),
    (MeshSpec.of(fsdp=2), {"w": {"fsdp": Shard(0)}}, (0,), None, "held by some ranks only: w"),
])
def test_what_cannot_be_dtensors_is_refused_in_one_line(tmp_path, mesh, declared, held_by, spans, why):
    variant = _variant(mesh, declared, held_by, spans)
    given = {name: whole_mesh_dims(mesh.names) for name in declared} if spans is None else spans
    assert not variant.dtensor and why in (not_as_dtensors(variant.layout, declared, given) or "")
    with pytest.raises(UsageError, match="torch-dtensor needs DTensor parameters") as refused:
        audit_plan(_saved(tmp_path, variant), ["torch-dtensor"], None)
    assert "\n" not in str(refused.value)
    if mesh == world_mesh(2):
        assert why in str(refused.value)
    assert audit_plan(_saved(tmp_path, variant), ["reference"], None)[0].cases  # plain parameters: any other target


@pytest.mark.distributed
@pytest.mark.parametrize("mode, verdict", [("honest", "PASS"), ("replicate-lie", "FAIL")])
def test_an_fsdp2_job_replays_with_torch_dtensor_to_its_verdict(mode, verdict, tmp_path):
    """torch's own clip on an FSDP2 model's DTensors, audited in the job, and ``torch-dtensor`` (the same clip)
    replayed on CPU ranks from the saved layout: the same verdict, the same truth and, where it fails, the
    same ratio (the injected gradients have the measured norms, the DTensors the job's placements)."""
    saved = tmp_path / "audit.json"
    run = run_job("fsdp2_dtensor.py", 4, [mode, f"save={saved}"], tmp_path)
    assert run.found is not None and run.found["verdict"] == verdict, run.stderr[-3000:]
    jsonl = tmp_path / "replay.jsonl"
    proc = harness_process([sys.executable, "-m", "harness", "run", "--from-audit", str(saved), "--target",
                            "torch-dtensor", "--json", str(jsonl)], {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert jsonl.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    case = next(rec for rec in map(json.loads, jsonl.read_text().splitlines()) if rec.get("type") == "case")
    assert case["verdict"] == verdict, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert case["true_norm"] == pytest.approx(run.record["true_norm"], rel=1e-6)
    assert case["ratio"] == pytest.approx(run.record["ratio"], rel=1e-5)


@pytest.mark.distributed
def test_an_fsdp2_ep_job_on_two_meshes_replays_with_torch_dtensor_to_its_verdict(tmp_path):
    """torch's own clip on an FSDP2 + EP model (experts on the ``ep_fsdp`` sub-mesh, dense layers on a mesh of
    every rank), audited in the job: torch raises (pytorch #180346, norms on two meshes). The saved layout
    keeps each parameter's mesh, so ``torch-dtensor`` replayed on CPU ranks raises the same way: the same
    verdict, on the same truth."""
    saved = tmp_path / "audit.json"
    run = run_job("fsdp2_ep.py", 4, ["torch", f"save={saved}"], tmp_path)
    assert run.found is not None and run.found["verdict"] == "FAIL", run.stderr[-3000:]
    assert not any("torch-dtensor cannot run" in note for note in run.found["notes"]), run.found["notes"]
    doc = json.loads(saved.read_text())
    assert doc["case"]["dtensor_axes"] == {"experts.weight": [["ep_fsdp"]],
                                           **{f"dense.{i}.{w}": [["ep", "ep_fsdp"]] for i in (0, 1)
                                              for w in ("weight", "bias")}}
    jsonl = tmp_path / "replay.jsonl"
    proc = harness_process([sys.executable, "-m", "harness", "run", "--from-audit", str(saved), "--target",
                            "torch-dtensor", "--json", str(jsonl)], {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert jsonl.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    case = next(rec for rec in map(json.loads, jsonl.read_text().splitlines()) if rec.get("type") == "case")
    assert case["verdict"] == "FAIL" and "same mesh" in json.dumps(case), proc.stdout[-3000:]
    assert case["true_norm"] == pytest.approx(run.record["true_norm"], rel=1e-6)
