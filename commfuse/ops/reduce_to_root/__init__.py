"""``commfuse::reduce_to_root``: an asynchronous rooted reduce the lowering issues (:mod:`.op`)."""

from __future__ import annotations

from commfuse.ops.reduce_to_root import op
from commfuse.ops.reduce_to_root.op import REDUCE_TO_ROOT, reduce_to_root


def install() -> None:
    op.register()


__all__ = ["REDUCE_TO_ROOT", "install", "reduce_to_root"]
