"""The matrix views: the compact text summary (harness/report/summary.py) and the static HTML page
(harness/report/html.py).

Unit tests on fabricated records shaped like reporter.case_json / finish.metamorphic_json, then a real
headless Chromium (Debian's package; .ci/install-browser installs it) that loads the page, runs its
JS, opens a failing cell (by URL fragment, and by a click event on its button that goes through the
page's click handler) and takes a screenshot, copied to results/report-screenshot.png when the
checkout has a results/ folder. A second browser test renders the default matrix's page (every case
planned at worlds 1, 2, 4, 8, a record fabricated for each) at 1280 px: screenshotted (kept in the
test's tmp folder, its path printed on a failure, and copied to results/report-default-matrix.png),
and measured in the page by a script (``LAYOUT_PROBE``): no sideways scrolling, every layout's label
whole inside its column. Without a chromium binary the browser tests skip, saying so.
"""

from __future__ import annotations

import copy
import html
import json
import re
import shutil
import struct
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from harness.cases.matrix import load_matrix
from harness.commands.matrix import default_matrix_path
from harness.plan.planner import plan_cases
from harness.report.html import render_html, write_html
from harness.report.summary import compact_summary

SIG_ROOT = "equals the mean of the rank-local norms: a root taken before the cross-rank average"
SIG_LOCAL = "each rank reports its rank-local norm: no cross-rank reduction"
REPLAY = "python -m harness --scenario dense_dp --targets crashy --layout 'dp=2 fsdp' --world 2"
REPLAY_BROKEN = "python -m harness --scenario dense_dp --targets broken --layout 'dp=2 fsdp' --world 2 --dtype fp32"


def case(target="reference", scenario="dense_dp", layout="dp=2 fsdp", verdict="PASS", ratio=1.0, world=2,
         norm="L2", dtype="fp32", failed=(), signature=(), errors=None, **extra):
    """A case record like report.case_json's; ``failed`` is [(check, detail)]."""
    checks = {name: {"passed": True, "detail": ""} for name in ("truth", "norm", "agree", "coefficient")}
    for name, detail in failed:
        checks[name] = {"passed": False, "detail": detail}
    rec = {
        "framework": None, "type": "case", "index": 0, "scenario": scenario, "layout": layout, "mesh": {"dp": world},
        "target": target, "norm_type": 2.0 if norm == "L2" else "inf", "norm": norm, "dtype": dtype,
        "max_norm": 0.5, "clip_ratio": 0.5, "seed": 0, "world_size": world, "backend": "gloo", "verdict": verdict,
        "true_norm": 27.8, "measured_true_norm": 27.8,
        "reported": [None if not isinstance(ratio, float) else 27.8 * ratio] * world,
        "ratio": ratio, "tolerance": 1e-5, "coefficient": 0.018, "checks": checks, "signature": list(signature),
        "errors": errors if errors is not None else [None] * world, "measured_placements": {},
        "declared_mismatches": [], "invariance_key": "dense-32", "skip_reason": None, "seconds": 0.001,
    }
    rec.update(extra)
    return rec


def meta(target, scenario="dense_dp", world=2, passed=True, gap=0.0):
    return {"type": "metamorphic", "world_size": world, "backend": "gloo", "scenario": scenario, "target": target,
            "norm": "L2", "dtype": "fp32", "invariance_key": "dense-32", "bound": "x0.5",
            "coefficients": {"dp=2 replicated": 0.018, "dp=2 fsdp": 0.018 + gap}, "norms": {}, "gap": gap,
            "passed": passed}


LONG = "edp=2 ep=4 owner-sharded expert-no-grad with-a-deliberately-very-long-layout-label-that-wraps"


