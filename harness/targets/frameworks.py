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
import sys
from dataclasses import dataclass
from typing import Iterable, Sequence


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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m harness.targets.frameworks --recipes``: the install recipes of every built-in
    framework folder, one shell line each (what ``.ci/install-frameworks`` runs)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv != ["--recipes"]:
        print("usage: python -m harness.targets.frameworks --recipes", file=sys.stderr)
        return 2
    from harness.targets.builtin_scenarios import scenarios_package

    print("\n".join(recipes(scenarios_package().FRAMEWORKS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
