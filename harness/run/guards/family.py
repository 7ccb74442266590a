"""A process's descendants: each dies with its parent, and none is left behind.

What went wrong without this: spawned ranks (``--spawn-ranks``, every nccl/CUDA run) start in a
session of their own and lived on for minutes after their launcher was killed outright; a forked
rank's own child (a clip that forks a sleeper) kept the launcher waiting, because a child forked from
a rank inherits the pipe whose closing tells the elastic agent that the rank ended; grandchildren
survived the launcher. So:

* every process clipcheck starts asks the kernel to kill it when its parent dies
  (``die_with_parent``; ``PARENT_PID_ENV`` tells a spawned one which parent that is, so a parent that
  died before the request took hold is noticed), and a rank's forked children do the same
  (``children_die_with_this_process``);
* a process that knows its parent's pid also watches it (``die_with_parent(pid)`` starts
  ``watch_parent``): the kernel's request is tied to the parent *thread* and silently refused where
  ``prctl`` is (a sandbox, not Linux), and there, unwatched, a launcher whose matrix is killed
  outright stays alive with its ranks; the watch ends the process and its descendants within
  ``PARENT_POLL_S`` whatever happened to the request;
* launchers and ranks adopt their orphaned descendants (``adopt_orphans``) and end every descendant
  they did not start before they leave (``end_descendants``).

Linux only (prctl, /proc); elsewhere each step does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from pathlib import Path

PARENT_PID_ENV = "CLIPCHECK_PARENT_PID"
"""Set by a launcher for the processes it starts: the pid they must die with."""

PARENT_POLL_S = 0.5
"""How often ``watch_parent`` looks at the parent."""

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies. With ``parent_pid``: if the parent
    is already another process (it died before the request), die now; else watch it too
    (``watch_parent``), since the kernel's request can be refused or miss."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent_pid is None:
        return
    if os.getppid() != parent_pid:
        os._exit(128 + signal.SIGKILL)
    watch_parent(parent_pid)


def keep_together() -> None:
    """What a clipcheck process does first (its own entry point; never a function called in someone
    else's process): die with the launcher that started it (``PARENT_PID_ENV`` names it; a rank
    under torchrun dies with torchrun's agent, its parent), make every child it forks die with it,
    and adopt its orphans, so that ``end_descendants`` at its end finds them all."""
    parent = os.environ.get(PARENT_PID_ENV, "")
    if parent.isdigit():
        die_with_parent(int(parent))
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent(os.getppid())
    children_die_with_this_process()
    adopt_orphans()


def watch_parent(parent_pid: int) -> None:
    """A daemon thread that, once this process's parent is no longer ``parent_pid`` (it died: the
    process was re-parented), SIGKILLs every descendant of this process and then the process itself."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        end_descendants()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="clipcheck-parent-watch", daemon=True).start()


_CHILDREN_DIE = False


def children_die_with_this_process() -> None:
    """Every child forked from this process from now on (``os.fork``, multiprocessing's fork) dies
    with it; a child started by ``subprocess`` is ended by ``end_descendants`` instead."""
    global _CHILDREN_DIE
    if not _CHILDREN_DIE:
        os.register_at_fork(after_in_child=die_with_parent)
        _CHILDREN_DIE = True


def adopt_orphans() -> None:
    """Become the parent of this process's orphaned descendants (a child subreaper), so that
    ``end_descendants`` still finds a grandchild whose own parent has died."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def has_children() -> bool:
    """Whether this process has any child, exited or not (one system call: the cheap test a case
    makes before the costlier ``descendants``)."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    except OSError:
        return True
    return True


def process_parents() -> dict[int, int]:
    """Every live process's parent pid, from /proc (zombies left out): one scan for any number of
    ancestry questions."""
    parents: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return parents
    for entry in entries:
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    return parents


def descendants(pid: int | None = None, parents: dict[int, int] | None = None) -> set[int]:
    """Every live process whose ancestry reaches ``pid`` (this process by default); ``parents`` is a
    ``process_parents`` scan to reuse."""
    root = os.getpid() if pid is None else pid
    parents = process_parents() if parents is None else parents
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def end_descendants(spare: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """SIGKILL every descendant of this process but ``spare``, and reap those that are its children;
    the pids ended."""
    ended = sorted(descendants() - set(spare))
    for pid in ended:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    _reap(ended)
    return ended


def _reap(pids: list[int], within_s: float = 1.0) -> None:
    """Collect the exit of those of ``pids`` that are this process's children (a zombie left here would
    keep ``has_children`` true, and every later case paying for a /proc scan); the others are their own
    parent's, or init's, to collect."""
    deadline = time.monotonic() + within_s
    waiting = list(pids)
    while waiting and time.monotonic() < deadline:
        for pid in list(waiting):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    continue
            except OSError:  # not our child, or already collected
                pass
            waiting.remove(pid)
        if waiting:
            time.sleep(0.01)
