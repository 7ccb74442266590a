"""The compatibility table says what every FAIL is: the upstream report it matches, a new finding
(what to report), or "unexplained" when no adapter has recorded one, so a new failure of a real
framework cannot hide among the known ones."""

from harness.report.compat import compat_rows, markdown


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
        "new finding: VeOmni skips the EP reduction")
    assert "gloo's float MAX" in explained[("veomni", "dp_replicate=1 ep_fsdp=1 ep=2 experts nan", "Linf")]
    assert explained[("veomni", "dp_replicate=1 ep_fsdp=1 ep=2 experts nan", "L2")].startswith("unexplained")
    assert explained[("veomni", "dp_replicate=1 ep_fsdp=1 ep=2 experts", "L2")] == "-"
    assert markdown(rows).splitlines()[0].endswith("| ratio | upstream report or finding |")
