"""Views of a matrix run that people would rather look at than read: a compact text summary and one
static HTML page, both built from the record dicts of a results JSON Lines file (``case_json`` and
``metamorphic_json`` in reporter.py). Pure functions on lists of dicts; no torch.

``compact_summary(records)``: one aligned row per (target, scenario) with its passed / failed /
errors / skipped counts, its failed metamorphic groups, the worst failing ratio and the signature
seen most often among its failures.

``render_html(records)`` / ``write_html(records, path)``: a self-contained page (inline CSS and JS,
nothing fetched): a heatmap per scenario, targets as rows and layouts as columns grouped by world size,
each cell the worst of the cases it holds (norm types, dtypes, bounds), coloured by verdict; clicking a
cell opens its cases' failed checks, signatures, errors and replay commands in a side panel. The URL
fragment ``#open=<cell id>`` opens a cell on load, so a link or a headless browser can show one;
``#click=<cell id>`` clicks the cell's button on load (what a headless check uses to drive the click
handler itself).

Records may lack fields or carry unknown ones; a ratio may be a float, null, or "nan"/"inf"/"-inf".
"""

from __future__ import annotations

import hashlib
import html
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, cast

from harness.judge.verdicts import count
from harness.report.failures import replay_command
from harness.report.safe_text import lines

# how bad a verdict is when cases are aggregated into one cell; an unknown verdict counts as an error
_RANK = {"SKIP": 0, "PASS": 1, "FAIL": 2, "ERROR": 3}
_CLASS = {"PASS": "v-pass", "FAIL": "v-fail", "ERROR": "v-error", "SKIP": "v-skip"}
_NO_VERDICT = "v-skip"  # the overall "NOTHING JUDGED" (every case skipped, or none at all)


# ----------------------------------------------------------------------------------------- records

def _cases(records: Iterable[Any]) -> list[dict[str, Any]]:
    return [r for r in records if isinstance(r, dict) and r.get("type", "case") == "case"]


def _groups(records: Iterable[Any]) -> list[dict[str, Any]]:
    return [r for r in records if isinstance(r, dict) and r.get("type") == "metamorphic"]


def _verdict(rec: dict[str, Any]) -> str:
    v = rec.get("verdict")
    return v if v in _RANK else "ERROR"


def _failing(rec: dict[str, Any]) -> bool:
    return _verdict(rec) in ("FAIL", "ERROR")


def _text(x: Any, default: str = "?") -> str:
    """A record's field as text; control characters escaped (a record may come from anyone's file)."""
    return default if x is None else lines(x)


def _ratio(x: Any) -> float | None:
    """The ratio as a float (NaN and infinities included), or None where there is none."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return None


def _deviation(r: float | None) -> float | None:
    """How far a ratio is from 1.0, symmetric in over- and under-reporting (|log r|); a non-finite or
    non-positive ratio is infinitely far; None where there is no ratio."""
    if r is None:
        return None
    if not math.isfinite(r) or r <= 0:
        return math.inf
    return abs(math.log(r))


def _checks(rec: dict[str, Any]) -> list[tuple[str, bool, str]]:
    checks = rec.get("checks")
    if not isinstance(checks, dict):
        return []
    out = []
    for name, c in checks.items():
        if isinstance(c, dict):
            out.append((str(name), bool(c.get("passed", False)), _text(c.get("detail"), "")))
        else:
            out.append((str(name), bool(c), ""))
    return out


def _failed_checks(rec: dict[str, Any]) -> list[tuple[str, str]]:
    return [(name, detail) for name, passed, detail in _checks(rec) if not passed]


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


def _signatures(rec: dict[str, Any]) -> list[str]:
    return [str(s) for s in _as_list(rec.get("signature")) if s not in (None, "")]


def _errors(rec: dict[str, Any]) -> list[tuple[int | None, str]]:
    """(rank, message) for every error the record carries; a per-rank list gives ranks."""
    errs = rec.get("errors")
    if isinstance(errs, (list, tuple)):
        return [(i, str(e)) for i, e in enumerate(errs) if e not in (None, "")]
    if errs in (None, ""):
        return []
    return [(None, str(errs))]


def _raised(rec: dict[str, Any]) -> bool:
    return _verdict(rec) == "ERROR" or bool(_errors(rec))


def _fmt_ratio(x: Any) -> str:
    """The console's way: %.6f, the non-finite spelled out, '-' for none."""
    r = _ratio(x)
    if r is None:
        return "-"
    return f"{r:.6f}" if math.isfinite(r) else str(r)


def _fmt_num(x: Any) -> str:
    r = _ratio(x)
    if r is None:
        return "-" if x is None else str(x)
    return f"{r:.7g}" if math.isfinite(r) else str(r)


def _sort_key(x: Any) -> tuple[int, Any]:
    return (0, x) if isinstance(x, (int, float)) and not isinstance(x, bool) else (1, str(x))


def _clip(s: str, width: int) -> str:
    s = " ".join(s.split())
    if len(s) <= width:
        return s
    return s[: max(width - 1, 0)] + "…"


# ------------------------------------------------------------------------------------ text summary

