"""Run one case on one rank, in lockstep with the other ranks.

Every rank executes the same collectives in the same order whatever the function under test does:

1. build the EP-local model, dress it, inject gradients, snapshot them;
2. measure ground truth (private groups): one stats all-reduce + MAX/MIN per mesh dim + one merge;
3. call the target, guarded: an exception is caught, and the rank tears its groups down at once so
   peers blocked on it fail fast; a Python-level hang is ended by faulthandler after a deadline;
4. agree through the store whether any rank failed; if so, every rank builds a fresh generation;
5. measure replication again on the clipped gradients; compute local checks;
6. send the rank's record to rank 0 through the store; rank 0 judges the case.
"""

from __future__ import annotations

import faulthandler
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from .case import CaseSpec
from .checks import CaseResult, applied_coefficients, evaluate
from .context import CaseContext, attach
from .model import local_grads
from .oracle import constructive_norm, gather_stats, measure_replication, measured_norm
from .scenario import Scenario
from .targets import Target, reported_value
from .world import DistWorld


@dataclass
class TargetOutcome:
    reported: float | None
    error: str | None
    seconds: float


def _describe_exception(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {message[:300]}{where}"


def call_target(target: Target, model: torch.nn.Module, case: CaseSpec, world: DistWorld) -> TargetOutcome:
    """Call the function under test; never let its failure leave this rank out of step."""
    deadline = 2 * world.timeout_s + 30
    faulthandler.dump_traceback_later(deadline, exit=True, file=sys.stderr)
    start = time.perf_counter()
    try:
        value = target.fn(model, max_norm=case.max_norm, norm_type=case.norm_type)
        return TargetOutcome(reported_value(value), None, time.perf_counter() - start)
    except Exception as exc:  # the function under test may raise anything
        outcome = TargetOutcome(None, _describe_exception(exc), time.perf_counter() - start)
        world.abandon()  # peers blocked in a collective with us get an error now, not at the timeout
        return outcome
    finally:
        faulthandler.cancel_dump_traceback_later()


def run_case(world: DistWorld, case: CaseSpec, scenario: Scenario, target: Target) -> CaseResult | None:
    """Run ``case`` on this rank; rank 0 returns the judged result, the other ranks None."""
    variant = case.variant
    layout = variant.layout
    names = [spec.name for spec in layout.trainable]
    groups = world.mesh(layout.mesh)

    model = scenario.build_model(variant, world.rank, world.device, groups.device_mesh)
    attach(model, CaseContext(case, world.rank, world.world_size, world.device,
                              groups.device_mesh, groups.target_groups))
    scenario.dress(model, variant)
    scenario.inject(model, variant, world.rank)
    pre = {n: (g.detach().clone() if g is not None else None) for n, g in local_grads(model, names).items()}

    stats = gather_stats(names, pre, case.norm_type, world.rank, world.world_size, world.harness_world, world.device)
    pre_rep = measure_replication(names, pre, stats, layout.mesh, groups.harness_groups, world.harness_world,
                                  world.device)

    outcome = call_target(target, model, case, world)
    wait_s = 2 * world.timeout_s + 60
    statuses = world.allgather_json(f"case{case.index}/status",
                                    {"error": outcome.error}, wait_s)
    if any(s["error"] is not None for s in statuses):
        world.regenerate()
        groups = world.mesh(layout.mesh)

    post = local_grads(model, names)
    post_stats = gather_stats(names, post, case.norm_type, world.rank, world.world_size, world.harness_world,
                              world.device)
    post_rep = measure_replication(names, post, post_stats, layout.mesh, groups.harness_groups,
                                   world.harness_world, world.device)
    record: dict[str, Any] = {
        "reported": outcome.reported,
        "error": outcome.error,
        "seconds": outcome.seconds,
        "local": applied_coefficients(pre, post),
    }
    records = world.gather_json(f"case{case.index}/record", record, wait_s)
    if records is None:
        return None
    truth = constructive_norm(layout, variant.injection, case.norm_type)
    measured = measured_norm(stats, pre_rep, layout.mesh, case.norm_type)
    return evaluate(case, truth, measured, stats, pre_rep, post_rep, records)
