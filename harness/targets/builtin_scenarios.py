"""The built-in scenarios as the package ``harness.scenarios``, wherever harness is imported from.

Why a module of its own: the built-in scenarios must come from the harness that is running, never
from the user's working directory. Imported as a top-level ``scenarios`` package, a ``scenarios/``
folder in the cwd (which ``python -m`` and ``torchrun -m`` put first on ``sys.path``) shadowed them.

* Installed from the wheel, the repository's ``scenarios/`` folder *is* the subpackage
  ``harness.scenarios`` (pyproject ``package-dir``), and the ordinary import finds it inside the
  installed ``harness`` package.
* In a checkout (pytest's ``pythonpath = ["."]``, or an editable install made before that mapping)
  there is no ``harness/scenarios`` folder. A finder at the end of ``sys.meta_path`` then maps the
  name ``harness.scenarios`` to the ``scenarios/`` folder beside this ``harness/`` package, located
  from this file and not through ``sys.path`` or the cwd.

The finder is installed when this module is imported (``harness.targets.registry`` imports it), so a rank
process that unpickles a built-in scenario by its module name, having imported the harness module
that runs the task, resolves it the same way.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Sequence

PACKAGE = "harness.scenarios"


def checkout_scenarios_dir() -> Path | None:
    """The checkout's ``scenarios/`` folder next to this ``harness/`` package, or None when harness
    is not running from a checkout (the ``pyproject.toml`` check keeps an unrelated top-level
    ``scenarios`` in site-packages from ever being taken for ours)."""
    root = Path(__file__).resolve().parents[2]  # harness/targets/ -> the checkout
    folder = root / "scenarios"
    if (folder / "__init__.py").is_file() and (root / "pyproject.toml").is_file():
        return folder
    return None


class CheckoutScenariosFinder(importlib.abc.MetaPathFinder):
    """Answers only for ``harness.scenarios``, and only when nothing before it on ``sys.meta_path``
    (an installed ``harness/scenarios`` package, an editable-install finder) did."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != PACKAGE:
            return None
        folder = checkout_scenarios_dir()
        if folder is None:
            return None
        # submodule_search_locations makes it a package: ``from .dense_dp import ...`` inside it and
        # ``import harness.scenarios.dense_dp`` resolve in that folder; the import system registers
        # the module in sys.modules before executing it
        return importlib.util.spec_from_file_location(
            PACKAGE, folder / "__init__.py", submodule_search_locations=[str(folder)])


def install_finder() -> None:
    """Put the checkout finder at the end of ``sys.meta_path`` (once per process)."""
    if not any(isinstance(f, CheckoutScenariosFinder) for f in sys.meta_path):
        sys.meta_path.append(CheckoutScenariosFinder())


def scenarios_package() -> ModuleType:
    """``harness.scenarios``: the installed subpackage, or in a checkout its ``scenarios/`` folder."""
    install_finder()
    return importlib.import_module(PACKAGE)


install_finder()
