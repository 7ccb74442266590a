"""A failing case in a few lines, with the command that runs it again.

JUnit's failure text, ``CheckReport.describe()`` (what ``assert report.passed, report.describe()``
prints under pytest) and ``report.html`` all show failures to someone who has one screen to decide
what broke: the case's name, its failed checks (each cut to a few hundred characters), the
signature, the first blame lines, the finding, and ``replay:`` - a ``clipcheck run`` command that runs
that one case and nothing else (``--variant =LABEL`` selects one layout exactly). One formatter, so
the three always say the same thing. Works from the JSON records, so a merged matrix run and a
single launch read alike.
"""

from __future__ import annotations

import math
import shlex
from typing import Any, Iterable, Mapping

from harness.cases.variant import HONEST_PLAN, bound_label
from harness.report.record_fields import readings
from harness.report.safe_text import one_line

DETAIL_CHARS = 300
"""A failed check's detail beyond this is cut (the JSON Lines record keeps it whole)."""
BLAME_LINES = 3
FAILURES_SHOWN = 20
"""``describe()`` lists at most this many failing cases; the rest are counted."""


def case_name(rec: Mapping[str, Any]) -> str:
    """``scenario [layout] target norm dtype bound``: unique among one world's cases (the bound, x0.5
    or x2, tells apart two cases that differ only in whether the clip clips)."""
    has_bound = rec.get("clip_ratio") is not None or rec.get("max_norm") is not None
    bound = f" {bound_label(rec.get('clip_ratio'), float(rec.get('max_norm') or 0.0))}" if has_bound else ""
    return one_line(f"{rec.get('scenario')} [{rec.get('layout')}] {rec.get('target')} {rec.get('norm')} "
                    f"{rec.get('dtype')}{bound}")


def _norm_flag(norm_type: Any) -> str:
    if isinstance(norm_type, str):  # "inf" / "-inf" as the JSON records write them
        return norm_type
    value = float(norm_type)
    return "inf" if math.isinf(value) else f"{value:g}"


def replay_command(rec: Mapping[str, Any]) -> str:
    """The ``clipcheck run`` command that runs this one case again, on the same world and backend."""
    layout = str(rec["layout"])
    args = ["clipcheck", "run", "--nproc", str(rec["world_size"]), "--scenario", str(rec["scenario"]),
            "--target", str(rec["target"]), "--variant", f"={layout}", "--dtype", str(rec["dtype"]),
            "--norm-type", _norm_flag(rec["norm_type"])]
    if rec.get("clip_ratio") is not None:
        args += ["--clip-ratio", f"{float(rec['clip_ratio']):g}"]
    else:
        args += ["--max-norm", repr(float(rec["max_norm"]))]
    if rec.get("seed"):
        args += ["--seed", str(rec["seed"])]
    if rec.get("backend") == "nccl":
        args += ["--backend", "nccl"]
    if rec.get("synthetic"):
        args.append("--synthetic")
    if layout.endswith(HONEST_PLAN):
        args += ["--plans", "honest"]
    return " ".join(shlex.quote(a) for a in args)


def _cut(text: str) -> str:
    text = one_line(text)
    return text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS] + f" ... ({len(text) - DETAIL_CHARS} more)"


def failure_lines(rec: Mapping[str, Any]) -> list[str]:
    """What one failing case says, short: checks, signature, blame, finding, replay."""
    out = [f"{name}: {_cut(str(check.get('detail', '')))}" for name, check in (rec.get("checks") or {}).items()
           if not check.get("passed", True)]
    out += [f"signature: {_cut(s)}" for s in readings(dict(rec))]
    blame = [b.get("line", "") for b in rec.get("blame") or []]
    out += [f"blame: {_cut(line)}" for line in blame[:BLAME_LINES]]
    if len(blame) > BLAME_LINES:
        out.append(f"blame: +{len(blame) - BLAME_LINES} more groups (in the JSON Lines record)")
    finding = rec.get("finding")
    if finding:
        out.append(f"finding [{finding.get('reach')}]: {_cut(str(finding.get('text', '')))}")
    try:
        out.append(f"replay: {replay_command(rec)}")
    except (KeyError, TypeError, ValueError):  # a record from an older file, without every field
        pass
    return out


def metamorphic_spread(group: Mapping[str, Any]) -> str:
    """How a metamorphic group's layouts disagree: the coefficients' gap and the reported norms' range."""
    norms = [float(n) for n in (group.get("norms") or {}).values()]
    span = f", reported norms {min(norms):.7g} .. {max(norms):.7g}" if norms else ""
    return f"coefficient gap {float(group.get('gap', 0)):.7g}{span}"


def failures_text(records: Iterable[Mapping[str, Any]], limit: int = FAILURES_SHOWN) -> str:
    """Every failing (FAIL / ERROR) case record, ``limit`` at most, each as its name and its lines;
    then every failed metamorphic group in one line."""
    records = list(records)
    failing = [r for r in records if r.get("type") == "case" and r.get("verdict") in ("FAIL", "ERROR")]
    out: list[str] = []
    for rec in failing[:limit]:
        out.append(f"{rec['verdict']} {case_name(rec)} (world {rec.get('world_size')}, {rec.get('backend')})")
        out += [f"    {line}" for line in failure_lines(rec)]
    if len(failing) > limit:
        out.append(f"... and {len(failing) - limit} more failing cases (report.failures, or the JSON Lines file)")
    for group in records:
        if group.get("type") == "metamorphic" and not group.get("passed", True):
            out.append(f"FAIL metamorphic {group.get('scenario')} {group.get('target')} {group.get('norm')} "
                       f"{group.get('dtype')} {group.get('bound')} [{one_line(str(group.get('invariance_key')))}]"
                       f" (world {group.get('world_size')}): {metamorphic_spread(group)} over "
                       f"{len(group.get('coefficients') or {})} layouts")
    return "\n".join(out)