def sample_records() -> list[dict]:
    """Two worlds, two scenarios; passes, failures with signatures, a crash with a replay command,
    skips, null and string ratios, an HTML-hostile target name, metamorphic groups and a summary."""
    recs = []
    for world in (1, 2):
        for layout in (f"dp={world} replicated", f"dp={world} fsdp"):
            for dtype in ("fp32", "bf16"):
                recs.append(case("reference", layout=layout, world=world, dtype=dtype))
                recs.append(case("torch", layout=layout, world=world, dtype=dtype, ratio=0.999999))
    for dtype, ratio in (("fp32", 0.696606), ("bf16", 0.7)):
        recs.append(case("broken", layout="dp=2 fsdp", dtype=dtype, verdict="FAIL", ratio=ratio,
                         failed=[("norm", "reported/true rank 0: 0.696606, rank 1: 0.717454"),
                                 ("agree", "ranks report 0: 19.3713, 1: 19.9511")],
                         signature=[SIG_LOCAL], **({"replay": REPLAY_BROKEN} if dtype == "fp32" else {})))
    recs.append(case("broken", layout="dp=2 replicated", verdict="PASS"))
    recs.append(case("crashy", layout="dp=2 fsdp", verdict="ERROR", ratio=None,
                     failed=[("crash", "rank 1 exited with signal 11 before judging")],
                     errors=[None, "Traceback (most recent call last):\n  RuntimeError: boom <oops>"],
                     replay=REPLAY))
    recs.append(case("crashy", layout="dp=2 replicated", verdict="ERROR", ratio=None,
                     failed=[("not_run", "the launch crashed before this case ran")]))
    recs.append(case("skipper", layout="dp=2 fsdp", verdict="SKIP", ratio=None, skip_reason="needs 4 ranks"))
    recs.append(case("nanny", layout="dp=2 fsdp", verdict="FAIL", ratio="nan", failed=[("norm", "reported nan")]))
    for norm in ("L2", "Linf"):
        recs.append(case("deepspeed-style", scenario="deepspeed_autoep", layout=LONG, verdict="FAIL", norm=norm,
                         ratio=0.729227 if norm == "L2" else 0.745693,
                         failed=[("norm", "reported/true 0.729"), ("coefficient", "scaled by 0.0258")],
                         signature=[SIG_ROOT]))
        recs.append(case("<script>alert('x')</script>", scenario="deepspeed_autoep", layout=LONG, norm=norm,
                         future_field={"unknown": [1, 2]}))
    recs += [meta("reference"), meta("broken", passed=False, gap=0.0078)]
    recs.append({"type": "summary", "cases": len(recs), "ok": False})
    return recs


# ---------------------------------------------------------------------------------- compact_summary

def _rows(lines):
    """Summary lines as {(target, scenario): [columns]} (the signature column/line set aside)."""
    out = {}
    for line in lines[1:]:
        if line.startswith("    "):
            continue
        cols = line.split()
        out[(cols[0], cols[1])] = cols[2:]
    return out


def test_summary_counts_ordering_and_header():
    recs = sample_records()
    lines = compact_summary(list(reversed(recs)))
    assert lines[0].split()[:8] == ["target", "scenario", "pass", "fail", "error", "skip", "meta", "worst"]
    rows = _rows(lines)
    assert list(rows) == sorted(rows)  # target, then scenario
    assert rows[("broken", "dense_dp")][:6] == ["1", "2", "0", "0", "1/1", "0.696606"]
    assert rows[("reference", "dense_dp")][:6] == ["8", "0", "0", "0", "0/1", "-"]
    assert rows[("crashy", "dense_dp")][:6] == ["0", "0", "2", "0", "-", "raised"]
    assert rows[("skipper", "dense_dp")][:6] == ["0", "0", "0", "1", "-", "-"]
    assert rows[("nanny", "dense_dp")][5] == "nan"
    assert all(len(line) <= 120 for line in lines)


def test_summary_worst_ratio_is_farthest_from_one_among_failures():
    recs = [case("t", verdict="PASS", ratio=9.0),  # passing: not a candidate
            case("t", verdict="FAIL", ratio=1.9, failed=[("norm", "")]),
            case("t", verdict="FAIL", ratio=0.5, failed=[("norm", "")]),  # |log 0.5| > |log 1.9|
            case("t", verdict="FAIL", ratio=None, failed=[("agree", "")])]
    assert _rows(compact_summary(recs))[("t", "dense_dp")][5] == "0.500000"
    recs.append(case("t", verdict="FAIL", ratio="inf", failed=[("norm", "")]))
    assert _rows(compact_summary(recs))[("t", "dense_dp")][5] == "inf"
    # failures without a ratio that raised nothing: no worst ratio to show
    assert _rows(compact_summary([case("t", verdict="FAIL", ratio=None, failed=[("agree", "")])]))[
        ("t", "dense_dp")][5] == "-"


