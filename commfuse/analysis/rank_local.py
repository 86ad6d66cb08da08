"""Whether the ranks of a program may hold different graphs or sizes.

Passes that decide from costs (bucketing, partition search) decide on each rank from that
rank's graph. That is the same decision everywhere only when every rank holds the same
graph with the same sizes. Not so where ranks trace different graphs (pipeline stages,
point-to-point peers, per-rank pieces of a many-to-many scatter), where an all_to_all's
split sizes are given per rank (shapes downstream differ), or where shapes are symbolic
(their size hints are rank-local). Such passes leave these graphs unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from commfuse.ir.kinds import CollectiveKind as K

_PER_RANK_GRAPH = (K.SEND, K.RECV, K.BATCH_P2P, K.P2P, K.M2MS)


def rank_local_reason(collectives, gm: fx.GraphModule) -> Optional[str]:
    """Why ranks may hold different graphs or sizes; None when the graph is the same on every rank."""
    collectives = list(collectives)
    for c in collectives:
        if c.kind in _PER_RANK_GRAPH:
            return (f"graph has point-to-point or pipeline boundary ops ({c.name}, {c.kind.value}): ranks may "
                    "run different graphs")
    for c in collectives:
        if c.kind is K.ALL_TO_ALL and (c.extra.get("rank_local_sizes") or not c.extra.get("equal_splits", True)):
            return (f"graph has an all_to_all with split sizes given per rank ({c.name}): shapes downstream "
                    "may differ between ranks")
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and any(not isinstance(s, int) for s in v.shape):
            return f"graph has symbolic shapes ({n.name}): their size hints are rank-local"
    return None
