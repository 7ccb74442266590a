"""Run one case on one rank, in lockstep with the other ranks.

Every rank executes the same collectives in the same order whatever the function under test does:

1. build the EP-local model, dress it, inject gradients (or, for a framework that acts on gradients
   between its backward and its clip, produce them through its own path: ``delivery``), snapshot
   gradients and parameters;
2. measure ground truth: per-rank stats through the store, with each gradient's digest on gloo (every
   rank compares the holders' digests itself) or, on nccl, one MAX per mesh axis (private groups) and
   the verdicts merged through the store; once per layout variant and norm type (``truth_cache``: later
   cases of the variant start from bit-identical gradients, which each rank verifies);
3. call the target, guarded (``guard.guarded``): an exception is caught, a Python-level hang is noticed by
   a watchdog (``watchdog``) and posted to the other ranks; a target with a framework setup
   (``dress``) gets the same guard around it, before the gradients are injected;
4. check what the harness can see at once: the return type, the default process group;
5. agree through the store whether any rank failed; if ranks disagree or one abandoned its groups (a
   raise while a peer was still inside the call), every rank builds a fresh generation;
   if a rank hung, ``WorldBroken`` ends the run (the world cannot run another case);
6. measure what the target did (``effects``; its flags and gradient wrappers, and what changes late,
   after the threads it started have finished: ``aftermath``) and whether true replicas are still identical
   (``replicas``: digests in the records on gloo, a MAX round on nccl; mangled gradients dropped
   first, so a target that reshapes a gradient cannot crash the harness; merged by rank 0);
7. send the rank's record to rank 0 through the store; rank 0 judges the case.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable, cast

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from harness.cases.variant import CaseSpec
from harness.judge.records import CaseResult, RankRecord
from harness.judge.checks import evaluate, setup_failed_result, skipped_result
from harness.clipmath import local_tensor
from harness.cases.context import CaseContext, attach
from harness.run.case.model_state import GlobalState, LateWatch, ModelState, fingerprint, global_state_fault, settled_changes
from harness.run.case.effects import CallEffects, FromSnapshot, canonical_nans, changed_params, rank_effects, snapshot_params
from harness.cases.model import generated_grads, local_grads
from harness.run.case.delivery import expected_copies, undelivered
from harness.run.case import replicas
from harness.run.case.measure import digests_for_truth, gather_stats, pre_call_replication
from harness.judge.truth import measured_norm
from harness.cases.constructive import variant_truth
from harness.cases.scenario import Scenario
from harness.cases.target import Target
from harness.targets.target import reported_precision, reported_value
from harness.run.guards.leftovers import census, left_behind, threads_fault
from harness.run.world.dist_world import DistWorld
from harness.run.case.guard import agree, guarded, phase_watch
from harness.run.case.launch_state import LaunchState


def where_defined(fn: Callable[..., Any]) -> str:
    """``name at file:line`` of a callable (through ``functools.partial`` and decorators), for a
    fault that is the function's own but is noticed after it returned."""
    inner = inspect.unwrap(fn.func if isinstance(fn, functools.partial) else fn)
    name = getattr(inner, "__qualname__", None) or type(inner).__name__
    try:
        code = inspect.getsourcefile(inner) or inspect.getfile(inner)
        line = inspect.getsourcelines(inner)[1]
    except (TypeError, OSError):
        return name
    return f"{name} at {code}:{line}"


def _call_target(target: Target, model: Any, case: CaseSpec) -> Any:
    value = target.fn(model, max_norm=case.max_norm, norm_type=case.norm_type)
    # materialize a DTensor here, inside the guard: it is a collective every rank makes
    return value.full_tensor() if isinstance(value, DTensor) else value


