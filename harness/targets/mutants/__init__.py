"""Deliberately wrong clip functions: positive controls for the harness and its fuzzer.

Each module is the reference clip with exactly one mistake that real frameworks have shipped (see
the module docstrings for where). The harness must catch every one of them, and the fuzzer must find
each within a bounded number of drawn layouts; the reference must survive the same budget.
"""

from __future__ import annotations

from harness.cases.target import Target
from . import (
    cp_replicas_summed,
    dtensor_copy_scaled,
    empty_expert_list,
    empty_rank_zero,
    experts_dropped,
    fallback_replicated,
    fp32_copy,
    generator_exhausted,
    groups_clipped_separately,
    hsdp_replicas_summed,
    inf_norm_summed,
    inf_path_typeerror,
    inf_root_applied,
    local_coefficient,
    local_root_mean,
    missing_ep_reduction,
    nan_max_dropped,
    nonfinite_flag_local,
    norms_added_linearly,
    pp_max_reduce,
    reports_local_norm,
    scales_up,
    stage_local_norm,
    tied_counted_twice,
    tp_filter_drops_shards,
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
    stage_local_norm,
    pp_max_reduce,
    tied_counted_twice,
    empty_expert_list,
    hsdp_replicas_summed,
    cp_replicas_summed,
    reports_local_norm,
    experts_dropped,
    norms_added_linearly,
    groups_clipped_separately,
    tp_filter_drops_shards,
    inf_path_typeerror,
    inf_root_applied,
    generator_exhausted,
    dtensor_copy_scaled,
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
