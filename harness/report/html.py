"""The static HTML page of a matrix run, ``report.html``, built from the record dicts of a results
JSON Lines file (``reporter.case_json``, ``finish.metamorphic_json``). No torch.

``render_html(records)`` / ``write_html(records, path)``: a self-contained page (inline CSS and JS,
nothing fetched): a heatmap per scenario, targets as rows and layouts as columns grouped by world size
(a table per world size, cut into parts of at most ``MAX_COLUMNS`` layouts, that wrap side by side, so
the page never scrolls sideways), each cell the worst of the cases it holds (norm types, dtypes,
bounds), coloured by verdict; clicking a cell opens its cases' failed checks, signatures, errors and
replay commands in a side panel. The URL fragment ``#open=<cell id>`` opens a cell on load, so a link
or a headless browser can show one; ``#click=<cell id>`` clicks the cell's button on load (what a
headless check uses to drive the click handler itself).

The markup is a Jinja2 template (``templates/report.html.j2``) with autoescaping, so nothing a record
says reaches the page raw; its style and script are package files (``assets/``), inlined. This module
only turns the records into the plain data the template shows (``Page``), and writes the page.

Records may lack fields or carry unknown ones (``record_fields`` reads them); a ratio may be a float,
null, or "nan"/"inf"/"-inf".
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, cast

from harness.judge.establishment import counting_summary
from harness.judge.verdicts import count
from harness.report.failures import replay_command
from harness.report.numbers import format_number, format_ratio, parse_float, ratio_deviation
from harness.report.record_fields import VERDICT_RANK, as_list, case_dicts, checks_of, clip, errors, \
    failed_checks, group_dicts, is_failing, signatures, text, verdict_of

if TYPE_CHECKING:
    import jinja2

_CLASS = {"PASS": "v-pass", "FAIL": "v-fail", "ERROR": "v-error", "SKIP": "v-skip"}
_NO_VERDICT = "v-skip"  # the overall "NOTHING JUDGED" (every case skipped, or none at all)
TEMPLATE = "report.html.j2"
MAX_COLUMNS = 9
"""The most layouts a block of the heatmap holds side by side: a world size with more is cut into even
parts, so that a part with its target column fits a 1280 px window, every label readable and nothing
to scroll sideways (tests/test_matrix_view.py measures it on the default matrix in Chromium)."""


# ------------------------------------------------------------------------------- what the page shows

@dataclass(frozen=True)
class FindingBox:
    """What a framework's FAIL matches, and who reaches it."""

    reach: str
    text: str
    how: str
    repro: str | None


@dataclass(frozen=True)
class CaseBox:
    """One case in a cell's details."""

    verdict: str
    css: str
    badge: str
    title: str
    ratio: str
    facts: list[tuple[str, str]]
    failed: list[tuple[str, str]]
    passed_checks: str | None
    signatures: list[str]
    errors: list[tuple[str, str]]
    """(prefix, message): the prefix names the rank where the record gives one."""
    skip_reason: str | None
    finding: FindingBox | None
    synthetic: str | None
    replay: str | None


@dataclass(frozen=True)
class Cell:
    """One filled heatmap cell: the worst of its cases, and its details in the side panel."""

    id: str
    details_id: str
    verdict: str
    css: str
    target: str
    layout: str
    scenario: str
    world: str
    backend: str
    cases: list[CaseBox]
    failing: int
    severity: float | None
    title: str
    ratio: str
    count: str
    tally: str


@dataclass(frozen=True)
class RowWorld:
    """A target's cells at one world size, one per layout of that world (None: not run)."""

    world: str
    cells: list[Cell | None]


@dataclass(frozen=True)
class Row:
    target: str
    failing: int
    worlds: list[RowWorld]


@dataclass(frozen=True)
class WorldHead:
    """A world size's column group: red underlined when any of its cases failed."""

    world: str
    backend: str
    bad: bool
    note: str
    layouts: list[str]


@dataclass(frozen=True)
class LayoutHead:
    """A layout's column header: the label as its words (a label wraps at its spaces first), each word
    in pieces that end at ``= / , : -`` (where the template lets a word wider than its column wrap,
    as ``hybrid_shared=`` / ``False``, before anywhere else)."""

    label: str
    words: list[list[str]]


@dataclass(frozen=True)
class BlockRow:
    """A target's cells in one block. ``failing`` counts its failures in the whole scenario, so the
    "only targets with failures" filter hides a target in every block or in none."""

    target: str
    failing: int
    cells: list[Cell | None]


