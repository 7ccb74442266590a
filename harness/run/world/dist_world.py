"""Process groups for one job, and a control plane that survives a broken group.

Why it is built this way:

* The function under test owns the default group and the DeviceMesh it is given; the harness does
  all of its own collectives on *private* groups. A target that leaves a collective unmatched can
  then never pair its stray op with one of the harness's.
* Whether a case went wrong is agreed through the rendezvous store, not a process group, so ranks
  can agree even when the groups are broken.
* A rank whose target raised abandons every group at once (see ``release``). Peers blocked in a
  collective with it get "connection closed" immediately instead of waiting for a timeout, and the
  failure cascades through ranks that were waiting on *them*. Every group has a timeout, so
  mismatched collectives (no exception anywhere) end too.
* After any such failure every rank builds a fresh *generation* of groups on a new store prefix and
  the run goes on with the next case. A raise on *every* rank (a documented non-finite error) is not
  such a failure: nobody is left waiting, so the groups, and those the target built, are kept
  (``left_call``).
* A generation that holds many groups is renewed between layouts (``before_case``), and the groups a
  generation drops are *freed*, not only forgotten: what a framework built on them is dropped with it
  (``per_generation``, ``at_generation_end``), torch's caches that hold meshes are emptied, and the
  reference cycles that keep the last references are collected (``free_dropped_groups``). A gloo group's
  threads end only when nothing refers to it.
"""

from __future__ import annotations

import datetime
import functools
import gc
import json
import os
import sys
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Hashable, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from harness.run.world.devices import nccl_error_environment
from harness.cases.layout import MeshSpec
from harness.errors import ClipcheckError
from harness.run.world.phase_marks import PhaseMarks
from harness.run.world.release import release_peers
from harness.run.world.torch_compat import groups_alive, member_group, registered_groups, set_group_timeout


class DeadRankError(ClipcheckError, RuntimeError):
    """A rank stopped answering: the run cannot continue and must fail with this message. Under the
    one root (``except ClipcheckError`` catches it), and still a RuntimeError for older handlers."""


class WorldBroken(ClipcheckError, RuntimeError):
    """A rank hung, in the function under test or in the harness's own work (its watchdog said so
    through the store): the world cannot run another case. ``ranks`` hung; ``detail`` says where.
    Under the one root, and still a RuntimeError for older handlers."""

    def __init__(self, ranks: list[int], detail: str) -> None:
        super().__init__(detail)
        self.ranks = ranks
        self.detail = detail


ENDED_KEY = "clipcheck/ended"
"""Set by whichever rank reported the end of a broken run; the others wait for it before exiting,
so a launcher that kills every rank once one exits cannot cut the report short."""

EXIT_STATUS_KEY = "clipcheck/exit_status"
"""Rank 0's exit status, which every rank leaves with (``leave_together``)."""

HUNG_KEY = "clipcheck/hung"
"""Set by a rank stuck in the harness's own work (``post_phase_hang``): which rank, and where; read by a
peer whose collective with it failed (``posted_hang``)."""

HUNG_KEY_POLL_S = 0.5
"""How often ``posted_hang`` looks for ``HUNG_KEY`` while it waits for one."""

PHASE_HUNG_TOPIC = "hung"
"""The topic of the posts a rank stuck in the harness's own work makes in the exchanges ahead of it."""

PHASE_HANG_WINDOW = 8
"""How many exchanges ahead of its own a stuck rank posts its hang: its peers wait in the next one, or,
having passed a gather that only rank 0 waits in, one or two later."""

PEER_POST_WAIT_S = 5.0
"""How long a hung rank's watchdog waits for the other ranks' posts before it reports."""

RAISED_WAIT_S = 2.0
"""How long a rank whose target raised waits for every other rank to leave the same call (raised or
returned) before it abandons its groups: when all of them left, nobody is blocked in a collective with
it and the groups (the target's own included) survive; otherwise the wait only delays the peers'
release by this much."""

UNKNOWN_EXIT_STATUS = 3
"""What a rank leaves with when it cannot learn rank 0's (its store is gone): not judged here."""