def test_summary_most_common_signature():
    recs = [case("t", verdict="FAIL", ratio=0.7, failed=[("norm", "")], signature=["rare one"]),
            case("t", verdict="FAIL", ratio=0.7, failed=[("norm", "")], signature=["common one"]),
            case("t", verdict="FAIL", ratio=0.7, failed=[("norm", "")], signature=["common one"]),
            case("t", verdict="PASS", signature=["ignored: a pass"])]
    lines = compact_summary(recs)
    assert lines[0].endswith("signature")  # short enough: a column
    assert lines[1].endswith("common one (+1)")
    # a long signature goes whole on its own indented line, within 120 columns
    recs[1]["signature"] = recs[2]["signature"] = [SIG_ROOT + " and then some more words"]
    lines = compact_summary(recs)
    assert lines[2] == "    " + SIG_ROOT + " and then some more words (+1)"
    assert all(len(line) <= 120 for line in lines)
    # no signature: the first error line, else the failed checks
    err = case("e", verdict="ERROR", ratio=None, failed=[("crash", "")], errors=[None, "\nRuntimeError: boom\nmore"])
    assert "error: RuntimeError: boom" in "\n".join(compact_summary([err]))
    assert "failed: norm, agree" in "\n".join(compact_summary([case("c", verdict="FAIL", ratio=0.5,
                                                                    failed=[("norm", ""), ("agree", "")])]))


def test_summary_empty_skips_and_sparse_records():
    assert compact_summary([]) == ["target  scenario  pass  fail  error  skip  meta  worst", "(no cases)"]
    assert compact_summary([{"type": "summary", "ok": True}])[-1] == "(no cases)"
    only_skips = compact_summary([case("s", verdict="SKIP", ratio=None, skip_reason="x")] * 3)
    assert _rows(only_skips)[("s", "dense_dp")][:6] == ["0", "0", "0", "3", "-", "-"]
    sparse = compact_summary([{"type": "case", "verdict": "WEIRD"}, {"verdict": "PASS", "target": "a"}])
    assert _rows(sparse)[("?", "?")][:4] == ["0", "0", "1", "0"]  # an unknown verdict counts as an error
    many = [case(f"target-{i:03d}-with-a-long-name-{'x' * 30}", verdict="FAIL", ratio=0.5,
                 failed=[("norm", "")], signature=["s" * 300]) for i in range(60)]
    lines = compact_summary(many)
    assert len(lines) == 1 + 2 * 60 and all(len(line) <= 120 for line in lines)


# -------------------------------------------------------------------------------------- render_html

class _Dom(HTMLParser):
    """Elements (tag, attrs, text inside) of a page, enough to find cells and sections by attribute."""

    VOID = {"meta", "input", "br", "img", "link", "hr"}

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.elements: list[dict] = []
        self.stack: list[dict] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        el = {"tag": tag, "attrs": dict(attrs), "text": []}
        self.elements.append(el)
        if tag not in self.VOID:
            self.stack.append(el)

    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop()["tag"] == tag:
                break

    def handle_data(self, data):
        for el in self.stack:
            el["text"].append(data)

    def find(self, **attrs) -> list[dict]:
        """Elements whose attributes equal these (``class_`` is ``class``, ``data_x`` is ``data-x``)."""
        names = {k: k.rstrip("_").replace("_", "-") for k in attrs}
        return [e for e in self.elements if all(e["attrs"].get(names[k]) == v for k, v in attrs.items())]

    def by_id(self, ident: str) -> dict:
        (el,) = [e for e in self.elements if e["attrs"].get("id") == ident]
        return el

    @staticmethod
    def text(el) -> str:
        return " ".join("".join(el["text"]).split())


def _cells(dom: _Dom) -> list[dict]:
    return [e for e in dom.elements if e["tag"] == "td" and "data-details" in e["attrs"]]


