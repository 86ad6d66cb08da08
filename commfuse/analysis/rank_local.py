"""Whether the ranks of a program may hold different graphs, or collectives of different sizes.

Passes that decide from costs (bucketing, partition search) decide on each rank from that
rank's graph. Where ranks trace different graphs (pipeline stages, point-to-point peers,
per-rank pieces of a many-to-many scatter -- unless every rank sends every rank equal pieces),
or where an all_to_all's split sizes are given per rank (the collective sizes downstream
differ), no pricing can make that the same decision everywhere: such passes leave these graphs
unchanged.

Compute shapes that differ between ranks of one program (a data-parallel rank's local batch,
static on one rank and symbolic on another) are not a reason: the cost policy prices only the
sizes every rank shares, with rank-invariant hints for symbols (``passmgr/invariance.py``).
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from commfuse.ir.kinds import CollectiveKind as K
from commfuse.ops.boundary import parse_m2ms

_PER_RANK_GRAPH = (K.SEND, K.RECV, K.BATCH_P2P, K.P2P, K.M2MS)


def _same_on_every_rank(c) -> bool:
    """A many-to-many scatter in which every rank of its group sends every rank the same number
    of units (fuse_collectives' form across mesh dims): one graph serves every rank."""
    if c.kind is not K.M2MS:
        return False
    try:
        m = parse_m2ms(c.start)
    except (ValueError, TypeError, IndexError, KeyError):
        return False
    everyone = list(range(m.group_size))
    flat = [s for row in m.splits for s in row]
    return sorted(m.src) == everyone and sorted(m.dst) == everyone and len(set(flat)) == 1


def rank_local_reason(collectives, gm: fx.GraphModule) -> Optional[str]:
    """Why ranks may hold different graphs or collective sizes; None when every rank holds this
    graph up to the compute shapes that follow from its own inputs (``gm``: the collectives' graph)."""
    collectives = list(collectives)
    for c in collectives:
        if c.kind in _PER_RANK_GRAPH and not _same_on_every_rank(c):
            return (
                f"graph has point-to-point or pipeline boundary ops ({c.name}, {c.kind.value}): ranks may "
                "run different graphs"
            )
    for c in collectives:
        if c.kind is K.ALL_TO_ALL and (
            c.extra.get("rank_local_sizes") or not c.extra.get("equal_splits", True)
        ):
            return (
                f"graph has an all_to_all with split sizes given per rank ({c.name}): shapes downstream "
                "may differ between ranks"
            )
    return None
