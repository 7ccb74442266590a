"""What the harness does differently on the older torch releases of its range (pyproject.toml's
``dependencies``; docs/torch-versions.md has the releases the test suite ran on). One place for every
such difference, each naming the releases it is for, so that raising the floor deletes code here only."""

from __future__ import annotations

import torch


def torch_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the installed torch's), e.g. (2, 13) for '2.13.0+cpu'."""
    major, minor = (version or torch.__version__).split(".")[:2]
    return int(major), int(minor)


# torch 2.6 and 2.7: TCPStore's default libuv backend raises NotImplementedError when handed an
# already-bound socket (master_listen_fd); the legacy backend takes it. libuv takes it from 2.8 on
# (pytorch/pytorch PR #150215), where the default stays.
LISTEN_FD_ON_LIBUV: bool = torch_release() >= (2, 8)
