"""Test harness for commfuse: gloo rank pools, fake process groups, numerics.

See docs/testing.md. Nothing here imports other commfuse modules, so the
harness works while the rest of the package is broken.
"""

from commfuse.reference.numerics import assert_bitwise_equal_tree, assert_close_tree, tolerances, train_step_outputs
from commfuse.testing.fake_pg import fake_mesh, fake_process_group
from commfuse.tools.rank_pool import (RankFailure, RankPool, RankPoolError, RankTimeout, RemoteError, get_pool,
                                      shutdown_all)

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
    "shutdown_all",
    "tolerances",
    "train_step_outputs",
]
