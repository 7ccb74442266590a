"""Where a launch's CPU goes, phase by phase: a sampling profile (py-spy) of one ``clipcheck run``,
every rank included, folded into the phases of a case.

    pip install py-spy
    python bench/phase_profile.py --nproc 2                      # the default matrix's torch-only and
    python bench/phase_profile.py --nproc 4 --scenario dense_dp  # framework scenarios, or any selection

Why sampling and not timers in the runner: the runner's hot path stays free of instrumentation, and
the breakdown includes what timers would miss (imports a framework does inside its first call, shown
apart as "... (its imports)"). Each sample is attributed to the outermost phase function on its stack
below ``run_case``: build (model, meshes), framework setup (a target's ``dress``: the framework's own
wrapping and optimizer, guarded like the call), inject, measure (stats and the MAX rounds of the
pre-call truth), target (the clip function under test), effects (post-call snapshots and replica
digests), exchange (the store rounds; a store wait holds the GIL, so time spent waiting there for the
slowest rank is sampled too), judge; samples under an import at start-up, outside any case, or in
the launcher are reported apart. Other idle waits are not sampled (py-spy without ``--idle``), so
the figures are CPU, not wall time; the watchdog thread's timed wait is counted apart (py-spy does
not always see it as idle).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SCENARIOS = ("xorl_ep_lora,deepspeed_autoep,dense_dp,torchtitan_ep,megatron_moe_tp,fsdp2_meshes,"
                     "pipeline_stages,hsdp_cp")

PHASES = {
    "_call_target": "target", "guarded": "target",
    "build_model": "build", "dress": "build", "attach": "build", "mesh": "build",
    "inject": "inject", "inject_grads": "inject",
    "measure": "measure", "gather_stats": "measure", "measure_replication": "measure",
    "rank_effects": "effects", "snapshot_params": "effects", "local_grads": "effects", "rank_part": "effects",
    "agree": "exchange", "gather_json": "exchange", "allgather_json": "exchange",
    "evaluate": "judge", "variant_truth": "judge", "measured_norm": "judge", "merged": "judge",
}
"""Function name -> phase, for the first of these names below ``run_case`` on a sampled stack."""


def phase_of(frames: list[str]) -> str:
    # py-spy names a method Class.method; the phases are keyed on the function's own name
    names = [frame.split(" (")[0].strip().rsplit(".", 1)[-1] for frame in frames]
    importing = any("_find_and_load" in frame for frame in frames)
    if any("harness/run/guards/watchdog" in frame for frame in frames):
        return "watchdog thread"
    if importing and "run_case" not in names:
        return "imports at start-up"
    if "run_case" in names:
        below = names[names.index("run_case") + 1:]
        for i, name in enumerate(below):
            if name in PHASES:
                phase = PHASES[name]
                if phase == "target" and "dress" in below[i:]:
                    phase = "framework setup"
                return f"{phase} (its imports)" if phase in ("target", "framework setup") and importing else phase
        return "run_case, other"
    if any("harness/run/" in frame or "harness/commands/run" in frame for frame in frames):
        return "rank, outside a case"
    return "launcher / other"


def py_spy() -> str:
    """py-spy on PATH, else the one installed beside this interpreter (a venv that is not activated)."""
    beside = Path(sys.executable).with_name("py-spy")
    return shutil.which("py-spy") or (str(beside) if beside.exists() else "py-spy")


def fold(raw: Path) -> collections.Counter[str]:
    """Samples per phase from py-spy's raw (collapsed-stack) output."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if n.isdigit():
            counts[phase_of(stack.split(";"))] += int(n)
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--scenario", default=DEFAULT_SCENARIOS)
    p.add_argument("--rate", type=int, default=200, help="samples per second per process (default 200)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "samples.txt"
        cmd = [py_spy(), "record", "--subprocesses", "--rate", str(args.rate), "--format", "raw", "-o", str(raw),
               "--", sys.executable, "-m", "harness", "run", "--nproc", str(args.nproc), "--scenario", args.scenario,
               "--json", str(Path(tmp) / "results.jsonl")]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        if not raw.exists():
            print("phase_profile: py-spy wrote nothing (is it installed? pip install py-spy)", file=sys.stderr)
            return 2
        counts = fold(raw)
    total = sum(counts.values())
    case_phases = set(PHASES.values()) | {"run_case, other", "target (its imports)", "framework setup",
                                          "framework setup (its imports)"}
    in_cases = sum(v for k, v in counts.items() if k in case_phases)
    print(f"{'phase':24} {'samples':>8} {'of all':>7} {'of cases':>9}")
    for phase, n in counts.most_common():
        share = f"{100 * n / in_cases:8.1f}%" if phase in case_phases else " " * 9
        print(f"{phase:24} {n:8d} {100 * n / total:6.1f}% {share}")
    target = counts["target"] + counts["target (its imports)"]
    print(f"harness / target CPU inside cases: {(in_cases - target) / max(target, 1):.2f}x "
          f"({(in_cases - target) / max(counts['target'], 1):.2f}x without the targets' first-call imports)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