@dataclass(frozen=True)
class Block:
    """One table of a scenario's heatmap: the layouts of a world size, or one part of them (``part`` of
    ``parts``) where it has more than ``MAX_COLUMNS``, and every target's cells there."""

    head: WorldHead
    part: int
    parts: int
    layouts: list[LayoutHead]
    rows: list[BlockRow]


@dataclass(frozen=True)
class MetaRow:
    target: str
    world: str
    columns: list[str]
    layouts: int
    gap: str
    spread: str


@dataclass(frozen=True)
class Meta:
    """A scenario's metamorphic groups: ``failed`` lists those whose layouts differ."""

    total: int
    total_text: str
    failed: list[MetaRow]


@dataclass(frozen=True)
class Section:
    """One scenario: its heatmap as blocks, one per world size or part of one, that wrap side by side
    (none when it has no cases), and its metamorphic groups."""

    name: str
    slug: str
    tally: str
    blocks: list[Block]
    meta: Meta | None


@dataclass(frozen=True)
class Chip:
    label: str
    value: str
    css: str


@dataclass(frozen=True)
class Header:
    """The title with the overall verdict, and the totals (as chips and as data- attributes)."""

    title: str
    generated: str | None
    cases: int
    passed: int
    failed: int
    errors: int
    skipped: int
    groups: int
    groups_failed: int
    verdict: str
    css: str
    chips: list[Chip]


@dataclass(frozen=True)
class Page:
    title: str
    header: Header
    sections: list[Section]
    cells: list[Cell]
    """Every filled cell, in the order the panel holds their details."""


# ------------------------------------------------------------------------------------ from records

def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _tally(cases: list[dict[str, Any]]) -> str:
    c = count(cases)
    return ", ".join(f"{n} {word}" for n, word in ((c.passed, "pass"), (c.failed, "fail"), (c.errors, "error"),
                                                   (c.skipped, "skip")) if n)


def _sort_key(x: Any) -> tuple[int, Any]:
    return (0, x) if isinstance(x, (int, float)) and not isinstance(x, bool) else (1, str(x))


def _slug(x: Any, limit: int = 24) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", text(x).lower()).strip("-")
    return s[:limit].strip("-") or "x"


def _cell_id(world: Any, backend: Any, scenario: Any, layout: Any, target: Any) -> str:
    """Stable across runs, so ``#open=<id>`` links keep working: readable slugs plus a hash of the
    exact key, so labels that slug alike (``dp=2 fsdp`` / ``dp-2 fsdp``) still differ."""
    key = "\x1f".join(text(x) for x in (world, backend, scenario, layout, target))
    digest = hashlib.sha1(key.encode("utf-8")).hexdigest()[:8]
    return (f"cell-w{_slug(world, 8)}-{_slug(backend, 8)}-{_slug(scenario, 20)}-{_slug(layout, 32)}"
            f"-{_slug(target, 24)}-{digest}")


def _case_sort(rec: dict[str, Any]) -> tuple[float, float]:
    """Worst first: by verdict, then by how far the ratio is from 1.0."""
    d = ratio_deviation(parse_float(rec.get("ratio")))
    return (-VERDICT_RANK[verdict_of(rec)], -(d if d is not None else -1.0))


def _short_ratio(rec: dict[str, Any]) -> str:
    """What a cell shows: 3-4 digits of the ratio. A failing ratio that rounds to 1.000 shows its
    deviation instead, or a red cell would read as fine; without a ratio, the first failed check
    (crash, hang, not_run ...) says why."""
    r = parse_float(rec.get("ratio"))
    verdict = verdict_of(rec)
    if r is None:
        names = [n for n, _ in failed_checks(rec)]
        if names and verdict in ("FAIL", "ERROR"):
            return clip(names[0], 9)
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
    n, n_fail = len(cases), sum(is_failing(r) for r in cases)
    if n == 1:
        return ""
    return f"{n_fail}/{n} fail" if n_fail else f"×{n}"


def _severity(rec: dict[str, Any]) -> float:
    """0..1 for the red's depth: orders of magnitude of the deviation, 1e-6 light to 1 dark, so a
    rounding-size miss and a missing all-reduce do not look alike."""
    d = ratio_deviation(parse_float(rec.get("ratio")))
    if d is None or math.isinf(d):
        return 1.0
    if d <= 0:
        return 0.15
    return round(min(1.0, max(0.15, (math.log10(d) + 6) / 6)), 3)


