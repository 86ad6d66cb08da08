"""Shared pytest fixtures for commfuse tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Make `import commfuse` work without installing the package. Rank-pool
# workers copy the parent's sys.path, so they see it too.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from commfuse.testing import RankPool, get_pool  # noqa: E402


@pytest.fixture(scope="session")
def rank_pool_2() -> RankPool:
    """A session-wide pool of 2 gloo ranks (see commfuse.testing.rank_pool)."""
    return get_pool(2)


@pytest.fixture(scope="session")
def rank_pool_4() -> RankPool:
    """A session-wide pool of 4 gloo ranks (see commfuse.testing.rank_pool)."""
    return get_pool(4)
