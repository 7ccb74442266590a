"""``clipcheck layouts``: what a clip is handed on each selected layout (gradient kind, local shape,
declared placements, mesh axes, the layout's kinds), from planning alone: no process group starts."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from harness.cases.handed import handed
from harness.cases.scenario import ScenarioOptions
from harness.commands.main import main
from harness.targets.registry import resolve_scenario
from harness_runs import run_cli


def layouts_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["layouts", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def by_label(document: dict, label: str) -> dict:
    found = [layout for layout in document["layouts"] if layout["label"] == label]
    assert len(found) == 1, [layout["label"] for layout in document["layouts"]]
    return found[0]


def test_the_table_shows_each_parameter_as_a_clip_is_handed_it(capsys):
    assert main(["layouts", "--scenario", "dense_dp", "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    assert "dense_dp at world 2:" in out
    assert "  dp=2 fsdp dtensor  [fsdp]  mesh dp=2  fp32" in out and "  dp=2 replicated  [ddp]  mesh dp=2  fp32" in out
    tables = out.split("\n  dp=2 ")
    dtensor = next(t for t in tables if t.startswith("fsdp dtensor "))
    plain = next(t for t in tables if t.startswith("fsdp  "))
    assert "layers.0.weight  DTensor  local (16, 32)" in dtensor and "dp=Shard(0)" in dtensor
    assert "layers.0.weight  plain    local (16, 32)" in plain
    assert not dist.is_initialized()  # planning only


def test_json_is_one_document_with_kinds_mesh_and_parameters(capsys):
    document = layouts_json(capsys, "--scenario", "dense_dp,xorl_ep_lora,deepspeed_autoep", "--nproc", "4")
    assert set(document) == {"layouts", "notes"}
    fsdp = by_label(document, "dp=4 fsdp dtensor")
    assert (fsdp["scenario"], fsdp["world_size"], fsdp["kinds"], fsdp["mesh"], fsdp["dtype"]) == (
        "dense_dp", 4, ["fsdp"], {"dp": 4}, "fp32")
    weight = fsdp["parameters"][0]
    assert weight == {"name": "layers.0.weight", "grad": "DTensor", "shape": [32, 32], "local_shape": [8, 32],
                      "ranks": None, "no_grad_on": [], "declared": {"dp": "Shard(0)"}, "true": {"dp": "Shard(0)"},
                      "dtensor_mesh": []}
    lying = by_label(document, "ep=2 ep_fsdp=2 plan=minimax_m3 hybrid_shared=True")
    assert lying["kinds"] == ["fsdp", "ep"] and lying["dressed_by"] == ["xorl"]
    lora_b = next(p for p in lying["parameters"] if p["name"].endswith("gate_proj_lora_B"))
    assert lora_b["declared"]["ep"] == "Replicate()" and lora_b["true"]["ep"] == "Shard(0)"
    frozen = next(p for p in lying["parameters"] if p["name"].endswith("experts.gate_up_proj"))
    assert frozen["grad"] == "none"
    owner = by_label(document, "edp=2 ep=2 owner-sharded expert-no-grad")
    expert = next(p for p in owner["parameters"] if p["name"] == "moe.experts.3.weight")
    assert owner["kinds"] == ["ddp", "ep"] and expert["ranks"] == [1, 3] and expert["no_grad_on"] == [1, 3]


def test_a_variant_that_keeps_some_parameters_plain_hands_both_kinds():
    variant = next(v for v in resolve_scenario("dense_edges").variants(2, ScenarioOptions())
                   if v.label == "dp=2 dtensor weights, plain replicated biases")
    kinds = {p.name: p.grad for p in handed(variant)}
    assert kinds["layers.0.weight"] == "DTensor" and kinds["layers.0.bias"] == "plain"


def test_fsdp2_layouts_hand_a_clip_what_fully_shard_hands_it(capsys):
    """FSDP2 and HSDP layouts (the harness's own and accelerate's) hand a clip without a setup of its own the
    DTensors ``fully_shard`` makes, each on its own mesh where that is not the layout's whole mesh; TP leaves
    plain what accelerate's TP plan leaves plain."""
    document = layouts_json(capsys, "--scenario", "fsdp2_meshes,hsdp_cp,accelerate_fsdp2", "--nproc", "4")
    for label in ("dp=4 fsdp", "dp_replicate=2 dp_shard=2 hsdp", "dp_replicate=2 dp_shard=2 cp=1 replicas",
                  "dp_shard=4 fsdp2", "dp_shard=2 tp=2 fsdp2+tp"):
        found = [layout for layout in document["layouts"] if layout["label"] == label]
        assert found and all(p["grad"] == "DTensor" for layout in found for p in layout["parameters"]), label
    mixed = {p["name"]: p["dtensor_mesh"] for p in by_label(document, "ep=2 ep_fsdp=2 mixed meshes")["parameters"]}
    assert mixed == {"layers.0.weight": ["ep_ep_fsdp"], "layers.0.bias": ["ep_ep_fsdp"], "moe.experts.w1": ["ep_fsdp"]}
    cp = by_label(document, "dp_replicate=1 dp_shard=2 cp=2 replicas")["parameters"]
    assert all(p["dtensor_mesh"] == ["dp_replicate", "dp_shard"] for p in cp)  # cp replicas hold the same DTensor
    fsdp_tp = {p["name"]: p["dtensor_mesh"] for p in by_label(document, "dp_shard=2 tp=2 fsdp2+tp")["parameters"]}
    assert fsdp_tp["norm.weight"] == ["dp_shard"] and fsdp_tp["layers.0.mlp.down_proj.weight"] == []
    mixed_tp = {p["name"]: p["grad"] for p in by_label(document, "tp=4 tp mixed plain/DTensor")["parameters"]}
    assert mixed_tp["norm.weight"] == "plain" and mixed_tp["layers.0.self_attn.q_proj.weight"] == "DTensor"
    assert all(p["grad"] == "plain" for p in by_label(document, "tp=4 tp all plain")["parameters"])


