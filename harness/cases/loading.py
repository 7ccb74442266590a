"""Load user code named on the command line: ``package.module:attr`` or ``path/to/file.py:attr``."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
from typing import Any, Iterable
from harness.errors import ClipcheckInputError


class LoadError(ClipcheckInputError):
    """A ``module:attr`` or ``file.py:attr`` reference that cannot be resolved."""


def is_import_path(text: str) -> bool:
    """Whether a target or scenario name is a ``module:attr`` / ``file.py:attr`` string to load,
    rather than the name of a built-in (built-in names never contain a colon)."""
    return ":" in text


def unknown_name(kind: str, name: str, known: Iterable[str], attr: str) -> LoadError:
    """The error for a ``kind`` (target, scenario) named ``name`` that is neither registered nor a
    ``module:attr`` reference: the registered names are many, so a mistyped one gets the closest of
    them first (``did you mean 'reference'?``), before the whole list."""
    names = sorted(known)
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" did you mean {close[0]!r}? It is" if close else ""
    return LoadError(f"unknown {kind} {name!r}:{hint} not one of {', '.join(names)}, and not of the form "
                     f"module:{attr} or path/to/file.py:{attr}")


def load_object(reference: str) -> Any:
    """The object a ``module:attr`` / ``file.py:attr`` reference names (dotted attrs allowed)."""
    location, _, attr = reference.rpartition(":")
    if not location or not attr:
        raise LoadError(f"{reference!r} is not of the form module:name or path/to/file.py:name")
    if location.endswith(".py") or os.sep in location or "/" in location:
        module = _load_file(location, reference)
    else:
        _working_directory_importable()
        try:
            module = importlib.import_module(location)
        except ImportError as exc:
            raise LoadError(f"cannot import module {location!r} for {reference!r}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise LoadError(f"{location!r} has no attribute {attr!r}") from None
    return obj


def _working_directory_importable() -> None:
    """``--target my_clip:clip`` finds ``my_clip.py`` in the working directory, as ``python -m`` would,
    also from the ``clipcheck`` script (which does not put it on sys.path). It goes last, so nothing
    there shadows an installed package."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _load_file(path: str, reference: str) -> Any:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise LoadError(f"no such file {path!r} for {reference!r}")
    name = "clipcheck_user_" + "".join(c if c.isalnum() else "_" for c in full)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise LoadError(f"cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise LoadError(f"importing {path!r} failed: {type(exc).__name__}: {exc}") from None
    return module