def _worst_failing(cases: list[dict[str, Any]]) -> str:
    failing = [r for r in cases if _failing(r)]
    if not failing:
        return "-"
    devs = [(d, r) for r in failing if (d := _deviation(_ratio(r.get("ratio")))) is not None]
    if devs:
        worst = max(devs, key=lambda p: p[0])[1]  # max keeps the first of equals: input order
        return _fmt_ratio(worst.get("ratio"))
    return "raised" if any(_raised(r) for r in failing) else "-"


def _common_signature(cases: list[dict[str, Any]]) -> tuple[str, int]:
    """The signature seen most often among the failures (else the first error, else the failed
    checks), and how many other distinct signatures there were."""
    failing = [r for r in cases if _failing(r)]
    sigs = Counter(s for r in failing for s in dict.fromkeys(_signatures(r)))
    if sigs:
        top = sigs.most_common(1)[0][0]
        return top, len(sigs) - 1
    errs = [msg for r in failing for _, msg in _errors(r)]
    if errs:
        first = next((line for line in errs[0].splitlines() if line.strip()), errs[0])
        return f"error: {first.strip()}", 0
    checks = Counter(", ".join(n for n, _ in _failed_checks(r)) for r in failing)
    checks.pop("", None)
    if checks:
        return f"failed: {checks.most_common(1)[0][0]}", 0
    return "-", 0


def compact_summary(records: Iterable[Any], width: int = 120) -> list[str]:
    """One aligned row per (target, scenario), sorted by target then scenario, under a header:
    cases passed / failed / harness errors / skipped, failed/all metamorphic groups, the worst ratio
    among failing cases (farthest from 1.0 as |log ratio|, non-finite farthest; "raised" where they
    raised without one, "-" where none failed), and the signature most common among the failures
    ("(+N)" counts the other signatures seen). When every signature fits whole on its row within
    ``width`` columns it is a last column; otherwise each failing row's signature
    follows it on an indented line of its own, cut to ``width``."""
    records = list(records)
    rows: dict[tuple[str, str], dict[str, Any]] = {}

    def row(rec: dict[str, Any]) -> dict[str, Any]:
        key = (_text(rec.get("target")), _text(rec.get("scenario")))
        return rows.setdefault(key, {"cases": [], "groups": []})

    for rec in _cases(records):
        row(rec)["cases"].append(rec)
    for rec in _groups(records):
        row(rec)["groups"].append(rec)

    header = ["target", "scenario", "pass", "fail", "error", "skip", "meta", "worst"]
    table: list[list[str]] = []
    for (target, scenario), data in sorted(rows.items()):
        cases, groups = data["cases"], data["groups"]
        c = count(cases + groups)
        meta = f"{c.metamorphic_failed}/{c.metamorphic_groups}" if groups else "-"
        sig, others = _common_signature(cases)
        table.append([target, scenario, str(c.passed), str(c.failed), str(c.errors), str(c.skipped), meta, _worst_failing(cases), sig + (f" (+{others})" if others else "")])
    if not table:
        return ["  ".join(header), "(no cases)"]

    # the target and scenario are never cut: two targets of one file differ only at the end
    caps = [None, None, 6, 6, 6, 6, 7, 12]
    widths = [min(max(len(header[i]), *(len(t[i]) for t in table)), caps[i] or 10**6) for i in range(8)]
    right = {2, 3, 4, 5, 6}

    def cols(values: list[str]) -> str:
        cells = []
        for i, w in enumerate(widths):
            text = _clip(values[i], w)
            cells.append(text.rjust(w) if i in right else text.ljust(w))
        return "  ".join(cells)

    prefix = sum(widths) + 2 * len(widths)
    sig_room = width - prefix
    if all(len(t[8]) <= sig_room for t in table):
        # every signature fits whole on its row: a signature column
        return [cols(header) + "  signature"] + [(cols(t) + "  " + t[8]).rstrip() for t in table]
    # else each failing row's signature goes whole (up to the width) on an indented line under it
    out = [cols(header).rstrip()]
    for t in table:
        out.append(cols(t).rstrip())
        if t[8] != "-":
            out.append("    " + _clip(t[8], max(width - 4, 40)))
    return out


# -------------------------------------------------------------------------------------------- html

def _e(x: Any) -> str:
    return html.escape(_text(x, ""), quote=True)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _tally(cases: list[dict[str, Any]]) -> str:
    c = count(cases)
    return ", ".join(f"{n} {word}" for n, word in ((c.passed, "pass"), (c.failed, "fail"), (c.errors, "error"),
                                                   (c.skipped, "skip")) if n)


def _slug(x: Any, limit: int = 24) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", _text(x).lower()).strip("-")
    return s[:limit].strip("-") or "x"


def _cell_id(world: Any, backend: Any, scenario: Any, layout: Any, target: Any) -> str:
    """Stable across runs, so ``#open=<id>`` links keep working: readable slugs plus a hash of the
    exact key, so labels that slug alike (``dp=2 fsdp`` / ``dp-2 fsdp``) still differ."""
    key = "\x1f".join(_text(x) for x in (world, backend, scenario, layout, target))
    digest = hashlib.sha1(key.encode("utf-8")).hexdigest()[:8]
    return (f"cell-w{_slug(world, 8)}-{_slug(backend, 8)}-{_slug(scenario, 20)}-{_slug(layout, 32)}"
            f"-{_slug(target, 24)}-{digest}")


def _details_id(cell_id: str) -> str:
    return "details-" + cell_id.removeprefix("cell-")


