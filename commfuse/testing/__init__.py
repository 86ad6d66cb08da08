"""Test harness for commfuse: gloo rank pools, fake process groups, numerics.

See docs/testing.md. The rank pool (:mod:`commfuse.tools.rank_pool`) and the tolerance policy
(:mod:`commfuse.reference.numerics`) live in the library and are re-exported here; nothing in
the library imports this package.
"""

from commfuse.reference.numerics import (
    assert_bitwise_equal_tree,
    assert_close_tree,
    tolerances,
    train_step_outputs,
)
from commfuse.testing.fake_pg import fake_mesh, fake_process_group
from commfuse.tools.rank_pool import (
    RankFailure,
    RankPool,
    RankPoolError,
    RankTimeout,
    RemoteError,
    get_pool,
    set_worker_initializer,
    shutdown_all,
)

__all__ = [
    "RankFailure",
    "RankPool",
    "RankPoolError",
    "RankTimeout",
    "RemoteError",
    "assert_bitwise_equal_tree",
    "assert_close_tree",
    "fake_mesh",
    "fake_process_group",
    "get_pool",
    "set_worker_initializer",
    "shutdown_all",
    "tolerances",
    "train_step_outputs",
]
