"""``python -m harness.targets.recipes``: the install recipes of every built-in framework folder, one
shell line each (what ``.ci/install-frameworks`` runs). It reads the built-in scenarios package, which
sits above the ``Framework`` type it lists."""

from __future__ import annotations

import sys
from typing import Sequence

from harness.cases.frameworks import recipes
from harness.targets.builtin_scenarios import scenarios_package


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv != ["--recipes"]:
        print("usage: python -m harness.targets.recipes --recipes", file=sys.stderr)
        return 2
    print("\n".join(recipes(scenarios_package().FRAMEWORKS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