def test_html_cells_verdicts_and_aggregation():
    page = render_html(sample_records(), title="t", generated="2025-01-02 03:04:05 UTC")
    dom = _Dom(page)
    cells = _cells(dom)
    # one cell per (world, scenario, layout, target) that has cases
    keys = {(r["world_size"], r["scenario"], r["layout"], r["target"]) for r in sample_records() if r["type"] == "case"}
    assert len(cells) == len(keys)
    by = {(c["attrs"]["data-world"], c["attrs"]["data-layout"], c["attrs"]["data-target"]): c for c in cells}
    classes = {v: by[k]["attrs"]["class"].split() for v, k in {
        "PASS": ("1", "dp=1 fsdp", "reference"), "FAIL": ("2", "dp=2 fsdp", "broken"),
        "ERROR": ("2", "dp=2 fsdp", "crashy"), "SKIP": ("2", "dp=2 fsdp", "skipper")}.items()}
    for verdict, cls in classes.items():
        assert f"v-{verdict.lower()}" in cls
        assert by[{"PASS": ("1", "dp=1 fsdp", "reference"), "FAIL": ("2", "dp=2 fsdp", "broken"),
                   "ERROR": ("2", "dp=2 fsdp", "crashy"), "SKIP": ("2", "dp=2 fsdp", "skipper")}[verdict]][
            "attrs"]["data-verdict"] == verdict
    broken = by[("2", "dp=2 fsdp", "broken")]
    assert broken["attrs"]["data-cases"] == "2" and broken["attrs"]["data-failing"] == "2"
    assert _Dom.text(broken) == "0.697 2/2 fail"  # the worst of fp32 0.696606 and bf16 0.7
    assert _Dom.text(by[("2", "dp=2 fsdp", "torch")]) == "1.000 ×2"
    assert _Dom.text(by[("2", "dp=2 fsdp", "nanny")]).startswith("nan")
    assert _Dom.text(by[("2", "dp=2 fsdp", "crashy")]).startswith("crash")
    # header totals and timestamp
    header = dom.by_id("summary")["attrs"]
    assert (header["data-cases"], header["data-passed"], header["data-failed"], header["data-errors"],
            header["data-skipped"], header["data-metamorphic-failed"]) == ("27", "19", "5", "2", "1", "1")
    assert "generated 2025-01-02 03:04:05 UTC" in page
    # world column groups, and ids unique
    assert {e["attrs"]["data-world"] for e in dom.elements if "world-head" in e["attrs"].get("class", "")} == {"1", "2"}
    ids = [e["attrs"]["id"] for e in dom.elements if "id" in e["attrs"]]
    assert len(ids) == len(set(ids))


def test_html_failing_cell_details_in_dom():
    dom = _Dom(render_html(sample_records()))
    cells = {(c["attrs"]["data-world"], c["attrs"]["data-layout"], c["attrs"]["data-target"]): c for c in _cells(dom)}
    broken = dom.by_id(cells[("2", "dp=2 fsdp", "broken")]["attrs"]["data-details"])
    text = _Dom.text(broken)
    assert broken["attrs"]["hidden"] is None  # present, hidden until opened
    assert "norm reported/true rank 0: 0.696606, rank 1: 0.717454" in text
    assert "agree ranks report 0: 19.3713, 1: 19.9511" in text and SIG_LOCAL in text
    assert "L2 · fp32 · x0.5" in text  # the bound as the console labels it
    assert {e["attrs"]["data-check"] for e in dom.find(class_="check failed")} >= {"norm", "agree", "crash", "not_run"}
    crashy = _Dom.text(dom.by_id(cells[("2", "dp=2 fsdp", "crashy")]["attrs"]["data-details"]))
    assert "crash rank 1 exited with signal 11" in crashy and "rank 1: Traceback" in crashy
    assert "RuntimeError: boom <oops>" in crashy and REPLAY in crashy
    skip = _Dom.text(dom.by_id(cells[("2", "dp=2 fsdp", "skipper")]["attrs"]["data-details"]))
    assert "skipped: needs 4 ranks" in skip
    assert dom.by_id("details-panel")["attrs"]["data-open"] == ""
    meta_rows = dom.find(class_="meta-failed")
    assert [r["attrs"]["data-target"] for r in meta_rows] == ["broken"]


def test_html_a_framework_fail_shows_its_finding_and_who_reaches_it():
    finding = {"upstream": None, "note": "halves it", "reach": "stock", "how": "the trainer's default config",
               "owner": None, "repro": "scenarios/fw/repro_half.py", "text": "new finding: halves it"}
    recs = [case("fw", verdict="FAIL", ratio=0.5, failed=[("norm", "")], framework="fw 1.0", finding=finding),
            case("fw", layout="dp=2 replicated", verdict="FAIL", ratio=0.5, failed=[("norm", "")],
                 framework="fw 1.0", finding=dict(finding, reach="synthetic", how="no path", text="synthetic: x"))]
    dom = _Dom(render_html(recs))
    (stock_box,) = dom.find(class_="finding", data_reach="stock")
    assert "new finding: halves it" in _Dom.text(stock_box) and "the trainer's default config" in _Dom.text(stock_box)
    assert "scenarios/fw/repro_half.py" in _Dom.text(stock_box)
    (synthetic_box,) = dom.find(class_="finding", data_reach="synthetic")
    assert "repro_half" not in _Dom.text(synthetic_box)  # nobody reaches it: nothing to file upstream


