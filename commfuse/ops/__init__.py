"""commfuse's own graph ops, each in one folder with everything about it.

* :mod:`.boundary` -- ``commfuse::m2ms`` and ``commfuse::stage_transfer``, the primitives a
  pipeline boundary needs (Chimera Table 1 "M2MS", "P2P"); docs/boundary-ops.md.
* :mod:`.moe_layer` -- ``commfuse::moe_layer``: a whole expert-parallel MoE layer as one op.
* :mod:`.reduce_to_root` -- ``commfuse::reduce_to_root``: the rooted reduce the lowering issues.

A folder holds the op and its fake kernel, the IR's view of it, its cost rule and its
reference semantics. The lower layers (IR, cost model, reference interpreter) know nothing
of these ops: :func:`install` plugs them in through those layers' registration points, once
(``import commfuse`` calls it).
"""

from __future__ import annotations

from commfuse.ops import boundary, moe_layer, reduce_to_root
from commfuse.ops.boundary import (
    M2MS,
    M2MS_AUTOGRAD,
    STAGE_TRANSFER,
    STAGE_TRANSFER_AUTOGRAD,
    M2MSArgs,
    StageTransferArgs,
    m2ms,
    parse_m2ms,
    parse_stage_transfer,
    stage_transfer,
    trace_as_rank,
    trace_position,
)

_installed = False


def install() -> None:
    """Register every op with the IR, the cost model and the reference interpreter (idempotent)."""
    global _installed
    if _installed:
        return
    boundary.install()
    moe_layer.install()
    reduce_to_root.install()
    _installed = True


__all__ = [
    "M2MS",
    "M2MSArgs",
    "M2MS_AUTOGRAD",
    "STAGE_TRANSFER",
    "STAGE_TRANSFER_AUTOGRAD",
    "StageTransferArgs",
    "install",
    "m2ms",
    "parse_m2ms",
    "parse_stage_transfer",
    "stage_transfer",
    "trace_as_rank",
    "trace_position",
]
