"""Shared pytest fixtures and rules for commfuse tests.

Rules enforced at collection: a test marked ``slow`` says why (``@pytest.mark.slow(reason=...)``);
the inner tier (``-m "not slow"``) must stay within docs/contributing.md's budget.
"""

from __future__ import annotations

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

from commfuse.testing import RankPool, get_pool  # noqa: E402
from commfuse.fuzz.forced import register_forced_passes  # noqa: E402

# The tests run the forced pass variants by name, as the fuzzer does; registered before any test,
# so every test of the session sees the same pass table whichever files it collected.
register_forced_passes()


@pytest.fixture(scope="session")
def rank_pool_2() -> RankPool:
    """A session-wide pool of 2 gloo ranks (see commfuse.tools.rank_pool)."""
    return get_pool(2)


@pytest.fixture(scope="session")
def rank_pool_4() -> RankPool:
    """A session-wide pool of 4 gloo ranks (see commfuse.tools.rank_pool)."""
    return get_pool(4)


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