def _bound(rec: dict[str, Any]) -> str | None:
    """The clipping bound as the console labels it: ``x0.5`` relative to the true norm, else the
    absolute max_norm; None where the record has neither."""
    ratio = parse_float(rec.get("clip_ratio"))
    if ratio is not None:
        return f"x{ratio:g}"
    return None if rec.get("max_norm") is None else f"max_norm {format_number(rec.get('max_norm'))}"


def _case_title(rec: dict[str, Any]) -> str:
    parts = [text(rec.get("norm")), text(rec.get("dtype")), _bound(rec)]
    return text(" · ".join(p for p in parts if p))


def _facts(rec: dict[str, Any]) -> list[tuple[str, str]]:
    """The numbers someone debugging a failure wants next to its checks."""
    facts = []
    if "true_norm" in rec:
        facts.append(("true norm", format_number(rec.get("true_norm"))))
    reported = as_list(rec.get("reported"))
    if reported:
        facts.append(("reported", ", ".join(f"rank {i}: {format_number(v)}" for i, v in enumerate(reported))))
    if rec.get("tolerance") is not None:
        facts.append(("tolerance", format_number(rec["tolerance"])))
    for key in ("seed", "framework"):
        if rec.get(key) is not None:
            facts.append((key, text(rec[key])))
    counting = counting_summary([rec.get("counting") or {}])
    if counting is not None:  # how the case established each group's count (docs/reading-a-failure.md)
        facts.append(("counting", counting))
    return [(key, text(value, "")) for key, value in facts]


def _replay(rec: dict[str, Any]) -> str | None:
    """The failing case's ``clipcheck run`` command (a fuzz record brings its own ``replay``)."""
    try:
        return replay_command(rec)
    except (KeyError, TypeError, ValueError):  # a record from an older file, without every field
        return None


def _finding(rec: dict[str, Any]) -> FindingBox | None:
    finding = rec.get("finding")
    if verdict_of(rec) != "FAIL" or not isinstance(finding, dict):
        return None
    repro = finding.get("repro") if finding.get("reach") != "synthetic" else None
    return FindingBox(text(finding.get("reach")), text(finding.get("text")), text(finding.get("how")),
                      text(repro) if repro else None)


def _case(rec: dict[str, Any]) -> CaseBox:
    """One case as its details show it: verdict, facts, failed checks, signatures, errors, replay."""
    verdict = verdict_of(rec)
    checks = checks_of(rec)
    finding = _finding(rec)
    replay = rec.get("replay") or (_replay(rec) if verdict in ("FAIL", "ERROR") else None)
    return CaseBox(
        verdict=verdict, css=_CLASS[verdict], badge=text(rec.get("verdict")), title=_case_title(rec),
        ratio=format_ratio(rec.get("ratio")),
        facts=_facts(rec) if verdict != "PASS" else [],
        failed=[(text(name, ""), detail) for name, detail in failed_checks(rec)],
        passed_checks=f"{_plural(len(checks), 'check')} passed" if verdict == "PASS" and checks else None,
        signatures=[text(s, "") for s in signatures(rec)],
        errors=[("" if rank is None else f"rank {rank}: ", text(msg, "")) for rank, msg in errors(rec)],
        skip_reason=text(rec["skip_reason"], "") if verdict == "SKIP" and rec.get("skip_reason") else None,
        finding=finding,
        synthetic=text(rec["synthetic"]) if verdict == "FAIL" and finding is None and rec.get("synthetic") else None,
        replay=text(replay, "") if isinstance(replay, str) and replay.strip() else None,
    )


def _cell(key: tuple[Any, ...], cases: list[dict[str, Any]]) -> Cell:
    """One heatmap cell: the worst of its cases (verdict colour, ratio) and its failure count."""
    world, backend, scenario, layout, target = key
    cell_id = _cell_id(*key)
    worst = min(cases, key=_case_sort)
    verdict = verdict_of(worst)
    title = f"{target} · {layout} · world {world}: {verdict.lower()}, worst ratio {format_ratio(worst.get('ratio'))}"
    if len(cases) > 1:
        title += f" over {len(cases)} cases"
    return Cell(
        id=cell_id, details_id="details-" + cell_id.removeprefix("cell-"), verdict=verdict, css=_CLASS[verdict],
        target=text(target, ""), layout=text(layout, ""), scenario=text(scenario, ""), world=text(world, ""),
        backend=text(backend, ""), cases=[_case(r) for r in sorted(cases, key=_case_sort)],
        failing=sum(is_failing(r) for r in cases), severity=_severity(worst) if verdict == "FAIL" else None,
        title=text(title, ""), ratio=text(_short_ratio(worst), ""), count=_cell_count(cases),
        tally=f"{_plural(len(cases), 'case')}: {text(_tally(cases), '')}",
    )


