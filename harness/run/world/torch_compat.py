"""What the harness does differently on the older torch releases of its range (pyproject.toml's
``dependencies``; docs/torch-versions.md has the releases the test suite ran on). One place for every
such difference, each naming the releases it is for, so that raising the floor deletes code here only."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def torch_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the installed torch's), e.g. (2, 13) for '2.13.0+cpu'."""
    major, minor = (version or torch.__version__).split(".")[:2]
    return int(major), int(minor)


# torch 2.6 and 2.7: TCPStore's default libuv backend raises NotImplementedError when handed an
# already-bound socket (master_listen_fd); the legacy backend takes it. libuv takes it from 2.8 on
# (pytorch/pytorch PR #150215), where the default stays.
LISTEN_FD_ON_LIBUV: bool = torch_release() >= (2, 8)


def set_group_timeout(timeout: datetime.timedelta, group: "dist.ProcessGroup") -> None:
    """A process group's collective timeout. torch 2.14 made it public (``dist.set_timeout``) and
    2.15 deprecates the private ``_set_pg_timeout`` that 2.6 to 2.13 have (a FutureWarning on every
    call there): the public one where it exists."""
    public = getattr(dist, "set_timeout", None)
    if public is not None:
        public(timeout, group)
    else:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def member_group(made: object) -> "dist.ProcessGroup":
    """The group ``dist.new_group`` / ``new_subgroups_by_enumeration`` made for this rank. torch 2.14's
    annotations add the non-member sentinel (and None) to what they return, which 2.13's omit; the
    harness only builds groups that contain the calling rank, so anything else is a harness bug and
    says so here rather than as an AttributeError inside a later collective."""
    if not isinstance(made, dist.ProcessGroup):
        raise RuntimeError(f"clipcheck built a process group this rank is not a member of (got {made!r})")
    return made


def registered_groups() -> list["dist.ProcessGroup"]:
    """The process groups in torch's own map of them (``_world.pg_map``, private, present in every release
    of the range), the default group included; empty where it is missing."""
    world = getattr(dist.distributed_c10d, "_world", None)
    return list(getattr(world, "pg_map", None) or {})


def groups_alive() -> int:
    """How many process groups this process is a member of in the current default group's lifetime, the
    default group included: torch's own map of them (``_world.pg_map``, private, present in every release
    of the range), emptied when the default group is destroyed. 0 where it is missing."""
    world = getattr(dist.distributed_c10d, "_world", None)
    return len(getattr(world, "pg_map", None) or {})
