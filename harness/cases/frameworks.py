"""Optional third-party frameworks the adapters call, and how to tell whether one is usable here.

A framework that is not installed makes its cases *skips* with the install hint as the reason (in
the table, the JSON and the JUnit file), never failures: the harness must run everywhere, and a CI
job decides which frameworks it installs.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence


@dataclass(frozen=True)
class Framework:
    name: str
    probe: str  # a module that exists only in the right project (names on PyPI can be taken)
    distribution: str | None
    install: str  # the hint a skip gives
    recipe: tuple[str, ...] = ()
    """Shell lines (``pip install ...``) that install it on CPU next to the installed torch, pinned;
    ``.ci/install-frameworks`` runs them with torch held at its installed version. Empty when it is
    not on the package index (the install hint says what to do)."""
    releases: tuple[str, ...] = ()
    """The releases known to install here and run the adapter, oldest first (the pinned one among
    them): what ``clipcheck compat --sweep`` runs by default."""
    release_recipes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Whole recipes for releases that need more than the pinned recipe with another version (an
    undeclared dependency, ``--ignore-requires-python``)."""

    @property
    def pinned(self) -> str | None:
        """The version the recipe pins (``dist==X`` in its lines), or None without a recipe."""
        if self.distribution is None:
            return None
        for line in self.recipe:
            match = self._pin_pattern().search(line)
            if match:
                return match.group(1)
        return None

    def recipe_for(self, release: str) -> tuple[str, ...]:
        """The install lines of ``release``: its own recipe if it has one, else the pinned recipe with
        the pinned version replaced by ``release``."""
        if release in self.release_recipes:
            return tuple(self.release_recipes[release])
        pinned = self.pinned
        if pinned is None or self.distribution is None:
            raise ValueError(f"{self.name} has no pinned recipe to derive release {release}'s from")
        return tuple(self._pin_pattern().sub(f"{self.distribution}=={release}", line) for line in self.recipe)

    def _pin_pattern(self) -> re.Pattern[str]:
        """``dist==X`` as a whole word (``other-dist==X`` is another distribution)."""
        assert self.distribution is not None
        return re.compile(rf"(?<![\w.-]){re.escape(self.distribution)}==([\w.+-]+)")

    def unavailable(self) -> str | None:
        """None when usable here, otherwise why not (with the install hint).

        Looks for the probe module's file without importing anything: importing a framework can be
        slow or have side effects (DeepSpeed picks its accelerator at import time).
        """
        top, *rest = self.probe.split(".")
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
        for root in roots:
            base = os.path.join(root, *rest)
            if os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py")):
                return None
        return f"{self.name} is not installed here; {self.install}"

    def version(self) -> str:
        if self.distribution:
            try:
                return importlib.metadata.version(self.distribution)
            except importlib.metadata.PackageNotFoundError:
                pass
        module = importlib.import_module(self.probe.split(".")[0])
        return str(getattr(module, "__version__", "unknown (source checkout)"))



def recipes(frameworks: Iterable[Framework]) -> list[str]:
    """Every recipe line of ``frameworks``, in order."""
    return [line for framework in frameworks for line in framework.recipe]