def _meta(groups: list[dict[str, Any]]) -> Meta | None:
    """A scenario's metamorphic groups: one line when all agree, else a row for each that differs."""
    if not groups:
        return None
    failed = sorted((g for g in groups if not g.get("passed", False)),
                    key=lambda g: (_sort_key(g.get("world_size", "?")), text(g.get("target"))))
    rows = []
    for g in failed:
        coeffs = g["coefficients"] if isinstance(g.get("coefficients"), dict) else {}
        nums = {k: v for k, v in coeffs.items() if parse_float(v) is not None}
        spread = ""
        if nums:
            low = min(nums, key=lambda k: cast(float, parse_float(nums[k])))  # nums: the values with a ratio
            high = max(nums, key=lambda k: cast(float, parse_float(nums[k])))
            spread = f"{low}: {format_number(nums[low])} .. {high}: {format_number(nums[high])}"
        columns = [f'{text(g.get("world_size"))} {text(g.get("backend"))}', g.get("target"), g.get("norm"),
                   g.get("dtype"), g.get("bound")]
        rows.append(MetaRow(target=text(g.get("target"), ""), world=text(g.get("world_size"), ""),
                            columns=[text(c, "") for c in columns], layouts=len(coeffs),
                            gap=text(format_number(g.get("gap")), ""), spread=text(spread, "")))
    return Meta(total=len(groups), total_text=_plural(len(groups), "group"), failed=rows)


WorldKey = tuple[Any, Any]  # (world_size, backend)


@dataclass
class _Grid:
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


def _by_scenario(cases: list[dict[str, Any]], groups: list[dict[str, Any]]) -> dict[str, _Grid]:
    scenarios: dict[str, _Grid] = {}
    for rec in cases:
        grid = scenarios.setdefault(text(rec.get("scenario")), _Grid())
        wkey = (rec.get("world_size", "?"), rec.get("backend", "?"))
        layout, target = text(rec.get("layout")), text(rec.get("target"))
        grid.worlds.setdefault(wkey, {}).setdefault(layout)
        grid.targets.setdefault(target)
        grid.cells.setdefault((wkey, layout, target), []).append(rec)
    for g in groups:
        scenarios.setdefault(text(g.get("scenario")), _Grid()).groups.append(g)
    return scenarios


def _heads(grid: _Grid) -> list[WorldHead]:
    heads = []
    for wkey in grid.world_keys():
        world, backend = wkey
        wcases = grid.cases(wkey)
        bad = sum(is_failing(r) for r in wcases)
        heads.append(WorldHead(world=text(world, ""), backend=text(backend, ""), bad=bool(bad),
                               note=f"{bad} of {len(wcases)} fail" if bad else f"{len(wcases)} cases",
                               layouts=[text(layout, "") for layout in grid.worlds[wkey]]))
    return heads


def _row(scenario: str, grid: _Grid, target: str, filled: list[Cell]) -> Row:
    """A target's row across every world and layout; each filled cell is also added to ``filled``."""
    worlds, failing = [], 0
    for wkey in grid.world_keys():
        world, backend = wkey
        cells: list[Cell | None] = []
        for layout in grid.worlds[wkey]:
            cases = grid.cells.get((wkey, layout, target))
            if not cases:
                cells.append(None)
                continue
            cell = _cell((world, backend, scenario, layout, target), cases)
            cells.append(cell)
            filled.append(cell)
            failing += cell.failing
        worlds.append(RowWorld(world=text(world, ""), cells=cells))
    return Row(target=text(target, ""), failing=failing, worlds=worlds)


_BREAK_AFTER = re.compile(r"[^=/,:-]*[=/,:-]+|[^=/,:-]+")


def _layout_head(label: str) -> LayoutHead:
    return LayoutHead(label=label, words=[_BREAK_AFTER.findall(word) for word in label.split()])


