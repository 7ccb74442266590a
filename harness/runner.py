"""Run one case on one rank, in lockstep with the other ranks.

Every rank executes the same collectives in the same order whatever the function under test does:

1. build the EP-local model, dress it, inject gradients, snapshot them;
2. measure ground truth (private groups): one stats all-reduce + MAX/MIN per mesh dim + one merge;
3. call the target, guarded (``_guarded``); a target with a framework setup (``dress``) gets the same
   guard around it, before the gradients are injected;
4. agree through the store whether any rank failed; if so, every rank builds a fresh generation;
5. measure replication again on the clipped gradients; compute local checks;
6. send the rank's record to rank 0 through the store; rank 0 judges the case.
"""

from __future__ import annotations

import faulthandler
import sys
import time
import traceback
from typing import Any, Callable

from .case import CaseSpec
from .checks import CaseResult, applied_coefficients, evaluate, setup_failed_result, skipped_result
from .context import CaseContext, attach
from .model import local_grads
from .oracle import constructive_norm, gather_stats, measure_replication, measured_norm
from .scenario import Scenario
from .targets import Target, reported_value
from .world import DistWorld


def _describe_exception(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {message[:300]}{where}"


def _guarded(world: DistWorld, fn: Callable[[], Any]) -> tuple[Any, str | None, float]:
    """Run a piece of the function under test (or its framework's setup) on this rank without
    letting a failure leave the rank out of step: an exception is caught and the rank abandons its
    groups at once, so peers blocked in a collective with it fail fast; a Python-level hang is ended
    by faulthandler after a deadline, with every thread's stack on stderr."""
    faulthandler.dump_traceback_later(2 * world.timeout_s + 30, exit=True, file=sys.stderr)
    start = time.perf_counter()
    try:
        return fn(), None, time.perf_counter() - start
    except Exception as exc:  # the code under test may raise anything
        world.abandon()
        return None, _describe_exception(exc), time.perf_counter() - start
    finally:
        faulthandler.cancel_dump_traceback_later()


def _agree_on_errors(world: DistWorld, topic: str, error: str | None) -> list[str | None]:
    """Every rank learns every rank's error (through the store); after any, a fresh generation."""
    errors = [s["error"] for s in world.allgather_json(topic, {"error": error}, 2 * world.timeout_s + 60)]
    if any(e is not None for e in errors):
        world.regenerate()
    return errors


def run_case(world: DistWorld, case: CaseSpec, scenario: Scenario, target: Target) -> CaseResult | None:
    """Run ``case`` on this rank; rank 0 returns the judged result, the other ranks None."""
    if case.skip is not None:
        return skipped_result(case) if world.rank == 0 else None
    variant = case.variant
    layout = variant.layout
    names = [spec.name for spec in layout.trainable]
    groups = world.mesh(layout.mesh)

    model = scenario.build_model(variant, world.rank, world.device, groups.device_mesh)
    ctx = CaseContext(case, world.rank, world.world_size, world.device, groups.device_mesh, groups.target_groups,
                      world)
    attach(model, ctx)
    scenario.dress(model, variant)
    if target.dress is not None:
        _, error, seconds = _guarded(world, lambda: target.dress(model, ctx))
        errors = _agree_on_errors(world, "dress", error)
        if any(e is not None for e in errors):
            if world.rank != 0:
                return None
            return setup_failed_result(case, constructive_norm(layout, variant.injection, case.norm_type),
                                       errors, seconds)
    scenario.inject(model, variant, world.rank)
    pre = {n: (g.detach().clone() if g is not None else None) for n, g in local_grads(model, names).items()}

    stats = gather_stats(names, pre, case.norm_type, world.rank, world.world_size, world.harness_world, world.device)
    pre_rep = measure_replication(names, pre, stats, layout.mesh, groups.harness_groups, world.harness_world,
                                  world.device)

    value, error, seconds = _guarded(
        world, lambda: reported_value(target.fn(model, max_norm=case.max_norm, norm_type=case.norm_type)))
    if any(e is not None for e in _agree_on_errors(world, "status", error)):
        groups = world.mesh(layout.mesh)

    post = local_grads(model, names)
    post_stats = gather_stats(names, post, case.norm_type, world.rank, world.world_size, world.harness_world,
                              world.device)
    post_rep = measure_replication(names, post, post_stats, layout.mesh, groups.harness_groups,
                                   world.harness_world, world.device)
    record: dict[str, Any] = {
        "reported": value,
        "error": error,
        "seconds": seconds,
        "local": applied_coefficients(pre, post),
    }
    records = world.gather_json("record", record, 2 * world.timeout_s + 60)
    if records is None:
        return None
    truth = constructive_norm(layout, variant.injection, case.norm_type)
    measured = measured_norm(stats, pre_rep, layout.mesh, case.norm_type)
    return evaluate(case, truth, measured, stats, pre_rep, post_rep, records)