def _case_sort(rec: dict[str, Any]) -> tuple[float, float]:
    """Worst first: by verdict, then by how far the ratio is from 1.0."""
    d = _deviation(_ratio(rec.get("ratio")))
    return (-_RANK[_verdict(rec)], -(d if d is not None else -1.0))


def _short_ratio(rec: dict[str, Any]) -> str:
    """What a cell shows: 3-4 digits of the ratio. A failing ratio that rounds to 1.000 shows its
    deviation instead, or a red cell would read as fine; without a ratio, the first failed check
    (crash, hang, not_run ...) says why."""
    r = _ratio(rec.get("ratio"))
    verdict = _verdict(rec)
    if r is None:
        names = [n for n, _ in _failed_checks(rec)]
        if names and verdict in ("FAIL", "ERROR"):
            return _clip(names[0], 9)
        return {"SKIP": "skip", "FAIL": "fail", "ERROR": "error"}.get(verdict, "—")
    if not math.isfinite(r):
        return str(r)
    s = f"{r:.3f}" if 0.001 <= abs(r) < 1000 else f"{r:.3g}"
    if s == "1.000" and r != 1.0 and verdict == "FAIL":
        s = f"1{r - 1:+.1e}"
    return s


def _cell_count(cases: list[dict[str, Any]]) -> str:
    """A cell's second line: how many of its cases failed, or how many it holds; nothing for a lone
    case, whose colour already says it all."""
    n, n_fail = len(cases), sum(_failing(r) for r in cases)
    if n == 1:
        return ""
    return f"{n_fail}/{n} fail" if n_fail else f"×{n}"


def _severity(rec: dict[str, Any]) -> float:
    """0..1 for the red's depth: orders of magnitude of the deviation, 1e-6 light to 1 dark, so a
    rounding-size miss and a missing all-reduce do not look alike."""
    d = _deviation(_ratio(rec.get("ratio")))
    if d is None or math.isinf(d):
        return 1.0
    if d <= 0:
        return 0.15
    return round(min(1.0, max(0.15, (math.log10(d) + 6) / 6)), 3)


def _bound(rec: dict[str, Any]) -> str | None:
    """The clipping bound as the console labels it: ``x0.5`` relative to the true norm, else the
    absolute max_norm; None where the record has neither."""
    ratio = _ratio(rec.get("clip_ratio"))
    if ratio is not None:
        return f"x{ratio:g}"
    return None if rec.get("max_norm") is None else f"max_norm {_fmt_num(rec.get('max_norm'))}"


def _case_title(rec: dict[str, Any]) -> str:
    parts = [_text(rec.get("norm")), _text(rec.get("dtype")), _bound(rec)]
    return " · ".join(p for p in parts if p)


def _facts(rec: dict[str, Any]) -> list[tuple[str, str]]:
    """The numbers someone debugging a failure wants next to its checks."""
    facts = []
    if "true_norm" in rec:
        facts.append(("true norm", _fmt_num(rec.get("true_norm"))))
    reported = _as_list(rec.get("reported"))
    if reported:
        facts.append(("reported", ", ".join(f"rank {i}: {_fmt_num(v)}" for i, v in enumerate(reported))))
    if rec.get("tolerance") is not None:
        facts.append(("tolerance", _fmt_num(rec["tolerance"])))
    for key in ("seed", "framework"):
        if rec.get(key) is not None:
            facts.append((key, _text(rec[key])))
    return facts


def _replay(rec: dict[str, Any]) -> str | None:
    """The failing case's ``clipcheck run`` command (a fuzz record brings its own ``replay``)."""
    try:
        return replay_command(rec)
    except (KeyError, TypeError, ValueError):  # a record from an older file, without every field
        return None


def _render_case(rec: dict[str, Any]) -> str:
    """One case in a cell's details: verdict, facts, failed checks, signatures, errors, replay."""
    verdict = _verdict(rec)
    cls = _CLASS[verdict]
    out = [f'<article class="case {cls}" data-verdict="{verdict}">'
           f'<h4><span class="badge {cls}">{_e(_text(rec.get("verdict")))}</span> {_e(_case_title(rec))}'
           f' <span class="case-ratio">ratio {_e(_fmt_ratio(rec.get("ratio")))}</span></h4>']
    facts = _facts(rec)
    if facts and verdict != "PASS":
        out.append('<dl class="facts">' + "".join(f"<dt>{_e(k)}</dt> <dd>{_e(v)}</dd> " for k, v in facts)
                   + "</dl>")
    failed = _failed_checks(rec)
    if failed:
        out.append('<ul class="checks">' + "".join(
            f'<li class="check failed" data-check="{_e(n)}"><code>{_e(n)}</code> {_e(d)}</li>' for n, d in failed)
            + "</ul>")
    elif verdict == "PASS" and _checks(rec):
        out.append(f'<p class="quiet">{_plural(len(_checks(rec)), "check")} passed</p>')
    sigs = _signatures(rec)
    if sigs:
        out.append('<div class="signatures"><h5>signature</h5><ul>'
                   + "".join(f'<li class="signature">{_e(s)}</li>' for s in sigs) + "</ul></div>")
    errs = _errors(rec)
    if errs:
        out.append('<div class="errors"><h5>errors</h5>' + "".join(
            f'<pre class="error">{"" if rank is None else f"rank {rank}: "}{_e(msg)}</pre>' for rank, msg in errs)
            + "</div>")
    if verdict == "SKIP" and rec.get("skip_reason"):
        out.append(f'<p class="skip-reason">skipped: {_e(rec["skip_reason"])}</p>')
    finding = rec.get("finding")
    if verdict == "FAIL" and isinstance(finding, dict):
        repro = finding.get("repro") if finding.get("reach") != "synthetic" else None
        out.append(f'<div class="finding" data-reach="{_e(_text(finding.get("reach")))}"><h5>finding '
                   f'<span class="reach">{_e(_text(finding.get("reach")))}</span></h5>'
                   f'<p>{_e(_text(finding.get("text")))}</p>'
                   f'<p class="quiet">who reaches it: {_e(_text(finding.get("how")))}</p>'
                   + (f'<p class="quiet">reproduce without clipcheck: <code>{_e(_text(repro))}</code></p>'
                      if repro else "") + "</div>")
    elif verdict == "FAIL" and rec.get("synthetic"):
        out.append(f'<p class="quiet">synthetic layout (no known path reaches it: {_e(_text(rec["synthetic"]))})</p>')
    replay = rec.get("replay") or (_replay(rec) if verdict in ("FAIL", "ERROR") else None)
    if isinstance(replay, str) and replay.strip():
        out.append('<div class="replay"><h5>replay <button type="button" class="copy" '
                   'title="copy to the clipboard">copy</button></h5>'
                   f'<pre><code>{_e(replay)}</code></pre></div>')
    return "".join(out) + "</article>"