def test_html_escapes_everything_and_is_self_contained():
    recs = sample_records()
    recs.append(case('t"><img src=x onerror=alert(1)>', layout="<b>bold</b> & 'quoted'", verdict="FAIL", ratio=0.5,
                     failed=[("norm", "<i>detail</i>")], signature=["<sig & more>"],
                     replay="echo '<x>' && rm -rf \"$Y\""))
    page = render_html(recs, title="<title> & co", generated="<now>")
    for raw in ("<script>alert('x')</script>", "<img src=x", "<b>bold</b>", "<i>detail</i>", "<sig & more>",
                "<title> & co", "<now>", "<oops>", "echo '<x>'"):
        assert raw not in page
    assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in page
    assert "&lt;sig &amp; more&gt;" in page and "&lt;title&gt; &amp; co" in page
    # self-contained: one inline script, and no element that loads anything (the escaped text above
    # still reads "src=x", so look at the parsed elements, not at the bytes)
    dom = _Dom(page)
    assert [e["attrs"] for e in dom.elements if e["tag"] == "script"] == [{}]
    assert [e for e in dom.elements if e["tag"] in ("link", "img", "iframe", "object", "embed")] == []
    assert [e for e in dom.elements if {"src", "href", "srcset"} & set(e["attrs"])] == []
    assert not re.search(r"https?://|@import|url\(", page)


def test_html_deterministic_empty_and_odd_inputs(tmp_path):
    recs = sample_records()
    assert render_html(recs, generated="x") == render_html(copy.deepcopy(recs), generated="x")
    empty = render_html([])
    assert 'id="no-cases"' in empty and 'data-cases="0"' in empty
    assert 'class="generated"' not in empty  # no timestamp unless one is given
    skips = _Dom(render_html([case("s", verdict="SKIP", ratio=None, skip_reason="why")] * 2))
    (cell,) = _cells(skips)
    assert cell["attrs"]["data-verdict"] == "SKIP" and _Dom.text(cell) == "skip ×2"
    sparse = render_html([{"type": "case"}, {"type": "case", "verdict": "PASS", "ratio": "inf", "checks": None,
                                             "errors": "a string", "reported": 3.0, "signature": None}])
    assert sparse.count('class="cell ') == 1  # both land on the one ('?', ...) cell
    many = [case(f"target-{i:03d}", layout=f"{LONG}-{j}", verdict="FAIL" if (i + j) % 7 == 0 else "PASS",
                 ratio=0.5 if (i + j) % 7 == 0 else 1.0, failed=[("norm", "x")] if (i + j) % 7 == 0 else ())
            for i in range(40) for j in range(12)]
    assert len(_cells(_Dom(render_html(many)))) == 480
    out = tmp_path / "deep" / "er" / "report.html"
    write_html(recs, out, generated="fixed")
    assert out.read_text(encoding="utf-8") == render_html(recs, generated="fixed")
    write_html(recs, out)  # a timestamp by default
    assert re.search(r"generated \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", out.read_text(encoding="utf-8"))


