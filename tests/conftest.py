"""Shared pytest fixtures and rules for commfuse tests.

Rules enforced at collection: a test marked ``slow`` says why (``@pytest.mark.slow(reason=...)``);
the inner tier (``-m "not slow"``) must stay within docs/contributing.md's budget. Rule enforced
around every test: it leaves the process-global state as it found it (``no_leaked_global_state``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# One Inductor cache directory for the whole run, shared by this process, the rank pools'
# workers and the benchmark subprocesses (they inherit the environment): a graph compiled
# twice in a run compiles once, and no run depends on what an earlier run left in /tmp.
_OWN_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR" not in os.environ
if _OWN_INDUCTOR_CACHE:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="commfuse-tests-inductor-")

# Make `import commfuse` work without installing the package. Rank-pool
# workers copy the parent's sys.path, so they see it too.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import _global_state  # noqa: E402
from _jobs_suite import agreement_net_off_unless_asked  # noqa: E402
from commfuse.testing import RankPool, get_pool, set_worker_initializer  # noqa: E402
from commfuse.fuzz.forced import register_forced_passes  # noqa: E402

# The tests run the forced pass variants by name, as the fuzzer does; registered before any test,
# so every test of the session sees the same pass table whichever files it collected.
register_forced_passes()

# tests/test_global_state.py runs this conftest in a pytest session of its own
pytest_plugins = ["pytester"]


def _fail_on_leaks(before: _global_state.Snapshot, who: str) -> None:
    changes = _global_state.diff(before, _global_state.snapshot())
    if changes:
        _global_state.restore(changes)
        pytest.fail(
            f"{who} left process-global state changed (put back now; change it through monkeypatch or "
            "a context manager that restores it):\n" + _global_state.describe(changes),
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def no_leaked_global_state():
    """Fail a test that leaves process-global state changed (environment, torch's logging and
    configs, commfuse's process default, ...: ``tests/_global_state.py``), then put the state back
    so the tests after it in this process run as if it had not. A later test that depends on the
    default state would otherwise fail or pass by the order xdist deals the tests, far from the
    cause. A test changes such state through ``monkeypatch`` or a context manager that restores it.

    Autouse fixtures of this file are set up before a test's own fixtures and torn down after
    them, so what ``monkeypatch``, ``caplog`` and the test's fixtures undo is undone by the time
    the second snapshot is taken."""
    before = _global_state.snapshot()
    yield
    _fail_on_leaks(before, "the test")


@pytest.fixture(scope="module", autouse=True)
def no_leaked_global_state_by_module_fixtures():
    """The same around a module's tests, for what its module-scoped fixtures change and do not put
    back (reported at the teardown of the module's last test in this process)."""
    before = _global_state.snapshot()
    yield
    _fail_on_leaks(before, "the module's fixtures")


# pytest (9.1 on) attaches its log-capture handlers to every non-propagating logger, torch's
# structured-trace log (`torch.__trace`) among them, for each phase of a test. Any handler there
# but torch's own without a directory turns the trace on: torch and commfuse would render every
# graph and decision of every compile into pytest's capture, and a test of the trace being off
# would find it on. Taken off innermost (trylast) of the phase's wrappers, so after pytest
# attached them, and put back on the way out, so pytest detaches what it attached.
@contextlib.contextmanager
def _no_pytest_handlers_on_the_trace_log():
    from torch._logging._internal import trace_log

    theirs = [h for h in trace_log.handlers if _global_state.pytest_handler(h)]
    for h in theirs:
        trace_log.removeHandler(h)
    try:
        yield
    finally:
        for h in theirs:
            trace_log.addHandler(h)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_setup(item):
    with _no_pytest_handlers_on_the_trace_log():
        return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item):
    with _no_pytest_handlers_on_the_trace_log():
        return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item):
    with _no_pytest_handlers_on_the_trace_log():
        return (yield)


# The suite's rank processes compile with the agreement net off unless a test's Config says
# check_agreement (tests/_jobs_suite.py says why); installed before any pool is spawned.
set_worker_initializer(agreement_net_off_unless_asked)
# A job given no timeout of its own may take this long before the pool calls it a hang: CI runs two
# workers, each driving its own pools, on two cores, so a 4-rank compile that takes 117 s alone
# (tests/test_partition_search.py::test_search_matches_eager_on_4_gloo_ranks) passes the pool's
# default 120 s there. Tests of the timeout itself pass theirs (tests/test_harness.py).
SUITE_JOB_TIMEOUT_S = 300.0


def _suite_pool(world_size: int) -> RankPool:
    pool = get_pool(world_size)
    pool.timeout_s = max(pool.timeout_s, SUITE_JOB_TIMEOUT_S)
    return pool


@pytest.fixture(scope="session")
def rank_pool_2() -> RankPool:
    """A session-wide pool of 2 gloo ranks (see commfuse.tools.rank_pool)."""
    return _suite_pool(2)


@pytest.fixture(scope="session")
def rank_pool_4() -> RankPool:
    """A session-wide pool of 4 gloo ranks (see commfuse.tools.rank_pool)."""
    return _suite_pool(4)


def pytest_collection_modifyitems(config, items):
    unreasoned = [
        item.nodeid
        for item in items
        if (m := item.get_closest_marker("slow")) is not None and not m.kwargs.get("reason")
    ]
    if unreasoned:
        raise pytest.UsageError(
            'tests marked slow without a reason (write @pytest.mark.slow(reason="...")): '
            + ", ".join(unreasoned)
        )
    # Under pytest-xdist (`-n 2 --dist loadgroup`, the README's command) every test on real ranks
    # runs in one worker: one pool of each size for the run, and the other worker takes the
    # single-process tests meanwhile.
    for item in items:
        if item.get_closest_marker("multirank") or any(f.startswith("rank_pool") for f in item.fixturenames):
            item.add_marker(pytest.mark.xdist_group("ranks"))


def pytest_unconfigure(config):
    if _OWN_INDUCTOR_CACHE:
        shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