def _render_details(cell_id: str, key: tuple[Any, ...], cases: list[dict[str, Any]]) -> str:
    """A cell's cases, worst first, in a section of the side panel; hidden until the cell opens it
    (shown anyway without JS, see the page's noscript style)."""
    world, backend, scenario, layout, target = key
    body = "".join(_render_case(r) for r in sorted(cases, key=_case_sort))
    return (f'<section class="detail" id="{_details_id(cell_id)}" data-cell="{cell_id}" hidden>'
            f'<h3>{_e(target)}</h3>'
            f'<p class="where"><span>{_e(scenario)}</span> <span class="layout-name">{_e(layout)}</span> '
            f'<span>world {_e(world)} · {_e(backend)}</span></p>'
            f'<p class="tally">{_plural(len(cases), "case")}: {_e(_tally(cases))}</p>'
            f"{body}</section>")


def _render_cell(cell_id: str, key: tuple[Any, ...], cases: list[dict[str, Any]]) -> str:
    """One heatmap cell: the worst of its cases (verdict colour, ratio) and its failure count. The
    spans are separated by a space so the cell's text reads "0.697 2/2 fail", not "0.6972/2 fail"."""
    world, backend, scenario, layout, target = key
    worst = min(cases, key=_case_sort)
    verdict = _verdict(worst)
    n_fail = sum(_failing(r) for r in cases)
    title = f"{target} · {layout} · world {world}: {verdict.lower()}, worst ratio {_fmt_ratio(worst.get('ratio'))}"
    if len(cases) > 1:
        title += f" over {len(cases)} cases"
    style = f' style="--sev:{_severity(worst)}"' if verdict == "FAIL" else ""
    count = _cell_count(cases)
    return (f'<td class="cell {_CLASS[verdict]}" id="{cell_id}" data-verdict="{verdict}" data-target="{_e(target)}"'
            f' data-layout="{_e(layout)}" data-scenario="{_e(scenario)}" data-world="{_e(world)}"'
            f' data-backend="{_e(backend)}" data-cases="{len(cases)}" data-failing="{n_fail}"'
            f' data-details="{_details_id(cell_id)}"{style}>'
            f'<button type="button" title="{_e(title)}"><span class="r">{_e(_short_ratio(worst))}</span>'
            + (f' <span class="n">{_e(count)}</span>' if count else "") + "</button></td>")


def _render_meta(groups: list[dict[str, Any]]) -> str:
    """A scenario's metamorphic groups: one line when all agree, else a table of those that differ."""
    if not groups:
        return ""
    failed = sorted((g for g in groups if not g.get("passed", False)),
                    key=lambda g: (_sort_key(g.get("world_size", "?")), _text(g.get("target"))))
    if not failed:
        return (f'<p class="meta-ok">metamorphic: {_plural(len(groups), "group")}, '
                "same coefficient across layouts in all</p>")
    rows = []
    for g in failed:
        coeffs = g["coefficients"] if isinstance(g.get("coefficients"), dict) else {}
        nums = {k: v for k, v in coeffs.items() if _ratio(v) is not None}
        spread = ""
        if nums:
            low = min(nums, key=lambda k: cast(float, _ratio(nums[k])))  # nums: the values with a ratio
            high = max(nums, key=lambda k: cast(float, _ratio(nums[k])))
            spread = f"{low}: {_fmt_num(nums[low])} .. {high}: {_fmt_num(nums[high])}"
        cols = [f'{_text(g.get("world_size"))} {_text(g.get("backend"))}', g.get("target"), g.get("norm"),
                g.get("dtype"), g.get("bound")]
        rows.append(f'<tr class="meta-failed" data-target="{_e(g.get("target"))}"'
                    f' data-world="{_e(g.get("world_size"))}">'
                    + "".join(f"<td>{_e(c)}</td>" for c in cols)
                    + f'<td class="num">{len(coeffs)}</td><td class="num">{_e(_fmt_num(g.get("gap")))}</td>'
                    f"<td>{_e(spread)}</td></tr>")
    return (f'<div class="meta"><h3>metamorphic: {len(failed)} of {len(groups)} groups differ across layouts</h3>'
            '<table class="meta-table"><thead><tr><th>world</th><th>target</th><th>norm</th><th>dtype</th>'
            "<th>bound</th><th>layouts</th><th>gap</th><th>lowest .. highest coefficient</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table></div>")


