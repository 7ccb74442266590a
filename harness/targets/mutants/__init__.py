"""Deliberately wrong clip functions: positive controls for the harness and its fuzzer.

Each module is the reference clip with exactly one mistake that real frameworks have shipped (see
the module docstrings for where). The harness must catch every one of them, and the fuzzer must find
each within a bounded number of drawn layouts; the reference must survive the same budget.
"""

from __future__ import annotations

from harness.targets.target import Target
from . import (
    empty_rank_zero,
    fallback_replicated,
    fp32_copy,
    inf_norm_summed,
    local_coefficient,
    local_root_mean,
    missing_ep_reduction,
    nan_max_dropped,
    nonfinite_flag_local,
    scales_up,
    tp_replicas_summed,
    weights_misaligned,
)

_MODULES = (
    local_root_mean,
    fallback_replicated,
    missing_ep_reduction,
    tp_replicas_summed,
    inf_norm_summed,
    nonfinite_flag_local,
    local_coefficient,
    scales_up,
    empty_rank_zero,
    fp32_copy,
    nan_max_dropped,
    weights_misaligned,
)

MUTANTS: dict[str, Target] = {
    f"mutant-{m.__name__.rsplit('.', 1)[1].replace('_', '-')}": Target(
        f"mutant-{m.__name__.rsplit('.', 1)[1].replace('_', '-')}",
        m.clip,
        (m.__doc__ or "").strip().splitlines()[0],
        origin="mutant",
    )
    for m in _MODULES
}
