"""The compatibility table says what every FAIL is: the upstream report it matches, a new finding
(what to report), or "unexplained" when no adapter has recorded one, so a new failure of a real
framework cannot hide among the known ones."""

from harness.report.compat import compat_rows, filed_findings, markdown


def _case(target, layout, verdict, norm="L2"):
    return {"type": "case", "framework": "some 1.0", "target": target, "scenario": "s", "layout": layout,
            "norm": norm, "dtype": "fp32", "world_size": 4, "verdict": verdict, "ratio": 0.5, "checks": {}}


def test_every_fail_is_a_known_report_a_new_finding_or_unexplained():
    rows = compat_rows([
        _case("torchtune", "dp=1 tp=2 tp base plan", "FAIL"),
        _case("veomni", "dp_replicate=1 ep_fsdp=1 ep=2 shared-lora differing", "FAIL"),
        _case("veomni", "dp_replicate=1 ep_fsdp=1 ep=2 experts nan", "FAIL", norm="Linf"),
        _case("veomni", "dp_replicate=1 ep_fsdp=1 ep=2 experts nan", "FAIL", norm="L2"),  # no finding for L2
        _case("veomni", "dp_replicate=1 ep_fsdp=1 ep=2 experts", "PASS"),
    ])
    explained = {(r[1], r[3], r[4]): r[-1] for r in rows}
    assert explained[("torchtune", "dp=1 tp=2 tp base plan", "L2")].startswith("meta-pytorch/torchtune #2420")
    assert explained[("veomni", "dp_replicate=1 ep_fsdp=1 ep=2 shared-lora differing", "L2")].startswith(
        "synthetic regression layout: VeOmni skips the EP reduction")
    assert "fmaxf" in explained[("veomni", "dp_replicate=1 ep_fsdp=1 ep=2 experts nan", "Linf")]
    assert explained[("veomni", "dp_replicate=1 ep_fsdp=1 ep=2 experts nan", "L2")].startswith("unexplained")
    assert explained[("veomni", "dp_replicate=1 ep_fsdp=1 ep=2 experts", "L2")] == "-"
    assert markdown(rows).splitlines()[0].endswith("| ratio | reach | upstream report or finding |")
    reach = {(r[1], r[3], r[4]): r[9] for r in rows}
    assert reach[("torchtune", "dp=1 tp=2 tp base plan", "L2")] == "stock"
    assert reach[("veomni", "dp_replicate=1 ep_fsdp=1 ep=2 shared-lora differing", "L2")] == "synthetic"
    assert reach[("veomni", "dp_replicate=1 ep_fsdp=1 ep=2 experts", "L2")] == "-"


def test_a_torch_finding_inherited_by_several_frameworks_is_filed_once_under_torch():
    records = [_case(target, layout, "FAIL", norm="Linf") for target, layout in (
        ("veomni", "dp_replicate=1 ep_fsdp=1 ep=2 experts nan"), ("accelerate", "dp_shard=2 fsdp2 nan"),
        ("torch-dtensor", "dp=2 fsdp nan on last rank"))]
    (filed,) = filed_findings(records)
    assert filed.finding["owner"] == "pytorch/pytorch" and filed.rows == 3
    assert {f.split(" (")[1] for f in filed.frameworks} == {"veomni)", "accelerate)", "torch-dtensor)"}
    assert "| pytorch/pytorch | direct-call |" in markdown([], [filed])