WorldKey = tuple[Any, Any]  # (world_size, backend)


@dataclass
class _Scenario:
    """One scenario's grid, in first-seen order: world-size column groups and their layouts, target
    rows, the cases of each (world, layout, target) cell, and its metamorphic groups."""

    worlds: dict[WorldKey, dict[str, None]] = field(default_factory=dict)
    targets: dict[str, None] = field(default_factory=dict)
    cells: dict[tuple[WorldKey, str, str], list[dict[str, Any]]] = field(default_factory=dict)
    groups: list[dict[str, Any]] = field(default_factory=list)

    def world_keys(self) -> list[WorldKey]:
        return sorted(self.worlds, key=lambda k: (_sort_key(k[0]), _sort_key(k[1])))

    def cases(self, wkey: WorldKey | None = None) -> list[dict[str, Any]]:
        return [r for (wk, _, _), cs in self.cells.items() if wkey in (None, wk) for r in cs]


def _by_scenario(cases: list[dict[str, Any]], groups: list[dict[str, Any]]) -> dict[str, _Scenario]:
    scenarios: dict[str, _Scenario] = {}
    for rec in cases:
        scen = scenarios.setdefault(_text(rec.get("scenario")), _Scenario())
        wkey = (rec.get("world_size", "?"), rec.get("backend", "?"))
        layout, target = _text(rec.get("layout")), _text(rec.get("target"))
        scen.worlds.setdefault(wkey, {}).setdefault(layout)
        scen.targets.setdefault(target)
        scen.cells.setdefault((wkey, layout, target), []).append(rec)
    for g in groups:
        scenarios.setdefault(_text(g.get("scenario")), _Scenario()).groups.append(g)
    return scenarios


def _render_heads(scen: _Scenario) -> str:
    """Two header rows: a column group per world size (red underline when any of it failed), then
    its layouts."""
    heads, subheads = [], []
    for i, wkey in enumerate(scen.world_keys()):
        world, backend = wkey
        wcases = scen.cases(wkey)
        bad = sum(_failing(r) for r in wcases)
        note = f"{bad} of {len(wcases)} fail" if bad else f"{len(wcases)} cases"
        if i:
            heads.append('<th class="gap" rowspan="2"></th>')
        heads.append(f'<th class="world-head{" bad" if bad else ""}" colspan="{len(scen.worlds[wkey])}"'
                     f' scope="colgroup" data-world="{_e(world)}" data-backend="{_e(backend)}">world {_e(world)}'
                     f' <span class="backend">{_e(backend)}</span> <span class="note">{_e(note)}</span></th>')
        subheads += [f'<th class="layout" scope="col" title="{_e(lay)}" data-world="{_e(world)}">'
                     f"<span>{_e(lay)}</span></th>" for lay in scen.worlds[wkey]]
    return (f'<thead><tr><th class="corner" rowspan="2">target</th>{"".join(heads)}</tr>'
            f'<tr>{"".join(subheads)}</tr></thead>')


def _render_row(scenario: str, scen: _Scenario, target: str, panel: list[str]) -> str:
    """A target's row across every world and layout; each filled cell's details go to ``panel``."""
    tds, failing = [], 0
    for i, wkey in enumerate(scen.world_keys()):
        world, backend = wkey
        if i:
            tds.append('<td class="gap"></td>')
        for layout in scen.worlds[wkey]:
            cases = scen.cells.get((wkey, layout, target))
            if not cases:
                tds.append(f'<td class="cell empty" data-verdict="" data-world="{_e(world)}" title="not run"></td>')
                continue
            key = (world, backend, scenario, layout, target)
            cid = _cell_id(*key)
            tds.append(_render_cell(cid, key, cases))
            panel.append(_render_details(cid, key, cases))
            failing += sum(_failing(r) for r in cases)
    return (f'<tr data-target="{_e(target)}" data-failing="{failing}">'
            f'<th class="target" scope="row" title="{_e(target)}">{_e(target)}</th>{"".join(tds)}</tr>')


def _render_scenario(scenario: str, scen: _Scenario, panel: list[str]) -> str:
    """A scenario's heatmap (targets x layouts, grouped by world size) and metamorphic groups."""
    table = ""
    if scen.worlds:
        rows = "".join(_render_row(scenario, scen, t, panel) for t in scen.targets)
        table = (f'<div class="scroll"><table class="heatmap">{_render_heads(scen)}<tbody>{rows}</tbody>'
                 "</table></div>")
    cases = scen.cases()
    return (f'<section class="scenario" id="scenario-{_slug(scenario, 40)}" data-scenario="{_e(scenario)}">'
            f'<h2>{_e(scenario)} <span class="tally">{len(cases)} cases: {_e(_tally(cases) or "no cases")}</span></h2>'
            f"{table}{_render_meta(scen.groups)}</section>")