def test_the_selection_flags_apply(capsys):
    document = layouts_json(capsys, "--scenario", "xorl_ep_lora,torchtune_tp", "--nproc", "2,4",
                            "--parallelism", "ep,fsdp", "--exclude", "minimax")
    assert document["layouts"] and all(set(layout["kinds"]) <= {"ep", "fsdp"} for layout in document["layouts"])
    assert not any("minimax" in layout["label"] for layout in document["layouts"])
    assert {layout["world_size"] for layout in document["layouts"]} == {2, 4}
    assert not any("torchtune_tp" in note for note in document["notes"])  # an fsdp layout at every world
    only_tp = layouts_json(capsys, "--scenario", "dense_dp,torchtune_tp", "--nproc", "2,4", "--parallelism", "tp")
    assert "scenario dense_dp: parallelism tp leaves none of its layouts at world 2, 4 (their kinds: ddp, fsdp)" \
        in only_tp["notes"]


def test_synthetic_layouts_are_shown_on_request(capsys):
    default = layouts_json(capsys, "--scenario", "torchtitan_ep", "--nproc", "4")
    asked = layouts_json(capsys, "--scenario", "torchtitan_ep", "--nproc", "4", "--synthetic")
    assert len(asked["layouts"]) > len(default["layouts"])
    assert all(layout["synthetic"] is None for layout in default["layouts"])
    assert any("synthetic layout(s) not shown" in note for note in default["notes"])


@pytest.mark.parametrize("args, message", [
    (["--parallelism", "zero"], "unknown parallelism kind 'zero' (valid: ddp, fsdp, hsdp, ep, tp, pp, cp)"),
    (["--scenario", "dense_dp", "--parallelism", "tp"], "parallelism tp leaves no layout of dense_dp"),
    (["--nproc", "two"], "--nproc needs whole numbers"),
    (["--scenario", "nope"], "unknown scenario 'nope'"),
])
def test_bad_input_is_one_line_and_status_2(args, message, capsys):
    assert main(["layouts", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_it_is_a_command_of_clipcheck():
    helped = run_cli(["layouts", "--help"])
    assert helped.returncode == 0 and helped.stdout.startswith("usage: clipcheck layouts")
    assert "--parallelism" in helped.stdout and "--clip-ratio" not in helped.stdout
    proc = run_cli(["layouts", "--scenario", "fsdp2_meshes", "--nproc", "4", "--variant", "hsdp"])
    assert proc.returncode == 0, proc.stderr
    assert "dp_replicate=2 dp_shard=2 hsdp  [hsdp]" in proc.stdout
    assert "targets torch-fsdp2 set the model up their framework's way first" in proc.stdout
