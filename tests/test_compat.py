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
        "synthetic regression layout: VeOmni's clip skips the EP reduction")
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


def test_a_release_recipe_is_the_pinned_one_with_its_version_unless_it_has_its_own():
    from harness.commands.sweep import pip_lines
    from harness.cases.frameworks import Framework

    fw = Framework("ds", "ds.utils", "ds", "hint", recipe=("DS_BUILD_OPS=0 pip install --no-build-isolation ds==2.0",
                                                           "pip install --no-deps other-ds==2.0 ds-extra==1.0"),
                   releases=("1.0", "2.0", "3.0"),
                   release_recipes={"3.0": ("pip install --no-deps --ignore-requires-python ds==3.0",
                                            "pip install triton==3.6.0")})
    assert fw.pinned == "2.0"
    assert fw.recipe_for("1.0") == ("DS_BUILD_OPS=0 pip install --no-build-isolation ds==1.0",
                                    "pip install --no-deps other-ds==2.0 ds-extra==1.0")  # other dists untouched
    assert pip_lines(fw, "1.0") == [({"DS_BUILD_OPS": "0"}, ["--no-build-isolation", "ds==1.0"]),
                                    ({}, ["--no-deps", "other-ds==2.0", "ds-extra==1.0"])]
    assert pip_lines(fw, "3.0")[0] == ({}, ["--no-deps", "--ignore-requires-python", "ds==3.0"])


def test_the_sweep_table_says_which_release_has_which_finding():
    from harness.commands.sweep import ReleaseRun, sweep_table
    from harness.cases.frameworks import Framework

    fw = Framework("veomni", "json", "veomni", "hint")
    bad = _case("veomni", "dp_replicate=1 ep_fsdp=1 ep=2 experts nan", "FAIL", norm="Linf")
    good = _case("veomni", "dp_replicate=1 ep_fsdp=1 ep=2 experts", "PASS")
    odd = _case("veomni", "dp_replicate=1 ep_fsdp=1 ep=2 experts", "FAIL")
    table = sweep_table(fw, [ReleaseRun("0.1", records=[bad, good]), ReleaseRun("0.2", records=[good, odd]),
                             ReleaseRun("0.3", problem="pip install veomni==0.3 failed: no such version")])
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()[2:]}
    assert "| 1 / 1 / 0 / 0 | 1 / 1 / 0 / 0 | not run: pip install veomni==0.3 failed" in rows[
        "cases: passed / failed / errors / skipped"]
    (nan_row,) = [line for text, line in rows.items() if "fmaxf" in text]
    assert nan_row.endswith("| direct-call | 1 | - | - |")
    assert rows["unexplained FAIL rows"].endswith("| ? | - | 1 | - |")


def test_one_finding_text_reached_two_ways_is_two_rows_of_the_sweep():
    from harness.commands.sweep import ReleaseRun, sweep_table
    from harness.cases.frameworks import Framework

    stock_row = dict(_case("deepspeed", "edp=1 ep=2 owner-sharded", "FAIL"), finding={
        "upstream": "ds #1", "note": "mean", "reach": "stock", "how": "engine", "owner": None, "repro": None,
        "text": "ds #1: mean"})
    direct_row = dict(stock_row, layout="edp=1 ep=2 expert-no-grad",
                      finding=dict(stock_row["finding"], reach="direct-call", how="a custom loop"))
    table = sweep_table(Framework("deepspeed", "json", "deepspeed", "hint"),
                        [ReleaseRun("1.0", records=[stock_row, direct_row, direct_row])])
    assert "| ds #1: mean | stock | 1 |" in table and "| ds #1: mean | direct-call | 2 |" in table
