"""The rendezvous of a ``clipcheck run`` launch, on the loopback interface only.

torch's c10d rendezvous, which ``clipcheck run`` and ``clipcheck matrix`` used through the elastic
agent they run in process, hosts two TCP stores (the rendezvous's, and the one the ranks bootstrap
from and the harness's records travel through) that listen on every interface, IPv4 and IPv6: anyone
on the network could read and write a run's records. A launch of ``clipcheck run`` is one machine, so
both stores are handed a socket bound to 127.0.0.1 (``pool.loopback_store``, as the warm worlds'
store) by a rendezvous backend of our own, ``clipcheck-loopback``: the c10d backend with those
stores. A job over several machines is plain torchrun's, with its documented ``--rdzv_endpoint``.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from harness.run.hosts.pool import loopback_store

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
    from torch.distributed.launcher.api import LaunchConfig

BACKEND = "clipcheck-loopback"
LOOPBACK = "127.0.0.1"
STORE_TIMEOUT_S = 300.0

_registered = False


def _loopback_handler(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    class LoopbackRendezvousHandler(DynamicRendezvousHandler):
        """The c10d rendezvous whose ranks' store, too, listens on the loopback interface only."""

        def _create_tcp_store_server(self, master_addr: Any, master_port: Any) -> Any:
            return loopback_store(params.max_nodes * 64, STORE_TIMEOUT_S)

        def get_backend(self) -> str:
            return BACKEND

    store = loopback_store(params.max_nodes, STORE_TIMEOUT_S)
    return LoopbackRendezvousHandler.from_backend(params.run_id, store, C10dRendezvousBackend(store, params.run_id),
                                                  params.min_nodes, params.max_nodes, LOOPBACK)


def launch_config(nproc: int) -> LaunchConfig:
    """One node, ``nproc`` ranks, a fresh rendezvous on loopback, no restarts (the launcher resumes
    itself after a crash, at the next case)."""
    global _registered
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.launcher.api import LaunchConfig

    if not _registered:
        rendezvous_handler_registry.register(BACKEND, _loopback_handler)
        _registered = True
    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                        rdzv_backend=BACKEND, rdzv_endpoint=f"{LOOPBACK}:0", local_addr=LOOPBACK, max_restarts=0,
                        monitor_interval=0.1, start_method="fork")  # used by a function entry point only
