"""``clipcheck catalogue``: every known clipping mistake, run against the harness.

For each mechanism of ``harness.targets.mutants.catalogue``: its upstream reports, the fixed scenario
that catches it (run now: failed cases of all), how many seeded fuzz examples the fuzzer needs
to find it, and the signature the judge shows most often. One warm world serves every run. Exit
status 0 when every mechanism fails its fixed scenario and the fuzzer finds it (within the recorded
bound at the recorded world, budget, hypothesis and torch releases, within the budget otherwise), 1 otherwise; ``--list`` prints
the table without running anything (and the rows reproduced elsewhere or out of scope, with why).
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from harness.judge.verdicts import EXIT_FAIL, EXIT_PASS
from harness.targets.mutants.catalogue import (CATALOGUE, FUZZ_BUDGET, FUZZ_HYPOTHESIS, FUZZ_SEED, FUZZ_TORCH,
                                                FUZZ_WORLD, OUT_OF_SCOPE, REPRODUCED_ELSEWHERE, Mechanism)

if TYPE_CHECKING:
    from harness.run.hosts.pool import RankPool


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clipcheck catalogue", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=FUZZ_WORLD,
                   help=f"world size of the runs (default {FUZZ_WORLD}, where the fuzz bounds were recorded)")
    p.add_argument("--fuzz-examples", type=int, default=FUZZ_BUDGET, metavar="N",
                   help=f"fuzz budget per mechanism (seed {FUZZ_SEED}; default {FUZZ_BUDGET})")
    p.add_argument("--list", action="store_true", help="print the catalogue without running it")
    return p


def _rows(m: Mechanism) -> str:
    return ",".join(map(str, m.rows)) or "-"


def _static() -> None:
    print("mechanism | §6 rows | upstream | factor | fixed scenario | fuzz bound")
    for m in CATALOGUE:
        print(f"{m.mutant} | {_rows(m)} | {m.upstream} | {m.factor} | {m.caught_by} | {m.fuzz_needed}")
    print("\nreproduced with real code or a scenario's own layout:")
    for row, where in sorted(REPRODUCED_ELSEWHERE.items()):
        print(f"  row {row}: {where}")
    print("out of scope (not a mistake in the norm or the clip):")
    for row, why in sorted(OUT_OF_SCOPE.items()):
        print(f"  row {row}: {why}")


@dataclass(frozen=True)
class Caught:
    """What one mechanism did against the harness: its fixed scenario's failing cases and the fuzz run."""

    mechanism: Mechanism
    failed: int
    cases: int
    fuzz_needed: int | None
    """Examples the seeded fuzzer needed; None when it survived the budget."""
    signature: str
    """The signature the failing cases show most often."""
    signatures: tuple[str, ...] = ()
    """Every signature the failing cases show."""

    @property
    def within_bound(self) -> bool:
        return self.fuzz_needed is not None and self.fuzz_needed <= self.mechanism.fuzz_needed

    @property
    def found(self) -> bool:
        """Failed its fixed scenario and found by the fuzzer within the budget, whatever the bound."""
        return self.failed > 0 and self.fuzz_needed is not None

    @property
    def caught(self) -> bool:
        return self.failed > 0 and self.within_bound


def run_mechanism(m: Mechanism, pool: "RankPool", fuzz_examples: int = FUZZ_BUDGET) -> Caught:
    """Run ``m``'s mutant on its fixed scenario and fuzz it (seeded, no shrinking) on ``pool``."""
    from harness.api import check
    from harness.fuzz import fuzz

    report = check(m.mutant, scenarios=[m.caught_by], worlds=[pool.world_size], pools={pool.world_size: pool},
                   blame="off")  # its table shows signatures, not the weighing of groups
    cases = [r for r in report.cases if r["verdict"] != "SKIP"]
    failing = [r for r in cases if r["verdict"] in ("FAIL", "ERROR")]
    signature = Counter(s for r in failing for s in r.get("signature") or [])
    shown = signature.most_common(1)[0][0] if signature else (
        ", ".join(sorted({c for r in failing for c, v in r["checks"].items() if not v["passed"]})) or "-")
    found = fuzz(m.mutant, pool, fuzz_examples, seed=FUZZ_SEED, shrink=False, blame=False)
    return Caught(m, len(failing), len(cases), None if found.passed else found.failed_at, shown, tuple(signature))


def bounds_apply(world: int, fuzz_examples: int) -> bool:
    """Whether the recorded bounds hold for a run: the world, budget, hypothesis and torch releases they
    were recorded at (another engine draws another sequence from the same seed; another torch's
    arithmetic fails other examples)."""
    import hypothesis

    from harness.run.world.torch_compat import torch_release

    return ((world, fuzz_examples, hypothesis.__version__, torch_release())
            == (FUZZ_WORLD, FUZZ_BUDGET, FUZZ_HYPOTHESIS, FUZZ_TORCH))


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        _static()
        return EXIT_PASS
    if args.world < 2:
        build_parser().error("--world must be at least 2 (a mechanism needs ranks to disagree)")
    from harness.run.hosts.pool import RankPool

    recorded = bounds_apply(args.world, args.fuzz_examples)
    ok = True
    print("mechanism | §6 rows | upstream | fixed scenario: failed/cases | fuzz examples needed"
          f"{' (recorded bound)' if recorded else ''} | signature seen most")
    with RankPool(args.world, timeout_s=30) as pool:
        for m in CATALOGUE:
            got = run_mechanism(m, pool, args.fuzz_examples)
            caught = got.caught if recorded else got.found
            ok &= caught
            needed = "not found" if got.fuzz_needed is None else str(got.fuzz_needed)
            bound = f" ({m.fuzz_needed})" if recorded else ""
            print(f"{m.mutant} | {_rows(m)} | {m.upstream} | {m.caught_by}: {got.failed}/{got.cases} | "
                  f"{needed}{bound} | {got.signature}{'' if caught else '  <- NOT CAUGHT'}", flush=True)
    within = "within its recorded fuzz bound" if recorded else f"within {args.fuzz_examples} fuzz examples"
    print(f"catalogue: {len(CATALOGUE)} mechanisms, {'every one caught' if ok else 'SOME NOT CAUGHT'} "
          f"by the fixed scenarios and {within} at world {args.world}")
    return EXIT_PASS if ok else EXIT_FAIL