def run_case(world: DistWorld, launch: LaunchState, case: CaseSpec, scenario: Scenario,
             target: Target, effects_measured: bool = True) -> CaseResult | None:
    """Run ``case`` on this rank; rank 0 returns the judged result, the other ranks None. ``launch`` is what
    this rank keeps across the cases of its host (the truth measured, the model checked again later).
    ``effects_measured`` False: a one-group run read for its norm alone (the blame's, counting's
    establishment): what the call did to gradients and parameters is not measured, so its checks of them
    pass unread; everything that keeps the world sound (what it left running, the default group) is."""
    if case.skip is not None:
        return skipped_result(case) if world.rank == 0 else None
    variant = case.variant
    layout = variant.layout
    names = [spec.name for spec in layout.trainable]
    with phase_watch(world, "build"):
        world.before_case((case.scenario, variant.label, layout.mesh))
        groups = world.mesh(layout.mesh)
        built = variant.as_built_for(target.dress is not None)
        model = scenario.build_model(built, world.rank, world.device, groups.device_mesh)
        if built.dtensor_axes:  # a flattened sub-mesh brings groups of its own: stuck, they fail within the case's bound
            world.give_case_timeout(*{p.device_mesh for p in model.parameters() if isinstance(p, DTensor)})
        ctx = CaseContext(case, world.rank, world.world_size, world.device, groups.device_mesh, groups.target_groups,
                          world)
        attach(model, ctx)
        scenario.dress(model, variant)
    dress = target.dress
    if dress is not None:
        _, error, seconds = guarded(world, "dress", lambda: dress(model, ctx))
        statuses = agree(world, "dress", {"error": error})
        if any(s["error"] is not None for s in statuses):
            if world.rank != 0:
                return None
            return setup_failed_result(case, [s["error"] for s in statuses], seconds)
    undelivered_here: list[str] = []
    backward = target.backward if variant.synthetic is None else None
    if backward is None:
        with phase_watch(world, "inject"):
            scenario.inject(model, variant, world.rank)
    else:  # the framework's own gradient path (its hooks, reduce-scatter): what arrives must be the layout's
        expected = expected_copies(generated_grads(layout, variant.injection, world.rank), world.device)
        _, error, seconds = guarded(world, "backward",
                                     lambda: backward(model, ctx, {n: expected.get(n) for n in names}))
        statuses = agree(world, "backward", {"error": error})
        if any(s["error"] is not None for s in statuses):
            if world.rank != 0:
                return None
            return setup_failed_result(case, [s["error"] for s in statuses], seconds, step="backward")
        undelivered_here = undelivered({n: expected.get(n) for n in names}, local_grads(model, names))
    with phase_watch(world, "measure"):
        pre = {n: (g.detach().clone() if g is not None else None) for n, g in local_grads(model, names).items()}
        params_before = snapshot_params({n: local_tensor(p) for n, p in model.named_parameters()}) \
            if effects_measured else {}
        # a measured layout's copies are classes of bits, whatever the mesh: always digests (CPU replays)
        digests = digests_for_truth(world.backend, layout.mesh) or layout.measured
        stats, pre_rep, stale_truth = launch.truth_cache.measure(
            case, pre,
            lambda for_replication: gather_stats(names, pre, case.norm_type, world.store_round("stats"),
                                                 digests=digests and for_replication),
            lambda table: pre_call_replication(names, pre, table, layout.mesh, lambda: groups.harness_groups,
                                               world.store_round("replication"), world.device, layout.measured))
        default_group = dist.group.WORLD
        state_before, threads_before, settings = ModelState.of(model), set(threading.enumerate()), GlobalState.of()
        before = census()
    value, error, seconds = guarded(world, "status", lambda: _call_target(target, model, case))
    reported, fault, broken = None, global_state_fault(settings), False  # restored for what follows
    left = left_behind(before)  # processes: killed now (threads are waited for below: ``aftermath``)
    if error is None:
        try:
            reported = reported_value(value)
        except (TypeError, ValueError, OverflowError) as exc:  # reported at the user's function, not the harness line
            fault = "; ".join(filter(None, [f"{exc} (returned by {where_defined(target.fn)})", fault]))
    if not dist.is_initialized() or dist.group.WORLD is not default_group:
        fault = "; ".join(filter(None, [fault, "the clip function destroyed or replaced the default process group"]))
        broken = True
    if left is not None:  # a child process may have used this rank's groups: fresh ones for all
        fault, broken = "; ".join(filter(None, [fault, left])), True
    generation = world.generation
    agree(world, "status", {"error": error, "fault": fault, "broken": broken}, case_done=True)
    with phase_watch(world, "effects"):
        if world.generation != generation:  # the groups were renewed: what follows measures on the new ones
            groups = world.mesh(layout.mesh)
        if effects_measured:
            post, effects = rank_effects(pre, local_grads(model, names), FromSnapshot(pre),
                                         changed_params(params_before,
                                                        {n: local_tensor(p) for n, p in model.named_parameters()}),
                                         bool(variant.injection.nonfinite), state_before, ModelState.of(model),
                                         in_place=target.in_place)
        else:
            post, effects = {}, CallEffects.unmeasured()
        baseline = fingerprint(model, names)
        late, running = settled_changes(threads_before, model, names, baseline)
        if running:  # its collectives would reach the next case: this world stops after this one
            fault = "; ".join(filter(None, [fault, threads_fault(running)]))
            world.stop_after_case(f"its target left thread(s) {', '.join(running)} running")
        launch.late_watch = LateWatch(model, names, baseline, running)
        # this rank's part only: the parts travel in the records, and rank 0 merges them (NaN payloads
        # carry no meaning: canonical, so that replicas are not told apart by them)
        part = replicas.rank_part(world.backend, names, canonical_nans(post) if variant.injection.nonfinite else post,
                                  stats, groups, world.device) if effects_measured else None
        local = effects.record(late=late, stale_truth=stale_truth, undelivered=undelivered_here, post_replicas=part)
    record: RankRecord = {"reported": reported, "error": error, "fault": fault, "seconds": seconds,
                          "local": local, "precision": reported_precision(value) if error is None else None}
    gathered = world.gather_json("record", record, world.exchange_deadline_s)
    if gathered is None:
        return None
    records = cast(list[RankRecord], gathered)
    with phase_watch(world, "judge"):
        truth = variant_truth(variant, case.norm_type)
        measured = measured_norm(stats, pre_rep, layout.mesh, case.norm_type)
        post_rep = replicas.merge_parts(names, [r["local"]["post_replicas"] for r in records], layout.mesh,
                                        layout.measured) if effects_measured else pre_rep
        return evaluate(case, truth, measured, stats, pre_rep, post_rep, records)