def _parts(n: int, most: int = MAX_COLUMNS) -> list[range]:
    """``range(n)`` cut into the fewest parts of at most ``most``, as even as can be (larger first)."""
    n_parts = max(1, -(-n // most))
    size, extra = divmod(n, n_parts)
    parts, start = [], 0
    for i in range(n_parts):
        stop = start + size + (i < extra)
        parts.append(range(start, stop))
        start = stop
    return parts


def _blocks(heads: list[WorldHead], rows: list[Row]) -> list[Block]:
    """The heatmap's tables: a world size each, cut into parts of at most ``MAX_COLUMNS`` layouts."""
    blocks = []
    for w, head in enumerate(heads):
        parts = _parts(len(head.layouts))
        for number, part in enumerate(parts, 1):
            blocks.append(Block(
                head=head, part=number, parts=len(parts), layouts=[_layout_head(head.layouts[i]) for i in part],
                rows=[BlockRow(row.target, row.failing, [row.worlds[w].cells[i] for i in part]) for row in rows]))
    return blocks


def _section(scenario: str, grid: _Grid, filled: list[Cell]) -> Section:
    cases = grid.cases()
    rows = [_row(scenario, grid, target, filled) for target in grid.targets] if grid.worlds else []
    return Section(name=text(scenario, ""), slug=_slug(scenario, 40),
                   tally=f"{len(cases)} cases: {text(_tally(cases) or 'no cases', '')}",
                   blocks=_blocks(_heads(grid), rows), meta=_meta(grid.groups))


def _header(title: str, generated: str | None, cases: list[dict[str, Any]], groups: list[dict[str, Any]]) -> Header:
    counts = count(cases + groups)
    chips = [Chip("cases", str(len(cases)), "t-cases"), Chip("passed", str(counts.passed), "t-pass"),
             Chip("failed", str(counts.failed), "t-fail"), Chip("errors", str(counts.errors), "t-error"),
             Chip("skipped", str(counts.skipped), "t-skip")]
    if groups:
        chips.append(Chip("metamorphic failed", f"{counts.metamorphic_failed}/{len(groups)}",
                          "t-meta" + (" bad" if counts.metamorphic_failed else "")))
    return Header(title=text(title, ""), generated=text(generated, "") if generated else None, cases=len(cases),
                  passed=counts.passed, failed=counts.failed, errors=counts.errors, skipped=counts.skipped,
                  groups=len(groups), groups_failed=counts.metamorphic_failed, verdict=counts.word,
                  css=_CLASS.get(counts.word, _NO_VERDICT), chips=chips)


def page_data(records: Iterable[Any], title: str = "clipcheck matrix", generated: str | None = None) -> Page:
    """What the page shows, as plain data: every text already made safe to show (``text``), none of
    it escaped for HTML (the template's autoescaping does that)."""
    records = list(records)
    cases, groups = case_dicts(records), group_dicts(records)
    filled: list[Cell] = []
    sections = [_section(name, grid, filled) for name, grid in _by_scenario(cases, groups).items()]
    return Page(title=text(title, ""), header=_header(title, generated, cases, groups), sections=sections,
                cells=filled)


# ------------------------------------------------------------------------------------------ the page

@functools.cache
def _asset(name: str) -> str:
    return resources.files("harness.report").joinpath("assets", name).read_text(encoding="utf-8")


def _joined(source: str) -> str:
    """The template is indented for people, the page is not: a newline and the indentation after it
    are dropped when the template is loaded (a line that starts at column 0 keeps its newline)."""
    return re.sub(r"\n[ \t]+", "", source)


@functools.cache
def _template() -> jinja2.Template:
    # imported on the first page: rank 0 of every launch imports this module (``finish``), and only
    # the matrix renders a page
    import jinja2

    # trim_blocks: the line break after each macro of the template is not part of the page
    env = jinja2.Environment(autoescape=True, trim_blocks=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined)
    source = resources.files("harness.report").joinpath("templates", TEMPLATE).read_text(encoding="utf-8")
    return env.from_string(_joined(source))


def render_html(records: Iterable[Any], title: str = "clipcheck matrix", generated: str | None = None) -> str:
    """The whole page as one string; the same records, title and ``generated`` give the same bytes
    (no timestamp unless ``generated`` is given), so pages of two runs diff cleanly."""
    return _template().render(page=page_data(records, title, generated), css=_asset("report.css"),
                              js=_asset("report.js"))


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
