"""OpenMP's thread pool across a fork, and the thread count a rank computes with.

Why: GNU OpenMP (libgomp: torch's CPU builds and MKL's GNU threading layer run on it) keeps the
threads of a thread's last parallel region in a pool and hands them the next region's work. ``fork``
copies the pool's bookkeeping into the child but none of its threads, so the child's first parallel
region waits forever for threads that do not exist. A launcher that had computed with two threads
(``OMP_NUM_THREADS=2``, or unset or empty: then torch uses every core) forked ranks that hung in their
first ``torch.arange``. GNU OpenMP does nothing about it at fork time; the fix is on the parent's side:
OpenMP 5.0's ``omp_pause_resource_all`` ends the calling thread's pool (its threads join, the pool is
freed), so a child forked right after it starts without one and builds its own on its first region.

``release_before_fork`` does that in the forking thread before every ``os.fork`` of this process
(``os.register_at_fork``, installed when this module is imported: the modules that fork ranks import
it, so do the fork servers that preload them). A parallel region run afterwards in the parent simply
builds a new pool. Only the forking thread's pool matters: the other threads, and their pools, do not
exist in the child.

Where the pool cannot be released (no OpenMP 5.0 entry point, a region still open on the forking
thread), the child must not wait on it: ``rank_threads`` then gives one thread, which never enters a
parallel region.
"""

from __future__ import annotations

import ctypes
import os
from typing import Mapping, MutableMapping

OMP_PAUSE_HARD = 2
"""``omp_pause_hard`` of OpenMP 5.0's ``omp_pause_resource_t``: the runtime's threads end, its state
is freed."""

RUNTIME_PREFIXES = ("libgomp", "libiomp", "libomp")
"""The OpenMP runtimes torch and its BLAS load (GNU's; Intel's and LLVM's also take the pause)."""

DEFAULT_RANK_THREADS = 1
"""A rank's intra-op threads when the environment names no positive count: the ranks of a launch
share this machine's cores, so one each is what a fresh ``torchrun`` rank with the usual
``OMP_NUM_THREADS=1`` does."""

_runtimes: dict[str, ctypes.CDLL] = {}
"""The runtimes opened so far, by path."""

_unreleased: str | None = None
"""Why the pool could not be released at the last fork (None: released, or there was none). Read in
the child, which inherits the parent's value of it with the rest of the memory."""


def _loaded_runtimes() -> list[str]:
    """The paths of the OpenMP runtimes mapped into this process (a wheel's vendored copy included,
    whatever its hashed name), found where the dynamic loader put them."""
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split(None, 5) for line in maps]
    except OSError:  # not Linux: nothing to release (macOS's and Windows' runtimes are not GNU's)
        return []
    paths = {f[5].strip() for f in fields if len(f) == 6 and f[5].startswith("/")}
    return sorted(p for p in paths if os.path.basename(p).startswith(RUNTIME_PREFIXES))


def release_before_fork() -> None:
    """End the forking thread's OpenMP pool, so that the child starts without one (the module
    docstring); record why not where it cannot. Runs inside ``os.fork``: it never raises."""
    global _unreleased
    problems = []
    try:
        for path in _loaded_runtimes():
            if path not in _runtimes:  # dlopen of a loaded path returns that copy: nothing new is loaded
                _runtimes[path] = ctypes.CDLL(path)
            pause = getattr(_runtimes[path], "omp_pause_resource_all", None)
            if pause is None:
                problems.append(f"{os.path.basename(path)} has no omp_pause_resource_all")
                continue
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            if pause(OMP_PAUSE_HARD) != 0:
                problems.append(f"{os.path.basename(path)} refused to pause (a parallel region is open)")
    except Exception as exc:  # noqa: BLE001 - a fork must go on; the child then keeps to one thread
        problems.append(f"{type(exc).__name__}: {exc}")
    _unreleased = "; ".join(problems) or None


def requested_threads(environ: Mapping[str, str]) -> int | None:
    """The intra-op thread count ``OMP_NUM_THREADS`` asks for: a positive integer, else None (unset,
    empty, or text OpenMP itself would reject or read as a list of levels)."""
    text = environ.get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def rank_threads(environ: Mapping[str, str]) -> int:
    """The intra-op threads a rank computes with: what ``OMP_NUM_THREADS`` asks for, else
    ``DEFAULT_RANK_THREADS``; one where the parent's pool could not be released before this process
    was forked (a second thread would wait on the inherited pool forever)."""
    if _unreleased is not None:
        return 1
    return requested_threads(environ) or DEFAULT_RANK_THREADS


def name_rank_threads(environ: MutableMapping[str, str]) -> None:
    """Write the ranks' thread count into ``environ`` where it names none (unset, empty, not a positive
    integer), before ranks are started from it: a rank started as a fresh interpreter reads it there,
    as torch does, and a forked one through ``rank_threads``."""
    if requested_threads(environ) is None:
        environ["OMP_NUM_THREADS"] = str(DEFAULT_RANK_THREADS)


os.register_at_fork(before=release_before_fork)