def test_html_a_wide_world_is_cut_into_blocks_that_keep_every_cell_once():
    """A world size with more layouts than a block holds (``MAX_COLUMNS``) is cut into even parts, each
    a table with the world's head and every target's row; each cell is in one of them, and a layout's
    header reads its label (pieces that break after = / , : -, words apart by spaces)."""
    from harness.report.html import MAX_COLUMNS

    n = 2 * MAX_COLUMNS + 2
    labels = [f"dp_replicate={i} plan=qwen3_moe/plain,x:y {LONG}" for i in range(n)]
    recs = [case(target, layout=label, world=4) for label in labels for target in ("reference", "torch")]
    recs.append(case("reference", layout="dp=2 fsdp", world=2))
    dom = _Dom(render_html(recs))
    heads = [e for e in dom.elements if "world-head" in e["attrs"].get("class", "").split()]
    sizes = [n // 3 + (i < n % 3) for i in range(3)]  # three parts, as even as can be
    assert [(h["attrs"]["data-world"], h["attrs"]["data-part"], h["attrs"]["colspan"]) for h in heads] == [
        ("2", "1", "1")] + [("4", str(i + 1), str(size)) for i, size in enumerate(sizes)]
    assert "part 2 of 3" in _Dom.text(heads[2]) and "part" not in _Dom.text(heads[0])
    assert len(dom.find(class_="heatmap")) == 4
    rows = [e for e in dom.elements if e["tag"] == "tr" and "data-target" in e["attrs"]]
    assert [r["attrs"]["data-target"] for r in rows] == ["reference", "torch"] * 4  # every target in every block
    cells = _cells(dom)
    assert len(cells) == len({c["attrs"]["id"] for c in cells}) == 2 * n + 1
    layout_heads = [e for e in dom.elements if e["tag"] == "th" and "layout" in e["attrs"].get("class", "").split()]
    assert [_Dom.text(h) for h in layout_heads] == ["dp=2 fsdp"] + labels
    assert [h["attrs"]["title"] for h in layout_heads] == ["dp=2 fsdp"] + labels
    page = render_html(recs)
    assert "<span>dp_replicate=</span><wbr><span>0</span>" in page
    assert "<span>plan=</span><wbr><span>qwen3_moe/</span><wbr><span>plain,</span><wbr><span>x:</span><wbr><span>y</span>" in page


def test_html_ratio_near_one_shows_its_deviation():
    dom = _Dom(render_html([case("t", verdict="FAIL", ratio=1.00002, failed=[("norm", "")]),
                            case("u", verdict="PASS", ratio=1.00002)]))
    assert [_Dom.text(c) for c in _cells(dom)] == ["1+2.0e-05", "1.000"]


# ----------------------------------------------------------------------------------- headless chrome

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHECKOUT_RESULTS = Path(__file__).resolve().parents[1] / "results"
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary on PATH (Debian: .ci/install-browser, or apt-get install chromium)")


def _chromium(url: str, profile: Path, *args: str) -> str:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--hide-scrollbars", f"--user-data-dir={profile}", "--virtual-time-budget=2000", *args, url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@needs_chromium
def test_browser_renders_cells_and_opens_a_failing_cell(tmp_path):
    start = time.perf_counter()
    results = tmp_path / "results"
    page = results / "report.html"
    write_html(sample_records(), page, title="clipcheck matrix (test)", generated="2025-01-02 03:04:05 UTC")
    url = page.resolve().as_uri()
    profile = tmp_path / "chromium-profile"

    # after the page's JS ran: every cell there, nothing open
    dom = _Dom(_chromium(url, profile, "--dump-dom"))
    cells = _cells(dom)
    assert len(cells) == len(_cells(_Dom(page.read_text(encoding="utf-8"))))
    failing = [c for c in cells if c["attrs"]["data-verdict"] == "FAIL" and c["attrs"]["data-target"] == "broken"]
    (cell,) = failing
    assert dom.by_id("details-panel")["attrs"]["data-open"] == ""
    assert "hidden" in dom.by_id(cell["attrs"]["data-details"])["attrs"]

    def assert_open(dom: _Dom) -> None:
        panel = dom.by_id("details-panel")
        assert panel["attrs"]["data-open"] == cell["attrs"]["id"] and "open" in panel["attrs"]["class"].split()
        details = dom.by_id(cell["attrs"]["data-details"])
        assert "hidden" not in details["attrs"]
        text = _Dom.text(details)
        assert "norm reported/true rank 0: 0.696606" in text and "agree ranks report" in text  # its checks
        assert SIG_LOCAL in text and REPLAY_BROKEN in text  # its signature and replay command
        assert "selected" in dom.by_id(cell["attrs"]["id"])["attrs"]["class"].split()
        # every other cell's details stay hidden
        shown = [e for e in dom.elements
                 if "detail" in e["attrs"].get("class", "").split() and "hidden" not in e["attrs"]]
        assert len(shown) == 1

    # opened by a click event on the cell's button (#click= dispatches it once the page has loaded)
    assert_open(_Dom(_chromium(f"{url}#click={cell['attrs']['id']}", profile, "--dump-dom")))

    # opened by the URL fragment: a crash's replay command renders in its details
    crashy = next(c for c in cells
                  if c["attrs"]["data-target"] == "crashy" and c["attrs"]["data-layout"] == "dp=2 fsdp")
    opened = _Dom(_chromium(f"{url}#open={crashy['attrs']['id']}", profile, "--dump-dom"))
    assert opened.by_id("details-panel")["attrs"]["data-open"] == crashy["attrs"]["id"]
    assert "hidden" not in opened.by_id(crashy["attrs"]["data-details"])["attrs"]
    assert REPLAY in _Dom.text(opened.by_id(crashy["attrs"]["data-details"]))

    shot = results / "report.png"
    _chromium(f"{url}#open={cell['attrs']['id']}", profile, f"--screenshot={shot}", "--window-size=1400,900")
    assert _png_size(shot) == (1400, 900) and shot.stat().st_size > 20_000
    if CHECKOUT_RESULTS.is_dir():  # keep it where CI collects results; never create the folder
        shutil.copyfile(shot, CHECKOUT_RESULTS / "report-screenshot.png")
    print(f"browser test: {time.perf_counter() - start:.1f} s, screenshot {shot}")


def default_matrix_records() -> tuple[list[dict], dict[str, list[tuple[str, str]]]]:
    """A record per case of the default matrix on CPU (gloo) at worlds 1, 2, 4 and 8, as the planner
    lays them out (nothing run): PASS, or FAIL at 0.707107 with a signature for every fifth case of a
    target other than the reference. Also each scenario's (world, layout label) columns, in order.

    Planned with an absolute bound, which spares computing every layout's true norm (the layouts are
    the same); each planned case then makes a record per clip ratio of the matrix, as a run does."""
    spec = load_matrix(default_matrix_path())
    records, columns = [], {}
    for world in (1, 2, 4, 8):
        for planned in plan_cases(spec.merged({"max_norm": 1.0}), world, "gloo").cases:
            for clip_ratio in spec.clip_ratios:
                bad = planned.target != "reference" and (len(records) % 5 == 0)
                records.append(case(planned.target, scenario=planned.scenario, layout=planned.variant.label,
                                    world=world, norm=planned.norm_label, dtype=planned.injection.dtype,
                                    verdict="FAIL" if bad else "PASS", ratio=0.707107 if bad else 1.0,
                                    failed=[("norm", "reported/true 0.707107")] if bad else (),
                                    signature=["0.707107 = 1/sqrt(2): a group counted once instead of ep_size "
                                               "times"] if bad else (), index=len(records),
                                    norm_type=planned.norm_type, max_norm=clip_ratio * 27.8, clip_ratio=clip_ratio,
                                    seed=planned.injection.seed))
            label = (str(world), planned.variant.label)
            if label not in columns.setdefault(planned.scenario, []):
                columns[planned.scenario].append(label)
    return records, columns


# Measures the page as laid out at the window's width, once it has loaded, and writes what it found
# into the page (as JSON in <pre id="layout-probe">) for --dump-dom: every layout header of every
# scenario within the window, not in a table that scrolls, its label inside its column, no piece of
# a label (a <span> between two <wbr>) cut across lines, no two headers overlapping, and no target
# name or cell text wider than its box.
LAYOUT_PROBE = """<script>
window.addEventListener('load', function () {
  var W = window.innerWidth, out = {width: W, scrollWidth: document.documentElement.scrollWidth, sections: {}};
  function box(el) { var r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; }
  document.querySelectorAll('section.scenario').forEach(function (section) {
    var found = {columns: [], problems: [], spare: W}, heads = [];
    section.querySelectorAll('.block').forEach(function (block) {
      var b = box(block);
      if (block.scrollWidth > block.clientWidth) found.problems.push('a block scrolls sideways');
      if (b[0] < 0 || b[2] > W) found.problems.push('a block outside the window: ' + b);
      found.spare = Math.min(found.spare, W - b[2]);
    });
    section.querySelectorAll('th.layout').forEach(function (th) {
      var t = box(th), label = th.querySelector('.label'), l = label ? box(label) : t;
      var name = th.getAttribute('data-world') + ' ' + th.textContent;
      found.columns.push([th.getAttribute('data-world'), th.textContent]);
      heads.push([name, t]);
      if (t[0] < 0 || t[2] > W) found.problems.push('outside the window: ' + name);
      if (th.scrollWidth > th.clientWidth || l[0] < t[0] - 0.5 || l[2] > t[2] + 0.5)
        found.problems.push('wider than its column: ' + name);
      if (parseFloat(getComputedStyle(th).fontSize) < 10) found.problems.push('font under 10px: ' + name);
      th.querySelectorAll('.word > span').forEach(function (piece) {
        if (piece.getClientRects().length !== 1) found.problems.push('"' + piece.textContent + '" cut in ' + name);
      });
    });
    for (var i = 0; i < heads.length; i++) for (var j = i + 1; j < heads.length; j++) {
      var a = heads[i][1], c = heads[j][1];
      if (Math.min(a[2], c[2]) - Math.max(a[0], c[0]) > 0.5 && Math.min(a[3], c[3]) - Math.max(a[1], c[1]) > 0.5)
        found.problems.push('overlap: ' + heads[i][0] + ' / ' + heads[j][0]);
    }
    section.querySelectorAll('th.target, td.cell button').forEach(function (el) {
      if (el.scrollWidth > el.clientWidth + 0.5) found.problems.push('text wider than its box: ' + el.textContent);
    });
    out.sections[section.getAttribute('data-scenario')] = found;
  });
  var pre = document.createElement('pre');
  pre.id = 'layout-probe';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""

WIDTH = 1280
SCROLLBAR = 16
"""A classic vertical scrollbar's width (headless Chromium hides it): the widest block leaves this much."""


@needs_chromium
def test_browser_default_matrix_page_reads_at_1280px_without_scrolling_sideways(tmp_path):
    """The default matrix's page (xorl_ep_lora's forty-odd layouts at worlds 1-8, labels up to 75
    characters) in Chromium at 1280 px: the page never scrolls sideways, every layout's header is in
    the window with its label whole inside its column, and the screenshot shows it (printed where it
    is)."""
    records, columns = default_matrix_records()
    assert len(columns["xorl_ep_lora"]) >= 25 and max(len(label) for _, label in columns["xorl_ep_lora"]) > 60
    page = tmp_path / "report.html"
    write_html(records, page, title="clipcheck default matrix (test)", generated="2025-01-02 03:04:05 UTC")
    profile = tmp_path / "chromium-profile"
    shot = tmp_path / "report-default-matrix.png"
    _chromium(page.resolve().as_uri(), profile, f"--screenshot={shot}", f"--window-size={WIDTH},2400")
    where = f"(the page: {page}; its screenshot at {WIDTH} px: {shot})"
    assert shot.is_file() and _png_size(shot) == (WIDTH, 2400), where
    assert shot.stat().st_size > 60_000, f"an empty-looking screenshot {where}"
    if CHECKOUT_RESULTS.is_dir():  # keep it where CI collects results; never create the folder
        shutil.copyfile(shot, CHECKOUT_RESULTS / "report-default-matrix.png")

    probed = tmp_path / "probed.html"
    probed.write_text(page.read_text(encoding="utf-8").replace("</body>", LAYOUT_PROBE + "</body>"), encoding="utf-8")
    dom = _chromium(probed.resolve().as_uri(), profile, "--dump-dom", f"--window-size={WIDTH},2400")
    match = re.search(r'<pre id="layout-probe">(.*?)</pre>', dom, re.S)
    assert match, f"the probe did not run {where}"
    found = json.loads(html.unescape(match.group(1)))
    assert found["width"] == WIDTH, where
    assert found["scrollWidth"] <= WIDTH, f"the page scrolls sideways: {found['scrollWidth']} px {where}"
    assert set(found["sections"]) == set(columns), where
    problems = []
    for scenario, planned in columns.items():
        section = found["sections"][scenario]
        if sorted(map(tuple, section["columns"])) != sorted(planned):
            problems.append(f"{scenario}: the columns are not the planned layouts")
        if section["spare"] < SCROLLBAR:
            problems.append(f"{scenario}: a block ends {section['spare']:.0f} px from the window's edge")
        problems += [f"{scenario}: {problem}" for problem in section["problems"]]
    assert not problems, "\n".join(problems[:40]) + f"\n{len(problems)} problems {where}"
    xorl = found["sections"]["xorl_ep_lora"]["columns"]
    assert [tuple(c) for c in xorl] == columns["xorl_ep_lora"]  # its columns in the planned order
    print(f"default matrix page: {len(records)} cases, xorl_ep_lora {len(xorl)} columns; screenshot {shot}")
