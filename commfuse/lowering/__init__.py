"""Lowering: how a rewritten graph is executed.

Today two executors exist, chosen by `Config.inner_compiler`:
* "inductor": Inductor generates code; functional collectives stay functional
  and Inductor emits them as c10d calls (see `commfuse.backend`).
* "eager": the rewritten graph runs op by op (`lower_eager`); functional
  collectives issue asynchronous c10d work and `wait_tensor` blocks on it, so
  the graph order chosen by scheduling passes is the order work is issued.

The seam for a stream-aware runtime (later issue) is `lower_eager`'s signature:
a lowering takes the final scheduled GraphModule and returns a boxed callable.
"""

from __future__ import annotations

from typing import Callable

import torch.fx as fx

from .._torch_private import make_boxed_func
from . import rooted  # noqa: F401  (registers commfuse::reduce_to_root and its IR kind)


def lower_eager(gm: fx.GraphModule) -> Callable:
    """Run the graph as is, in graph order (boxed calling convention for AOTAutograd)."""
    return make_boxed_func(gm.forward)


__all__ = ["lower_eager"]
