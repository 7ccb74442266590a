"""What the matrix views (``summary``, ``html``) read from a results file's record dicts, read
defensively.

The records are the dicts of a JSON Lines file (``reporter.case_json``, ``finish.metamorphic_json``),
but the file may be an older one, someone else's, or cut short: a record may lack fields, carry
unknown ones or hold a value of another type. Every reader here returns something showable instead of
raising, and every text it returns has its control characters escaped (``safe_text.lines``).
"""

from __future__ import annotations

from typing import Any, Iterable

from harness.report.safe_text import lines

VERDICT_RANK = {"SKIP": 0, "PASS": 1, "FAIL": 2, "ERROR": 3}
"""How bad a verdict is when cases are aggregated; an unknown verdict counts as an error."""


def case_dicts(records: Iterable[Any]) -> list[dict[str, Any]]:
    """The case records (a dict without a type is taken for one)."""
    return [r for r in records if isinstance(r, dict) and r.get("type", "case") == "case"]


def group_dicts(records: Iterable[Any]) -> list[dict[str, Any]]:
    """The metamorphic group records."""
    return [r for r in records if isinstance(r, dict) and r.get("type") == "metamorphic"]


def verdict_of(rec: dict[str, Any]) -> str:
    v = rec.get("verdict")
    return v if v in VERDICT_RANK else "ERROR"


def is_failing(rec: dict[str, Any]) -> bool:
    return verdict_of(rec) in ("FAIL", "ERROR")


def text(x: Any, default: str = "?") -> str:
    """A record's field as text (``default`` for None); control characters escaped."""
    return default if x is None else lines(x)


def checks_of(rec: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """(name, passed, detail) of each check; a bare bool stands for a check without detail."""
    checks = rec.get("checks")
    if not isinstance(checks, dict):
        return []
    out = []
    for name, c in checks.items():
        if isinstance(c, dict):
            out.append((str(name), bool(c.get("passed", False)), text(c.get("detail"), "")))
        else:
            out.append((str(name), bool(c), ""))
    return out


def failed_checks(rec: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, detail) of each failed check."""
    return [(name, detail) for name, passed, detail in checks_of(rec) if not passed]


def as_list(x: Any) -> list[Any]:
    """A field that should be a list: None is none, a lone value one."""
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


def signatures(rec: dict[str, Any]) -> list[str]:
    return [str(s) for s in as_list(rec.get("signature")) if s not in (None, "")]


UNEXPLAINED = ("none: no single mistake this judge knows gives this norm (several groups miscounted, or arithmetic "
               "that loses more than rounding: an accumulator that stalls in a narrow type?)")
"""The reading of a wrong norm that no signature and no blame explains: said, so that it is not read as a
count the judge failed to name (a bf16 running sum that stalls moves the norm as far as a miscount does)."""


def readings(rec: dict[str, Any]) -> list[str]:
    """A record's signature lines, or, for a wrong norm (check ``norm``) that neither a signature nor a blame
    explains, ``UNEXPLAINED``."""
    found = signatures(rec)
    if found or as_list(rec.get("blame")) or "norm" not in dict(failed_checks(rec)):
        return found
    return [UNEXPLAINED]


def errors(rec: dict[str, Any]) -> list[tuple[int | None, str]]:
    """(rank, message) for every error the record carries; a per-rank list gives ranks."""
    errs = rec.get("errors")
    if isinstance(errs, (list, tuple)):
        return [(i, str(e)) for i, e in enumerate(errs) if e not in (None, "")]
    if errs in (None, ""):
        return []
    return [(None, str(errs))]


def raised(rec: dict[str, Any]) -> bool:
    """Whether the case ended in an exception rather than a wrong number."""
    return verdict_of(rec) == "ERROR" or bool(errors(rec))


def clip(s: str, width: int) -> str:
    """``s`` on one line (runs of whitespace made one space), cut to ``width`` with an ellipsis."""
    s = " ".join(s.split())
    if len(s) <= width:
        return s
    return s[: max(width - 1, 0)] + "…"
