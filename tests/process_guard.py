"""A pytest plugin of this suite's: a test that failed (a timeout among them: pytest-timeout fails it from
SIGALRM) ends every process it started and left running, orphans included. Without it, a shell killed at
a test's timeout left its ``clipcheck run`` and ranks behind, re-parented to init, for as long as the
machine ran. Registered by tests/conftest.py; loadable on its own (``-p process_guard``) for the test
that checks it."""

from __future__ import annotations

import pytest

from harness.run.guards.family import adopt_orphans, descendants, end_descendants

# the processes a test starts stay this process's descendants when their own parent dies
adopt_orphans()

_CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed
    return report


@pytest.fixture(autouse=True)
def _failed_tests_leave_no_process(request):
    """What a failed test started is ended at its teardown; warm pools it started are restarted by their
    next task."""
    before = descendants()
    yield
    if request.node.stash.get(_CALL_FAILED, False):
        left = end_descendants(spare=before)
        if left:
            print(f"ended {len(left)} process(es) the failed test left running: {left}")