def _render_header(title: str, generated: str | None, cases: list[dict[str, Any]],
                   groups: list[dict[str, Any]]) -> str:
    """Title with the overall verdict, the totals as chips (also as data- attributes, for scripts),
    the legend and the only-failing filter."""
    counts = count(cases + groups)
    meta_failed = counts.metamorphic_failed
    verdict = counts.word
    chips: list[tuple[str, int | str, str]]
    chips = [("cases", len(cases), "t-cases"), ("passed", counts.passed, "t-pass"),
             ("failed", counts.failed, "t-fail"), ("errors", counts.errors, "t-error"),
             ("skipped", counts.skipped, "t-skip")]
    if groups:
        chips.append(("metamorphic failed", f"{meta_failed}/{len(groups)}", "t-meta" + (" bad" if meta_failed else "")))
    totals = "".join(f'<div class="chip {cls}"><b>{_e(v)}</b> <span>{_e(k)}</span></div>' for k, v, cls in chips)
    when = f'<p class="generated">generated {_e(generated)}</p>' if generated else ""
    return (f'<header id="summary" data-cases="{len(cases)}" data-passed="{counts.passed}"'
            f' data-failed="{counts.failed}" data-errors="{counts.errors}" data-skipped="{counts.skipped}"'
            f' data-metamorphic="{len(groups)}" data-metamorphic-failed="{meta_failed}" data-verdict="{verdict}">'
            f'<div class="title"><h1>{_e(title)} '
            f'<span class="overall {_CLASS.get(verdict, _NO_VERDICT)}">{verdict}</span></h1>'
            f"{when}</div>"
            f'<div class="totals">{totals}</div>'
            '<div class="legend"><span class="sw v-pass"></span>pass <span class="sw v-fail"></span>fail '
            '(deeper red: farther from 1) <span class="sw v-error"></span>harness error <span class="sw v-skip"></span>'
            'skipped <label><input type="checkbox" id="only-failing"> only targets with failures</label></div>'
            '<p class="hint">Each cell: the worst reported/true norm ratio of its cases (norm types, dtypes, bounds) '
            "and how many failed. Click a cell for its checks, signatures, errors and replay command.</p></header>")


def render_html(records: Iterable[Any], title: str = "clipcheck matrix", generated: str | None = None) -> str:
    """The whole page as one string; the same records, title and ``generated`` give the same bytes
    (no timestamp unless ``generated`` is given), so pages of two runs diff cleanly."""
    records = list(records)
    cases, groups = _cases(records), _groups(records)
    panel: list[str] = []
    sections = [_render_scenario(name, scen, panel) for name, scen in _by_scenario(cases, groups).items()]
    main = "".join(sections) or '<p class="empty-run" id="no-cases">No cases in these results.</p>'
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style>"
        '<noscript><style>.detail[hidden]{display:block}#details-panel{position:static;transform:none;'
        "width:auto;box-shadow:none}#details-panel .panel-head{display:none}</style></noscript></head>\n<body>"
        f"{_render_header(title, generated, cases, groups)}\n"
        f'<main id="matrix">{main}</main>\n'
        '<aside id="details-panel" data-open="" aria-label="case details"><div class="panel-head">'
        '<span>details</span><button type="button" id="panel-close" title="close (Esc)">×</button></div>'
        f'<div class="panel-body">{"".join(panel)}</div></aside>\n'
        f"<script>{_JS}</script></body></html>\n"
    )


def write_html(records: Iterable[Any], path: str | os.PathLike[str], title: str = "clipcheck matrix",
               generated: str | None = None) -> Path:
    """Write the page to ``path`` and return it; folders are made as needed, and the page is written
    whole, then renamed into place, so a browser never shows half a page. ``generated`` defaults to
    the current UTC time."""
    if generated is None:
        generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_html(records, title=title, generated=generated), encoding="utf-8")
    os.replace(tmp, path)
    return path


