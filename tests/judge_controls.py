"""The judge's controls in one run: every correct clip in tests/correct_targets.py (and the reference)
must PASS, every mutant in harness/mutants must FAIL, on the fixed scenarios and under fuzzing.

    python tests/judge_controls.py --fuzz-examples 200 --world 4     # the release check
    python tests/judge_controls.py --fuzz-examples 30 --world 2      # what the test suite runs

Fixed scenarios run through ``clipcheck run`` (all scenarios, default axes); fuzzing runs each
target for ``--fuzz-examples`` examples on one warm world. Prints one line per target and a verdict;
exit status 0 when every control behaved, 1 otherwise.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import correct_targets  # noqa: E402

from harness.fuzz import fuzz  # noqa: E402
from harness.targets.mutants import MUTANTS  # noqa: E402
from harness.run.hosts.pool import RankPool  # noqa: E402

CORRECT = ["reference"] + [
    f"tests/correct_targets.py:{name}" for name, fn in inspect.getmembers(correct_targets, inspect.isfunction)
    if fn.__module__ == correct_targets.__name__ and not name.startswith("_")]


def fixed_verdicts(targets: list[str], world: int, scenarios: str | None) -> dict[str, Counter]:
    """Verdict counts per target over the fixed scenarios at one world size."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.jsonl"
        cmd = [sys.executable, "-m", "harness", "run", "--nproc", str(world), "--target", ",".join(targets),
               "--json", str(out)] + (["--scenario", scenarios] if scenarios else [])
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, check=False)
        verdicts: dict[str, Counter] = {t: Counter() for t in targets}
        for line in out.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("type") == "case":
                verdicts[rec["target"]][rec["verdict"]] += 1
    return verdicts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--fuzz-examples", type=int, default=200)
    p.add_argument("--scenario", default=None, help="fixed scenarios to run (default: all)")
    args = p.parse_args(argv)
    ok = True
    start = time.perf_counter()
    targets = CORRECT + sorted(MUTANTS)
    fixed = fixed_verdicts(targets, args.world, args.scenario)
    with RankPool(args.world, timeout_s=30) as pool:
        for target in targets:
            expect_pass = target in CORRECT
            report = fuzz(target, pool, args.fuzz_examples, derandomize=True, shrink=False)
            counts = fixed[target]
            fixed_ok = (counts["FAIL"] + counts["ERROR"] == 0 and counts["PASS"] > 0) if expect_pass \
                else counts["FAIL"] > 0
            fuzz_ok = report.passed == expect_pass
            ok &= fixed_ok and fuzz_ok
            print(f"{'correct' if expect_pass else 'mutant ':8} {target:48} fixed {dict(counts)} "
                  f"{'ok' if fixed_ok else 'WRONG'}; fuzz {report.examples} examples "
                  f"{'passed' if report.passed else f'failed at {report.failed_at}'} {'ok' if fuzz_ok else 'WRONG'}",
                  flush=True)
    print(f"judge controls at world {args.world}: {'all behaved' if ok else 'SOME CONTROL MISBEHAVED'} "
          f"({time.perf_counter() - start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
