"""One exception root for everything clipcheck raises on purpose, so a caller can catch ours and
nothing else. Bad input (a layout that cannot exist, a name that resolves to nothing, a matrix that
plans no case) is a ``ClipcheckInputError``: the command line reports it as one line, exit status 2,
before any process group exists."""

from __future__ import annotations


class ClipcheckError(Exception):
    """Root of clipcheck's own exceptions."""


class ClipcheckInputError(ClipcheckError, ValueError):
    """Bad input, reported as one clear line (LayoutError, LoadError, UsageError derive from it)."""


class UsageError(ClipcheckInputError):
    """A request that cannot be run as asked (a matrix that plans no case, a blob that does not decode,
    a world out of range), reported as one clear line."""