@dataclass
class MeshGroups:
    """The target's DeviceMesh for one MeshSpec, and the harness's private twin groups.

    The twins are built on first use, not with the mesh: only a truth measurement needs them (and,
    on nccl, the post-call replica round), and after a raising case the next cases of the variant
    reuse its truth, so a fresh generation would otherwise pay for groups it never uses (what that
    saved: docs/performance.md, "Figures cited by the code"). Every rank reaches that first use at
    the same case, so every rank still creates the same groups in the same order."""

    spec: MeshSpec
    device_mesh: DeviceMesh
    target_groups: dict[str, dist.ProcessGroup]
    _build_harness_groups: Callable[[], dict[str, dist.ProcessGroup]]
    _harness_groups: dict[str, dist.ProcessGroup] | None = None

    @property
    def harness_groups(self) -> dict[str, dist.ProcessGroup]:
        if self._harness_groups is None:
            self._harness_groups = self._build_harness_groups()
        return self._harness_groups


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def process_group_backend(backend: str) -> str:
    """The backend string the default group is created with. On GPUs it is ``cpu:gloo,cuda:nccl``,
    so a user's clip that all-reduces a CPU scalar (as docs/writing-a-target.md's example does) works
    next to CUDA gradients, as in torch's own distributed tests."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


MESH_CACHES = (
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh"),
    ("torch.distributed.tensor._sharding_prop", "ShardingPropagator._propagate_tensor_meta_cached"),
)
"""torch's own ``functools`` caches whose keys hold a DeviceMesh (module, attribute path)."""


def forget_dtensor_caches() -> None:
    """Empty DTensor's caches that outlive a generation of groups when it is dropped.

    * Sharding propagation: torch 2.13 caches output specs keyed on the DeviceMesh's *value*; the next
      generation's mesh is equal by value but names new process groups, so a cached spec would hand a
      later case the old generation's group names ("Could not resolve the process group registered
      under the name 11"), or, since numbering restarts, an unrelated group of the new one: a false FAIL
      of a correct clip (found with torchtune's TP plan after a raising case).
    * Every other cache whose keys or values hold a mesh (``MESH_CACHES``, and the redistribution
      planners, keyed on a weak reference to their mesh but holding it strongly): a mesh holds its
      groups, so each kept every mesh it ever saw alive, with its groups' threads, for the life of the
      process.

    Private torch hooks, used where present."""
    clear_cpp = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_cpp is not None:
        clear_cpp()
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute

    caches: list[object] = [getattr(DTensor._op_dispatcher.sharding_propagator, "propagate_op_sharding", None)]
    for module, path in MESH_CACHES:
        cached: object = sys.modules.get(module)
        for name in path.split("."):
            cached = getattr(cached, name, None)
        caches.append(cached)
    for cached in caches:
        clear = getattr(cached, "cache_clear", None)
        if clear is not None:
            clear()
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:
        clear_planners()


GROUP_BUDGET = 8
"""Process groups a rank may hold (the default group included) at the end of a case before the next
layout starts a fresh generation (``DistWorld.before_case``). Every mesh a case asks for stays cached for
the generation (its target groups, the harness's twins, spans), and so do the groups a framework builds
(``per_generation``); each live gloo group keeps two worker threads and a transport thread that wakes every
few milliseconds, so groups held idle cost CPU and threads (docs/performance.md, "Process groups: freed,
not only forgotten")."""


COLLECTIONS_MAX = 4
"""Full collections ``free_dropped_groups`` makes at most (two suffice in practice: see its docstring)."""


RELEASE_WAIT_S = 30.0
"""How long ``free_dropped_groups`` waits for the dropped groups' destructors (each joins its own threads);
one still running after that finishes in the background."""


