"""The user's own job as a ``DistWorld``: the control plane of ``harness.audit``.

The harness's failure path (a guarded call, a watchdog that posts a hung rank, agreement through the
rendezvous store, ``guard.guarded`` and ``guard.agree``) needs a ``DistWorld``. Inside a user's
training script the process group is the user's, started by the user's launcher (torchrun, DeepSpeed's,
accelerate, SLURM), so this world adopts it instead of creating one:

* the store is the one the default process group rendezvoused through, behind a prefix of our own
  (and a second client connection for the watchdog, as ``DistWorld`` has, where it is a TCPStore);
* rank and world size are the default group's, the device is the gradients' own;
* it never tears down, aborts or regenerates a group: the groups are the job's. So a rank whose clip
  raises does not release peers blocked in a collective with it (that would need the job's groups
  torn down): they are reported hung once ``hang_deadline_s`` has passed, as in the harness's cases;
* a job without ``torch.distributed`` is a world of one rank on an in-memory store.

Every audit has keys of its own: each rank counts its arrival at the audit in the store (one atomic
``add``), and the count, alike on every rank, names the audit's namespace. An audit's keys so depend
on nothing a rank keeps from earlier audits: after an audit that failed or raised on some ranks, or a
default group renewed between two audits (a warm pool's next test), the next audit neither reads an
earlier one's keys nor waits under keys its peers never write. Within an audit the exchanges are
numbered, every rank making them in the same order.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from harness.run.world.dist_world import DistWorld

PREFIX = "clipcheck-audit"


def _underlying(store: dist.Store) -> dist.Store:
    """The store under the default group's prefix (``init_process_group`` wraps it in one)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


class UserWorld(DistWorld):
    """One rank of the user's job, for the audit's exchanges and its guarded call."""

    def __init__(self, timeout_s: float, device: torch.device) -> None:
        self.group = dist.group.WORLD if dist.is_initialized() else None
        """The default group this world adopted (held, so that a renewed group is never taken for it)."""
        self._user_store: dist.Store | None = (
            _underlying(dist.distributed_c10d._get_default_store()) if dist.is_initialized() else None)
        # gloo here: DistWorld's nccl branch would set the process's CUDA device and NCCL variables
        super().__init__("gloo", timeout_s, start=False)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.backend = str(dist.get_backend()) if dist.is_initialized() else "none"
        self.device = device
        self.store_port = None
        self._connections = (self.store, self.side_store)
        """The store's two connections, without the audit's namespace (``begin_audit`` adds it)."""
        self.audits = 0
        """The audit under way, counted over the job's store: every rank the same number (the module docstring)."""

    def _connect_store(self, client: bool = False) -> dist.Store:
        if self._user_store is None:
            return self.store if client else dist.HashStore()
        store = self._user_store
        if client and isinstance(store, dist.TCPStore):
            # the watchdog's own connection: the main thread may be blocked in a call on the first
            store = dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=max(self.timeout_s * 4, 120)))
        return store

    def begin_audit(self) -> None:
        """Count this rank's arrival at a new audit and take that audit's namespace (the module docstring)."""
        main, side = self._connections
        arrivals = main.add(f"{PREFIX}/arrivals/{self.world_size}", 1)
        self.audits = (arrivals - 1) // self.world_size + 1
        self.store = dist.PrefixStore(f"{PREFIX}/{self.world_size}/{self.audits}", main)
        self.side_store = dist.PrefixStore(f"{PREFIX}/{self.world_size}/{self.audits}", side)
        self._exchanges, self._posted = 0, []

    def post_error(self, error: str) -> None:
        """This rank's clip raised: said at once, under a key of this audit, so a rank whose own
        watchdog reports a hang (its peers stuck in a collective with this rank) can name the cause."""
        self.store.set(f"audit{self.audits}/error/{self.rank}", error)

    def posted_errors(self) -> dict[int, str]:
        """The errors ranks have posted in this audit so far (read without waiting, on the watchdog's
        own connection)."""
        keys = [f"audit{self.audits}/error/{r}" for r in range(self.world_size)]
        return {r: self.side_store.get(key).decode() for r, key in enumerate(keys) if self.side_store.check([key])}

    def start(self) -> None:
        """The job's groups exist already."""

    def abandon(self) -> None:
        """Nothing to abandon: the groups are the job's (peers stuck with this rank are reported hung)."""

    def teardown(self) -> None:
        """Nothing to drop: the groups are the job's."""

    def regenerate(self) -> None:
        """No new generation of groups: the job's stay as they are."""

    def mesh(self, spec: Any) -> Any:
        raise NotImplementedError("the audit's world builds no meshes: the job's own are measured")


_WORLD: list[UserWorld] = []
"""The world of this process's last audit, or nothing."""


def user_world(timeout_s: float, device: torch.device) -> UserWorld:
    """This process's world for the current default group (kept: its store connections), with this
    audit's deadline, device and namespace."""
    world = _WORLD[0] if _WORLD else None
    if world is None or world.group is not (dist.group.WORLD if dist.is_initialized() else None):
        world = UserWorld(timeout_s, device)  # a new default group: the old world's store may be gone
        _WORLD[:] = [world]
    world.timeout_s = float(timeout_s)
    world.device = device
    world.hang_handler = world.default_hang_handler
    world.begin_audit()
    return world
