"""Text from files, blobs and the code under test, made safe to show.

A replay blob's label, a matrix file's name or an exception message is someone else's text: printed
raw, a newline in a label starts a forged line of the table, ANSI escapes paint it ("PASS" in green
over a failure), bidirectional overrides reorder it, and the same characters make JUnit XML invalid.
Every control character is shown as an escape instead (``\\x1b``, ``\\n``, ``\\u202e``); ``lines``
keeps the newlines of a multi-line detail (the reporters indent its continuation lines).
"""

from __future__ import annotations

from typing import Any

_BIDI = (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
_CONTROL = [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)]


def _escape(code: int) -> str:
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


_ONE_LINE = {code: _escape(code) for code in (*_CONTROL, *_BIDI)}
_ONE_LINE.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})
_LINES = {code: text for code, text in _ONE_LINE.items() if code != ord("\n")}


def one_line(text: Any) -> str:
    """``text`` on one line, every control and bidirectional-override character escaped."""
    return str(text).translate(_ONE_LINE)


def lines(text: Any) -> str:
    """``text`` with its newlines kept and every other control character escaped."""
    return str(text).translate(_LINES)

