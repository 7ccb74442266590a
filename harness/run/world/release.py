"""Make peers that are blocked in a collective with this rank fail now, not at their timeout.

When the function under test raises on one rank, the other ranks may be waiting in a collective
that this rank will never join. Destroying our process groups closes their connections, and the
peers see "connection closed" at once, but only if the groups are really freed. DTensor keeps
references to process groups on the C++ side, so after any DTensor has been created a gloo group
outlives ``destroy_process_group`` and the peers wait for the full timeout.

For gloo we therefore shut down this process's TCP connections directly (except the rendezvous
store's, which the harness still needs). This is Linux-specific and only ever done on a rank that is
already abandoning its groups; where /proc is unavailable the timeout remains the backstop. NCCL has
a real abort for this.
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

_LISTEN = "0A"


def _tcp_ports_by_inode() -> dict[str, tuple[int, int, str]]:
    ports: dict[str, tuple[int, int, str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            ports[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), state)
    return ports


def shutdown_tcp_connections(keep_ports: set[int]) -> int:
    """Shut down (not close) every connected TCP socket of this process not touching ``keep_ports``."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    ports = _tcp_ports_by_inode()
    count = 0
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not target.startswith("socket:["):
            continue
        info = ports.get(target[len("socket:[") : -1])
        if info is None or info[2] == _LISTEN or info[0] in keep_ports or info[1] in keep_ports:
            continue
        # the process group's own threads may close (and the process reuse) an fd while we look:
        # every step tolerates that, and the fd must still be the same socket when we act on it
        try:
            sock = socket.socket(fileno=int(fd))
        except OSError:
            continue
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == target:
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass
        finally:
            sock.detach()  # the fd still belongs to the process group; it is freed with it
    return count


def release_peers(backend: str, store_port: int | None) -> None:
    """Unblock every peer waiting on this rank, before the groups are destroyed. Best effort: the
    group timeouts remain the backstop, so nothing here may raise."""
    try:
        if backend == "nccl":
            dist.distributed_c10d._abort_process_group()
        else:
            shutdown_tcp_connections({store_port} if store_port else set())
    except Exception:  # noqa: BLE001 - a failed release only costs the timeout
        pass