def free_dropped_groups(held: list[dist.ProcessGroup]) -> None:
    """Free the process groups nothing refers to any more, so that their threads end.

    Dropping them is not enough: ``destroy_process_group`` only forgets a gloo group (its ``shutdown``
    stops no thread); the threads end when the C++ object is destroyed, and the last references to it
    often sit in reference cycles (a framework's modules and their hooks, a DeviceMesh and its children),
    which only a collection of the oldest generation breaks, and Python makes one rarely. One collection
    does not always do: what it frees can release C++ objects (autograd nodes, hooks) that held the last
    references into other cycles, garbage only for the next one; so collect until nothing is found.

    ``held`` (emptied here) keeps the dropped groups alive through the collections, so that their
    destructors run afterwards, each in a thread of its own: a gloo group's destructor joins its
    transport thread, which notices only at its next poll, and one after another those waits added up to
    most of a renewal's time (docs/performance.md, "World 4, phase by phase"); torch releases the GIL while
    it destroys a group, so the waits overlap. A group something else still refers to (DTensor's C++ side)
    lives on, as before."""
    for _ in range(COLLECTIONS_MAX):
        if gc.collect() == 0:
            break
    releasers = []
    while held:
        box = [held.pop()]
        releaser = threading.Thread(target=box.clear, name=f"clipcheck-release-{len(held)}", daemon=True)
        del box
        releasers.append(releaser)
    for releaser in releasers:
        releaser.start()
    deadline = time.monotonic() + RELEASE_WAIT_S
    for releaser in releasers:
        releaser.join(max(0.0, deadline - time.monotonic()))


T = TypeVar("T")


