"""pytest plugin: run a test body on N ranks of a warm world.

    @pytest.mark.world_size(4)                  # optional: timeout=60, backend="gloo"
    def test_my_clip_counts_experts_once():
        ...  # runs on every rank with torch.distributed initialized (default group = the 4 ranks)

    @pytest.mark.world_size([1, 2, 4])          # once per size: test_x[world1], [world2], [world4]
    def test_x(): ...

A world that cannot run here is a skip with the reason, never a failure: ``backend="nccl"`` (or the
default backend on a GPU machine) with no CUDA, or a world larger than the visible GPU count. Under
pytest-xdist each worker gets its own share of the GPUs (``CUDA_VISIBLE_DEVICES``). The timeout comes
from the marker, else ``--clipcheck-timeout``, else the ``clipcheck_timeout`` ini value (60 s).
``clipcheck_fuzz_database`` (ini, a folder; off by default) gives the ``fuzz_database`` fixture a
hypothesis example database, so ``fuzz(..., database=fuzz_database)`` replays earlier failures first.
torch is imported only when a test uses a world.

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

import glob
import inspect
import os
import pickle
from typing import TYPE_CHECKING, Any, Callable

import pytest

from harness.run.world.devices import cuda_device_count, worker_visible_devices, world_skip_reason, xdist_worker

if TYPE_CHECKING:
    from harness.run.hosts.pool import RankPool

DEFAULT_TIMEOUT_S = 60.0
_WORLD_PARAM = "_clipcheck_world_size"


class PoolRegistry:
    """Warm worlds of this pytest process, by (world size, backend, collective timeout)."""

    def __init__(self) -> None:
        self._pools: dict[tuple[int, str | None, float], RankPool] = {}

    def get(self, world_size: int, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> "RankPool":
        from harness.run.hosts.pool import RankPool  # torch is imported by the first test that needs a world

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
    parser.addini("clipcheck_fuzz_database", "folder of the hypothesis example database the fuzz_database "
                  "fixture gives (empty: none, nothing is kept between runs)", default="")
    parser.getgroup("clipcheck").addoption(
        "--clipcheck-timeout", type=float, default=None, metavar="SECONDS",
        help="seconds a rank may take in a world_size test (overrides the clipcheck_timeout ini value)")


def configured_timeout(config: pytest.Config) -> float:
    """--clipcheck-timeout, else the ini value; one that cannot be a timeout (inf, 1e12) is a usage error."""
    value = config.getoption("--clipcheck-timeout", default=None)
    return checked_timeout(value if value is not None else config.getini("clipcheck_timeout"), "clipcheck timeout")


def checked_timeout(value: Any, what: str) -> float:
    from harness.plan.project import timeout_problem

    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise pytest.UsageError(f"{what} must be a number of seconds, got {value!r}") from None
    problem = timeout_problem(seconds, what)
    if problem:
        raise pytest.UsageError(problem)
    return seconds


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "world_size(n or [n, ...], timeout=None, backend=None): run the test body on n ranks of a warm world "
        "(clipcheck); each failing rank is reported with its rank",
    )
    config.stash[_REGISTRY_KEY] = PoolRegistry()
    worker = xdist_worker()
    if worker is not None and os.environ.get("CLIPCHECK_GPUS_SPLIT") != "1" and glob.glob("/dev/nvidia[0-9]*"):
        devices = worker_visible_devices(*worker, cuda_device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        if devices is not None:  # the ranks are started later, from this environment
            os.environ["CUDA_VISIBLE_DEVICES"] = devices
            os.environ["CLIPCHECK_GPUS_SPLIT"] = "1"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``world_size([1, 2, 4])``: the test once per size, each an item of its own."""
    marker = metafunc.definition.get_closest_marker("world_size")
    if marker is None or not marker.args or not isinstance(marker.args[0], (list, tuple)):
        return
    sizes = list(marker.args[0])
    if not sizes or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes):
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: world_size([...]) needs positive ints, got {sizes}")
    metafunc.fixturenames.append(_WORLD_PARAM)
    metafunc.parametrize(_WORLD_PARAM, sizes, ids=[f"world{n}" for n in sizes])


@pytest.fixture
def _clipcheck_world_size(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture
def fuzz_database(request: pytest.FixtureRequest) -> Any:
    """The hypothesis example database named by ``clipcheck_fuzz_database``, or None (the default)."""
    folder = request.config.getini("clipcheck_fuzz_database")
    if not folder:
        return None
    from hypothesis.database import DirectoryBasedExampleDatabase

    return DirectoryBasedExampleDatabase(os.path.join(str(request.config.rootpath), folder))


def pytest_unconfigure(config: pytest.Config) -> None:
    registry = config.stash.get(_REGISTRY_KEY, None)
    if registry is not None:
        registry.close()


@pytest.fixture
def rank_pool(request: pytest.FixtureRequest) -> Callable[..., RankPool]:
    """``rank_pool(n, backend=None)``: the warm world of n ranks, to ``run`` functions on, with the
    configured timeout; a world that cannot run here skips the test."""
    registry = request.config.stash[_REGISTRY_KEY]
    timeout = configured_timeout(request.config)

    def get(n: int, backend: str | None = None) -> "RankPool":
        reason = _world_skip(n, backend)
        if reason:
            pytest.skip(reason)
        return registry.get(n, backend, timeout)

    return get


def _world_skip(world_size: int, backend: str | None) -> str | None:
    """The skip reason for a world on this machine; the default backend is nccl where CUDA is."""
    if backend not in (None, "nccl"):
        return None
    devices = cuda_device_count()  # a test that uses a world imports torch anyway
    chosen = backend or ("nccl" if devices else "gloo")
    return world_skip_reason(world_size, chosen, devices)


def _call_on_rank(fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    fn(**kwargs)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("world_size")
    if marker is None:
        return None
    callspec = getattr(pyfuncitem, "callspec", None)
    if callspec is not None and _WORLD_PARAM in callspec.params:
        world_size = callspec.params[_WORLD_PARAM]
    elif marker.args and isinstance(marker.args[0], int) and not isinstance(marker.args[0], bool) \
            and marker.args[0] >= 1:
        world_size = marker.args[0]
    else:
        raise pytest.UsageError(f"{pyfuncitem.nodeid}: use @pytest.mark.world_size(n) with a positive int n "
                                "(or a list of them)")
    timeout = (checked_timeout(marker.kwargs["timeout"], f"{pyfuncitem.nodeid}: world_size(timeout=...)")
               if marker.kwargs.get("timeout") else configured_timeout(pyfuncitem.config))
    backend = marker.kwargs.get("backend")
    reason = _world_skip(world_size, backend)
    if reason:
        pytest.skip(reason)
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