_CSS = """
:root{--pass:#2f9e5b;--fail-h:0;--error:#5b2a86;--skip:#c9ced6;--ink:#1d2330;--muted:#667085;--line:#e4e7ec;
--panel:560px;font-family:system-ui,-apple-system,"Segoe UI","DejaVu Sans","Liberation Sans",sans-serif}
*{box-sizing:border-box}
body{margin:0;color:var(--ink);background:#f6f7f9;font-size:14px;line-height:1.4}
header#summary{background:#fff;border-bottom:1px solid var(--line);padding:18px 28px 12px}
.title{display:flex;align-items:baseline;gap:18px;flex-wrap:wrap}
h1{font-size:22px;margin:0;font-weight:650;letter-spacing:-.01em}
.overall{font-size:12px;vertical-align:middle;padding:3px 9px;border-radius:99px;color:#fff;margin-left:6px;
letter-spacing:.05em}
.generated{margin:0;color:var(--muted);font-size:13px}
.totals{display:flex;gap:10px;margin:14px 0 10px;flex-wrap:wrap}
.chip{border:1px solid var(--line);border-radius:10px;padding:6px 14px;min-width:92px;background:#fff}
.chip b{display:block;font-size:20px;font-variant-numeric:tabular-nums}
.chip span{color:var(--muted);font-size:12px}
.chip.t-pass b{color:var(--pass)}.chip.t-fail b{color:#c8322f}.chip.t-error b{color:var(--error)}
.chip.t-skip b{color:#8a919c}.chip.t-meta.bad b{color:#c8322f}
.legend{display:flex;align-items:center;gap:6px;flex-wrap:wrap;color:var(--muted);font-size:13px}
.legend .sw{display:inline-block;width:14px;height:14px;border-radius:3px;margin-left:10px}
.legend .sw:first-child{margin-left:0}
.legend .sw.v-pass{background:#d3f0dd;border:1px solid #8fd0a7}
.legend .sw.v-skip{background:#eceef1;border:1px solid #c9ced6}
.legend label{margin-left:auto;color:var(--ink);cursor:pointer}
.hint{color:var(--muted);font-size:12.5px;margin:6px 0 0}
main{padding:8px 28px 40px}
body.panel-open main,body.panel-open header#summary{margin-right:min(var(--panel),95vw)}
section.scenario{background:#fff;border:1px solid var(--line);border-radius:12px;padding:12px 16px 14px;
margin:16px 0;max-width:100%}
h2{font-size:15px;margin:0 0 6px;font-weight:650;display:flex;align-items:baseline;gap:10px;
text-transform:uppercase;letter-spacing:.05em;color:#344054}
h2 .tally{font-weight:400;color:var(--muted);font-size:12.5px;margin-left:auto;text-transform:none;letter-spacing:0}
.scroll{overflow-x:auto}
table.heatmap{border-collapse:separate;border-spacing:4px}
table.heatmap th.corner{text-align:right;color:var(--muted);font-weight:500;font-size:12px;vertical-align:bottom;
padding:0 10px 4px 0}
table.heatmap th.world-head{font-size:13px;font-weight:650;text-align:left;padding:4px 6px;border-bottom:2px solid
var(--pass);white-space:nowrap}
table.heatmap th.world-head.bad{border-bottom-color:#d92d20}
table.heatmap th.world-head .backend{font-weight:500;color:var(--muted)}
table.heatmap th.world-head .note{font-weight:500;color:var(--muted);font-size:12px;margin-left:6px}
table.heatmap th.world-head.bad .note{color:#b42318}
table.heatmap .gap{width:10px;min-width:10px;padding:0}
table.heatmap th.layout{font-weight:500;font-size:11.5px;color:#344054;width:7em;min-width:7em;max-width:8.5em;
vertical-align:bottom;text-align:center;padding:2px 2px 1px;overflow-wrap:anywhere;line-height:1.2}
table.heatmap th.target{text-align:right;padding-right:10px;font-weight:550;white-space:nowrap;max-width:20em;
overflow:hidden;text-overflow:ellipsis;position:sticky;left:0;background:#fff;z-index:1}
td.cell{padding:0;height:42px;border-radius:7px;min-width:7em}
td.cell button{all:unset;box-sizing:border-box;display:flex;flex-direction:column;align-items:center;
justify-content:center;width:100%;height:100%;cursor:pointer;border-radius:7px;font-variant-numeric:tabular-nums}
td.cell button:focus-visible{outline:3px solid #2563eb;outline-offset:1px}
td.cell .r{font-size:14.5px;font-weight:600}
td.cell .n{font-size:11px;opacity:.85}
td.cell.empty{background:repeating-linear-gradient(45deg,#f2f4f7,#f2f4f7 4px,#fff 4px,#fff 8px)}
td.cell.selected{box-shadow:0 0 0 3px #2563eb}
.v-pass{background:var(--pass);color:#fff}
td.cell.v-pass{background:#d3f0dd;color:#0f5c31}
td.cell.v-skip{background:#eceef1;color:#5d6573}
.v-fail{background:hsl(var(--fail-h) 70% calc(60% - var(--sev,1) * 22%));color:#fff}
.v-error{background:var(--error);color:#fff}
.v-skip{background:var(--skip);color:#3b4250}
td.cell.v-pass:hover,td.cell.v-fail:hover,td.cell.v-error:hover,td.cell.v-skip:hover{filter:brightness(1.08)}
body.only-failing tr[data-failing="0"]{display:none}
.meta h3{font-size:13px;margin:12px 0 4px;color:#b42318;font-weight:600}
.meta-ok{color:var(--muted);font-size:12.5px;margin:6px 2px}
table.meta-table{border-collapse:collapse;background:#fff;font-size:12.5px}
table.meta-table th,table.meta-table td{border-bottom:1px solid var(--line);padding:4px 10px;text-align:left}
table.meta-table td.num{text-align:right;font-variant-numeric:tabular-nums}
.empty-run{color:var(--muted);font-size:15px;margin:30px 0}
#details-panel{position:fixed;top:0;right:0;bottom:0;width:var(--panel);max-width:95vw;background:#fff;
border-left:1px solid var(--line);box-shadow:-8px 0 24px rgba(16,24,40,.08);transform:translateX(102%);
overflow-y:auto;z-index:10}
#details-panel.open{transform:none}
.panel-head{position:sticky;top:0;background:#fff;display:flex;justify-content:space-between;align-items:center;
padding:10px 18px;border-bottom:1px solid var(--line);color:var(--muted);font-size:12px;text-transform:uppercase;
letter-spacing:.06em;z-index:2}
#panel-close{all:unset;cursor:pointer;font-size:22px;line-height:1;padding:0 4px;color:#344054}
.panel-body{padding:4px 18px 30px}
.detail[hidden]{display:none}
.detail h3{font-size:18px;margin:12px 0 2px}
.detail .where{margin:0 0 4px;color:#475467;display:flex;flex-wrap:wrap;gap:4px 12px;font-size:13px}
.detail .where .layout-name{font-weight:600;color:var(--ink)}
.detail .tally{color:var(--muted);font-size:12.5px;margin:0 0 10px}
article.case{background:#fff;border:1px solid var(--line);border-left:5px solid;border-radius:8px;
padding:8px 12px;margin:8px 0;color:var(--ink)}
article.case.v-pass{border-left-color:var(--pass)}
article.case.v-fail{border-left-color:#d92d20}
article.case.v-error{border-left-color:var(--error)}
article.case.v-skip{border-left-color:var(--skip)}
article.case h4{margin:0;font-size:13.5px;display:flex;align-items:center;gap:8px;font-weight:600}
.badge{font-size:10.5px;padding:1px 7px;border-radius:99px;letter-spacing:.04em}
.case-ratio{margin-left:auto;font-weight:500;color:#475467;font-variant-numeric:tabular-nums}
dl.facts{display:grid;grid-template-columns:auto 1fr;gap:1px 12px;margin:6px 0;font-size:12.5px}
dl.facts dt{color:var(--muted)}dl.facts dd{margin:0;font-variant-numeric:tabular-nums;overflow-wrap:anywhere}
ul.checks{list-style:none;padding:0;margin:6px 0}
li.check{padding:3px 0;font-size:13px;overflow-wrap:anywhere}
li.check code{background:#fef3f2;color:#b42318;padding:1px 6px;border-radius:4px;margin-right:4px;font-weight:600}
code,pre{font-family:"DejaVu Sans Mono",ui-monospace,Menlo,Consolas,monospace;font-size:12px}
h5{margin:8px 0 2px;font-size:11px;text-transform:uppercase;letter-spacing:.06em;color:var(--muted);
display:flex;align-items:center;gap:8px}
.signatures ul{margin:0;padding-left:18px}
li.signature{font-size:13px;color:#7a2e0e}
pre{white-space:pre-wrap;overflow-wrap:anywhere;margin:4px 0;background:#f6f7f9;border-radius:6px;padding:6px 8px}
pre.error{background:#f4ebff;color:#42307d;max-height:16em;overflow:auto}
.replay pre{background:#101828;color:#e4e7ec}
button.copy{font:inherit;font-size:10.5px;text-transform:none;letter-spacing:0;border:1px solid var(--line);
background:#fff;border-radius:5px;padding:0 6px;cursor:pointer}
.quiet{color:var(--muted);font-size:12.5px;margin:4px 0 0}
.skip-reason{color:#475467;font-size:13px;margin:6px 0 0}
.finding{margin:8px 0 0;padding:6px 8px;border-left:3px solid #b54708;background:#fffaeb}.finding p{margin:2px 0}.finding .reach{font-weight:600;text-transform:uppercase;font-size:11px;color:#b54708}
"""

