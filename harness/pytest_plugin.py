"""pytest plugin: run a test body on N ranks of a warm world.

    @pytest.mark.world_size(4)                  # optional: timeout=60, backend="gloo"
    def test_my_clip_counts_experts_once():
        ...  # runs on every rank with torch.distributed initialized (default group = the 4 ranks)

A world is started once per (world size, backend) and reused by every test that asks for it, so a
test costs milliseconds, not a torchrun start; under pytest-xdist each worker keeps its own worlds.
When some ranks fail, the test fails with each failing rank's traceback labelled by its rank; when a
rank hangs, it is killed at the timeout and the test fails with that rank's stack. Test arguments
(parametrize values, simple fixtures) are pickled to the ranks; the function must be a module-level
test function.

The ``rank_pool`` fixture gives direct access (``rank_pool(4).run(fn, ...)``) for tests that drive
the ranks themselves, such as property tests drawing examples in the parent.

Enabled by this repository's ``conftest.py``, and for other projects through the ``pytest11`` entry
point of the installed package.
"""

from __future__ import annotations

import inspect
import pickle
from typing import Any, Callable

import pytest

from .pool import RankPool

DEFAULT_TIMEOUT_S = 60.0


class PoolRegistry:
    """Warm worlds of this pytest process, by (world size, backend, collective timeout)."""

    def __init__(self) -> None:
        self._pools: dict[tuple[int, str | None, float], RankPool] = {}

    def get(self, world_size: int, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> RankPool:
        key = (world_size, backend, timeout_s)
        if key not in self._pools:
            self._pools[key] = RankPool(world_size, backend=backend, timeout_s=timeout_s)
        return self._pools[key]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


_REGISTRY_KEY = pytest.StashKey[PoolRegistry]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("clipcheck_timeout", "seconds a rank may take in a world_size test before it counts as hung",
                  default=str(DEFAULT_TIMEOUT_S))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "world_size(n, timeout=None, backend=None): run the test body on n ranks of a warm world "
        "(clipcheck); each failing rank is reported with its rank",
    )
    config.stash[_REGISTRY_KEY] = PoolRegistry()


def pytest_unconfigure(config: pytest.Config) -> None:
    registry = config.stash.get(_REGISTRY_KEY, None)
    if registry is not None:
        registry.close()


@pytest.fixture
def rank_pool(request: pytest.FixtureRequest) -> Callable[..., RankPool]:
    """``rank_pool(n, backend=None)``: the warm world of n ranks, to ``run`` functions on."""
    registry = request.config.stash[_REGISTRY_KEY]
    return lambda n, backend=None: registry.get(n, backend)


def _call_on_rank(fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    fn(**kwargs)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("world_size")
    if marker is None:
        return None
    if not marker.args or not isinstance(marker.args[0], int) or marker.args[0] < 1:
        raise pytest.UsageError(f"{pyfuncitem.nodeid}: use @pytest.mark.world_size(n) with a positive int n")
    world_size = marker.args[0]
    timeout = float(marker.kwargs.get("timeout") or pyfuncitem.config.getini("clipcheck_timeout"))
    backend = marker.kwargs.get("backend")
    fn = pyfuncitem.obj
    if "." in fn.__qualname__:
        raise pytest.UsageError(f"{pyfuncitem.nodeid}: world_size tests must be module-level functions")
    kwargs = {name: pyfuncitem.funcargs[name] for name in inspect.signature(fn).parameters}
    for name, value in kwargs.items():
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise pytest.UsageError(
                f"{pyfuncitem.nodeid}: argument {name!r} cannot be sent to the ranks ({exc})") from None

    pool = pyfuncitem.config.stash[_REGISTRY_KEY].get(world_size, backend, timeout)
    results = pool.run(_call_on_rank, fn, kwargs, timeout_s=timeout)
    failed = [r for r in results if r.status not in ("ok", "skip")]
    if failed:
        report = "\n\n".join(f"---- rank {r.rank} ({r.status}) ----\n{r.error}" for r in failed)
        pytest.fail(f"{len(failed)} of {world_size} ranks failed\n{report}", pytrace=False)
    skipped = [r for r in results if r.status == "skip"]
    if skipped:
        pytest.skip(skipped[0].error or "skipped on a rank")
    return True