class DistWorld:
    """One rank's view of the job: rank, device, groups of the current generation, and the store."""

    def __init__(self, backend: str | None = None, timeout_s: float = 60.0, start: bool = True) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.backend = backend or default_backend()
        self.timeout_s = float(timeout_s)
        if self.backend == "nccl":
            os.environ.update(nccl_error_environment(os.environ))  # errors raised where they happen
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        self.store_port = int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None
        self.store = self._connect_store()
        # a second connection for the watchdog: a store client serves one call at a time, and the
        # main thread may be blocked in one (a stray new_group waits on the store)
        self.side_store = self._connect_store(client=True)
        self.generation = 0
        self._exchanges = 0
        self._posted: list[str] = []
        self._calls = 0
        self._call_key: str | None = None
        self.abandoned = False
        """This rank abandoned its groups in the current generation (``abandon``): every rank must regenerate."""
        self.groups_at_case_end = 0
        """The most groups any rank held at the end of the last case (``guard.agree``: alike on every
        rank); past ``GROUP_BUDGET``, a renewal is due (``before_case``)."""
        self._dropped_groups = False  # groups were dropped since the last ``free_dropped_groups``
        self._held_groups: list[dist.ProcessGroup] = []
        """The groups this rank dropped, kept until ``free_dropped_groups`` destroys them together."""
        self._per_generation: dict[Hashable, Any] = {}
        self._releases: list[Callable[[], None]] = []
        self._last_layout: Hashable = None
        self._meshes: dict[MeshSpec, MeshGroups] = {}
        self._harness_world: dist.ProcessGroup | None = None
        self._lock = threading.Lock()
        self._hung: str | None = None
        self.hang_handler: Callable[[str], None] = self.default_hang_handler
        self.phase_marks = PhaseMarks(self.rank)
        """Where this rank is, for its launcher to read should it die (``phase_marks``)."""
        self.while_waiting: Callable[[], AbstractContextManager[Any]] = nullcontext
        """Entered around each wait for the other ranks' posts: a phase watch pauses there (``guard.phase_watch``)."""
        self.stop_reason: str | None = None
        """Set (on every rank alike) when this world must not run another case (``stop_after_case``)."""
        if start:
            self.start()

    def start(self) -> None:
        """Create the first generation of process groups (after the store, so that ranks can first
        agree on their plans through it)."""
        self._init_generation()

    # -- setup ------------------------------------------------------------------------------------
    def _connect_store(self, client: bool = False) -> dist.Store:
        if "MASTER_ADDR" not in os.environ:
            if self.world_size != 1:
                raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR is unset: launch with torchrun")
            return self.store if client else dist.HashStore()
        agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            self.world_size,
            is_master=(self.rank == 0 and not agent_hosts_store and not client),
            timeout=datetime.timedelta(seconds=max(self.timeout_s * 4, 120)),
        )

    @property
    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def _init_generation(self) -> None:
        prefix = dist.PrefixStore(f"clipcheck/gen{self.generation}", self.store)
        dist.init_process_group(
            process_group_backend(self.backend),
            store=prefix,
            rank=self.rank,
            world_size=self.world_size,
            timeout=self._timeout,
        )
        self._harness_world = None  # built on first use, like a mesh's harness groups
        self._meshes = {}
        self._spans: dict[tuple[MeshSpec, tuple[str, ...]], dist.ProcessGroup] = {}

    @property
    def harness_world(self) -> dist.ProcessGroup:
        if self._harness_world is None:
            self._harness_world = member_group(dist.new_group(timeout=self._timeout))
        return self._harness_world

    def mesh(self, spec: MeshSpec) -> MeshGroups:
        """Groups for ``spec`` in this generation, built once (every rank calls in the same order)."""
        if spec not in self._meshes:
            spec.check_world(self.world_size)
            # the target's mesh is a plain DeviceMesh, so sub-meshes (mesh["ep_fsdp"]) and flattening
            # work as in any training script; its groups get the case timeout like every other group
            ids = torch.arange(self.world_size).reshape(spec.sizes)
            device_mesh = DeviceMesh(self.device.type, ids, mesh_dim_names=spec.names)
            target = {axis: device_mesh.get_group(axis) for axis in spec.names}
            self.give_case_timeout(device_mesh)
            self._meshes[spec] = MeshGroups(spec, device_mesh, target, functools.partial(self._harness_twins, spec))
        return self._meshes[spec]

    def give_case_timeout(self, *meshes: DeviceMesh | None) -> None:
        """The case's collective timeout on every group of ``meshes`` (the harness's, or those a framework
        builds for itself), so that a collective stuck in any of them fails within the case's bound."""
        for mesh in meshes:
            for group in mesh.get_all_groups() if mesh is not None else ():
                set_group_timeout(self._timeout, group)

    def _harness_twins(self, spec: MeshSpec) -> dict[str, dist.ProcessGroup]:
        return {axis: self._subgroup(spec.groups(axis)) for axis in spec.names}

    def group_over(self, spec: MeshSpec, axes: tuple[str, ...]) -> dist.ProcessGroup:
        """A target-facing group spanning ``axes`` of ``spec`` (cached for this generation)."""
        key = (spec, tuple(axes))
        if key not in self._spans:
            self._spans[key] = self._subgroup(spec.groups(*axes))
        return self._spans[key]

    def _subgroup(self, enumeration: list[list[int]]) -> dist.ProcessGroup:
        mine, _ = dist.new_subgroups_by_enumeration(enumeration, timeout=self._timeout)
        return member_group(mine)

    # -- failure handling ---------------------------------------------------------------------------
    def left_call(self, raised: bool) -> None:
        """This rank has left a guarded call of the target (every rank calls this once per call, in the
        same order). A rank whose target raised waits (``RAISED_WAIT_S``) for every other rank to have
        left it too; if one has not, it may be blocked in a collective with us: abandon the groups so it
        fails now. When every rank left (all raised, say a documented non-finite error), the groups, and
        those the target built on them, are kept: nothing is regenerated (``guard.agree``)."""
        self._calls += 1
        tag = f"clipcheck/call/{self._calls}"
        mine = f"{tag}/{self.rank}"
        self.store.set(mine, "1")
        if self._call_key is not None:  # every rank passed the exchange after that call: nobody waits on it
            self.store.delete_key(self._call_key)
        self._call_key = mine
        if not raised:
            return
        try:
            self.store.wait([f"{tag}/{r}" for r in range(self.world_size)], datetime.timedelta(seconds=RAISED_WAIT_S))
        except Exception:  # noqa: BLE001 - the store's own timeout type: a peer is still inside the call
            self.abandon()

    def abandon(self) -> None:
        """This rank's case failed: unblock peers waiting on us, then drop every group."""
        if dist.is_initialized():
            release_peers(self.backend, self.store_port)
        self.teardown()
        self.abandoned = True

    def teardown(self) -> None:
        """Drop every group of this generation, and whatever was built on them (``per_generation``,
        ``at_generation_end``). They are freed (their threads ended) at the next ``before_case`` or
        ``close``, once nothing of the case that used them is left."""
        if dist.is_initialized():
            if self.backend == "gloo":  # nccl's groups are left to torch: their teardown was never measured here
                self._held_groups += registered_groups()
            dist.destroy_process_group()
        forget_dtensor_caches()
        self._per_generation = {}
        releases, self._releases = self._releases, []
        for release in releases:
            try:
                release()
            except Exception as exc:  # noqa: BLE001 - a framework's reset failing leaks its groups, nothing worse
                print(f"clipcheck: rank {self.rank}: releasing a framework's process groups failed: "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        self._meshes = {}
        self._spans = {}
        self._harness_world = None
        self._dropped_groups = True

    def groups_alive(self) -> int:
        """Process groups this rank is a member of in this generation, the default group included."""
        return groups_alive()

    def regenerate(self) -> None:
        """A fresh generation of groups after a failed case; every rank must call it."""
        self.teardown()
        self._new_generation()

    def _new_generation(self) -> None:
        self.generation += 1
        self._init_generation()
        self.abandoned = False
        self.groups_at_case_end = 0

    # -- what frameworks build on this generation's groups ---------------------------------------------
    def per_generation(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()`` once per generation of groups for ``key``, as a training job builds its framework's
        groups or meshes once; dropped with the generation, so that nothing of ours keeps its groups
        alive. ``build`` is usually collective: every rank asks for the same keys in the same order."""
        if key not in self._per_generation:
            self._per_generation[key] = build()
        value: T = self._per_generation[key]
        return value

    def at_generation_end(self, release: Callable[[], None]) -> None:
        """Run ``release()`` once, when this generation's groups are dropped: it resets what a framework
        keeps of them in its own module globals (DeepSpeed's groups, VeOmni's parallel state), whose
        references would otherwise keep the dropped groups, and their threads, alive."""
        if release not in self._releases:
            self._releases.append(release)

    def before_case(self, layout: Hashable) -> None:
        """Called by every rank before a case builds its model (``layout``: what its layout is known by,
        alike on every rank), when the last case's model is gone. The groups earlier generations dropped
        are freed here; and when the last case ended with more than ``GROUP_BUDGET`` groups on some rank
        and this case starts another layout (another mesh, another framework setup: new groups), the
        generation is renewed first, its groups freed before the new ones exist. Cases of one layout
        keep their generation: they build no new groups."""
        renew = layout != self._last_layout and self.groups_at_case_end > GROUP_BUDGET
        self._last_layout = layout
        if renew:
            self.teardown()
        self._free_dropped_groups()
        if renew:
            self._new_generation()

    def _free_dropped_groups(self) -> None:
        if self._dropped_groups:
            free_dropped_groups(self._held_groups)
            self._dropped_groups = False

    def close(self) -> None:
        self.teardown()
        self._free_dropped_groups()

    @property
    def exchange_deadline_s(self) -> float:
        """How long a store exchange waits for the slowest rank: past a hung target's deadline, so
        that a hung rank's own post (from its watchdog) arrives before anyone gives up on it."""
        return 2 * self.timeout_s + 60

    def store_round(self, topic: str) -> Callable[[Any], list[Any]]:
        """``allgather_json`` under ``topic``, as a function of the payload (``measure.AllGather``)."""
        return functools.partial(self.allgather_json, topic, timeout_s=self.exchange_deadline_s)

    @property
    def hang_deadline_s(self) -> float:
        """How long the function under test may run before its rank counts as hung: past every
        collective timeout, so a mismatched collective raises (and the world survives) first."""
        return 2 * self.timeout_s + 10

    # -- a hung rank ------------------------------------------------------------------------------
    def post_hung(self, topic: str, payload: dict[str, Any]) -> None:
        """Called from the watchdog thread while the main thread is stuck: post this rank's entry of
        the exchange the main thread would have made next, marked hung, then hand over to
        ``hang_handler`` (which reports or waits, then ends the process)."""
        with self._lock:
            if self._hung is not None:
                return
            keys, mine = self._post(topic, dict(payload, hung=True), self.side_store)
            self._hung = str(payload.get("error")) + self._peer_errors([k for k in keys if k != mine])
        self.hang_handler(self._hung)

    def _peer_errors(self, keys: list[str]) -> str:
        """What the other ranks posted for the exchange this rank hung before: often the exception
        that left it waiting (one rank raised, this one waits in a collective it will never leave).
        Waits a little for them (they post as their own calls end); one clause per rank that raised."""
        try:
            self.side_store.wait(keys, datetime.timedelta(seconds=PEER_POST_WAIT_S))
        except Exception:  # noqa: BLE001 - some never post (they hang too): report those that did
            pass
        raised = []
        for key in keys:
            try:
                if self.side_store.check([key]):
                    error = json.loads(self.side_store.get(key))["value"].get("error")
                    if error and not str(error).startswith("hung"):
                        raised.append(f"; rank {key.rsplit('/', 1)[1]} raised {error}")
            except Exception:  # noqa: BLE001 - best effort: the hang is reported either way
                continue
        return "".join(raised)

    def post_phase_hang(self, message: str) -> None:
        """Called from the watchdog thread while the main thread is stuck in the harness's own work (a
        phase of a case, not the function under test): post the hang in the place of this rank's next
        exchanges, where its peers wait for it whatever the topic (``_read`` raises ``WorldBroken``
        there), and under ``HUNG_KEY``; then hand over to ``hang_handler``."""
        with self._lock:
            if self._hung is not None:
                return
            self._hung = message
            self.side_store.set(HUNG_KEY, json.dumps({"rank": self.rank, "message": message}))
            for ahead in range(1, PHASE_HANG_WINDOW + 1):
                self._post_at(self._exchanges + ahead, PHASE_HUNG_TOPIC, message, self.side_store)
        self.hang_handler(message)

    def posted_hang(self, within_s: float = 0.0) -> WorldBroken | None:
        """A rank's ``post_phase_hang``, as the exception that ends this world, looked for during
        ``within_s`` (a collective with the stuck rank times out before that rank's own deadline); None
        when none came. Main thread only."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                if self.store.check([HUNG_KEY]):
                    posted = json.loads(self.store.get(HUNG_KEY))
                    return WorldBroken([int(posted["rank"])], f"rank {posted['rank']}: {posted['message']}")
            except Exception:  # noqa: BLE001 - a store gone with its host: nothing will come
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(HUNG_KEY_POLL_S)

    def default_hang_handler(self, message: str) -> None:
        """A hung rank that is not the reporter: wait until the run's end is reported, then exit 3."""
        self.wait_ended()
        os._exit(3)

    def stop_after_case(self, reason: str) -> None:
        """The case goes on to its verdict, then this world runs nothing more (a thread the target left
        running would reach the next case). Called on the rank concerned; the ranks agree on it at the
        next exchange before a case (``Executor._report_pending``); a warm world's rank just ends."""
        self.stop_reason = self.stop_reason or reason

    def leave_together(self, status: int) -> int:
        """Rank 0's exit status, for every rank to exit with. A job spread over several nodes ends the
        same way on each (torchelastic's agents then take the same path: a node whose ranks all exit 0
        waits in the exit barrier for the others, up to torchelastic's 300 s, and would wait there alone
        when another node's ranks failed and the store host is gone); a rank that cannot learn it exits
        UNKNOWN_EXIT_STATUS."""
        if self.world_size == 1:
            return status
        if self.rank == 0:
            self.side_store.set(EXIT_STATUS_KEY, str(status))
            return status
        try:
            self.side_store.wait([EXIT_STATUS_KEY], datetime.timedelta(seconds=self.exchange_deadline_s))
            return int(self.side_store.get(EXIT_STATUS_KEY))
        except Exception:  # noqa: BLE001 - the store went with rank 0's node
            return UNKNOWN_EXIT_STATUS

    def signal_ended(self) -> None:
        self.side_store.set(ENDED_KEY, "1")

    def wait_ended(self) -> None:
        try:
            self.side_store.wait([ENDED_KEY], datetime.timedelta(seconds=self.timeout_s + 30))
        except Exception:  # noqa: BLE001 - the reporter died too; nothing left to wait for
            pass

    # -- store control plane ----------------------------------------------------------------------
    # Exchanges are numbered: every rank makes them in the same order, so the n-th exchange has the
    # same key on every rank however many cases a process runs (a warm pool reuses case indices).
    # The key is the exchange's number and the rank; the topic travels in the post (``_read`` checks it),
    # so a rank stuck outside any exchange can still post where its peers wait (``post_phase_hang``).
    def _post(self, topic: str, payload: Any, store: dist.Store | None = None) -> tuple[list[str], str]:
        self._exchanges += 1
        return self._post_at(self._exchanges, topic, payload, store or self.store)

    def _post_at(self, number: int, topic: str, payload: Any, store: dist.Store) -> tuple[list[str], str]:
        tag = f"clipcheck/ctl/{number}"
        mine = f"{tag}/{self.rank}"
        store.set(mine, json.dumps({"topic": topic, "value": payload}))
        return [f"{tag}/{r}" for r in range(self.world_size)], mine

    def _wait(self, keys: list[str], topic: str, timeout_s: float) -> None:
        try:
            with self.while_waiting():
                self.store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except Exception:  # the store raises its own timeout type; say which ranks are missing
            missing = sorted(int(k.rsplit("/", 1)[1]) for k in keys if not self.store.check([k]))
            if not missing:
                return
            raise DeadRankError(
                f"rank(s) {missing} did not report for {topic} within {timeout_s:.0f} s: "
                "they hung or died (see their own output)"
            ) from None

    def _read(self, keys: list[str], topic: str) -> list[Any]:
        """Every rank's post of an exchange (one round trip), checked to be of ``topic``: a rank stuck in
        the harness's own work posted its hang in its place (``post_phase_hang``), and ranks whose
        exchanges differ are out of step, which no case may be judged from."""
        posts = [json.loads(v) for v in self.store.multi_get(keys)]
        for rank, post in enumerate(posts):
            if post["topic"] == PHASE_HUNG_TOPIC:
                raise WorldBroken([rank], f"rank {rank}: {post['value']}")
            if post["topic"] != topic:
                raise DeadRankError(f"rank {rank} posted {post['topic']!r} where rank {self.rank} expected {topic!r}: "
                                    "the ranks are out of step")
        return [post["value"] for post in posts]

    def allgather_json(self, topic: str, payload: Any, timeout_s: float) -> list[Any]:
        """Every rank posts ``payload`` under ``topic`` and gets every rank's, in rank order. A rank
        whose watchdog already posted for it (it hung, then came back) does not post again."""
        with self._lock:
            if self._hung is not None:
                raise WorldBroken([self.rank], self._hung)
            keys, mine = self._post(topic, payload)
        self._wait(keys, topic, timeout_s)
        values = self._read(keys, topic)
        # every rank has now passed all earlier exchanges, so nobody will read our older keys again
        for old in self._posted:
            self.store.delete_key(old)
        self._posted = [mine]
        return values

    def gather_json(self, topic: str, payload: Any, timeout_s: float) -> list[Any] | None:
        """Like allgather_json, but only rank 0 waits and receives; the others get None."""
        keys, mine = self._post(topic, payload)
        self._posted.append(mine)
        if self.rank != 0:
            return None
        self._wait(keys, topic, timeout_s)
        return self._read(keys, topic)