_JS = """
(function(){
  var panel=document.getElementById('details-panel'), current=null;
  function close(){
    if(current){var c=document.getElementById(current);if(c){c.classList.remove('selected');
      var d=document.getElementById(c.getAttribute('data-details'));if(d)d.hidden=true;}}
    current=null;panel.classList.remove('open');panel.setAttribute('data-open','');
    document.body.classList.remove('panel-open');
    if(location.hash.indexOf('#open=')===0)history.replaceState(null,'',location.pathname+location.search);
  }
  function open(id){
    var cell=document.getElementById(id);
    if(!cell||!cell.hasAttribute('data-details'))return false;
    var d=document.getElementById(cell.getAttribute('data-details'));
    if(!d)return false;
    if(current&&current!==id)close();
    current=id;d.hidden=false;cell.classList.add('selected');
    panel.classList.add('open');panel.setAttribute('data-open',id);panel.scrollTop=0;
    document.body.classList.add('panel-open');
    if(location.hash!=='#open='+id)history.replaceState(null,'','#open='+id);
    return true;
  }
  function fromHash(scroll){
    var k=/^#click=(.+)$/.exec(location.hash);
    if(k){var b=document.querySelector('#'+CSS.escape(decodeURIComponent(k[1]))+' button');if(b)b.click();return;}
    var m=/^#open=(.+)$/.exec(location.hash);
    if(m){var id=decodeURIComponent(m[1]);if(!open(id))close();
      if(scroll){var c=document.getElementById(id);if(c&&c.scrollIntoView)c.scrollIntoView({block:'nearest'});}}
  }
  document.addEventListener('click',function(ev){
    var t=ev.target;
    var copy=t.closest&&t.closest('button.copy');
    if(copy){var code=copy.closest('.replay').querySelector('code').textContent;
      if(navigator.clipboard)navigator.clipboard.writeText(code).then(function(){copy.textContent='copied';});
      return;}
    var cell=t.closest&&t.closest('td.cell[data-details]');
    if(cell){if(current===cell.id)close();else open(cell.id);return;}
    if(t.id==='panel-close')close();
  });
  document.addEventListener('keydown',function(ev){if(ev.key==='Escape')close();});
  document.getElementById('only-failing').addEventListener('change',function(ev){
    document.body.classList.toggle('only-failing',ev.target.checked);});
  window.addEventListener('hashchange',function(){fromHash(true);});
  fromHash(false);
})();
"""
