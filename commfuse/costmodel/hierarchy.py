"""How a group spans the nodes of a topology: its node-major layout, its intra- and inter-node
blocks, and the names every rank gives their sub-groups.

Pure functions of the ranks and the topology (the same on every rank): ``commfuse.setup``
creates the sub-groups from them, the group partition pass decides with them, Lagom names
its communicator pool with :func:`ranks_label`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

from commfuse.costmodel.topology import Topology

INTRA_PREFIX = "commfuse.intra."
INTER_PREFIX = "commfuse.inter."

Ranks = tuple[int, ...]


@dataclass(frozen=True)
class SubGroups:
    """This rank's two sub-groups of one parent group (Centauri's G'_k on the mesh [a, b])."""

    parent: Ranks  # the parent's global ranks, in group-rank order (ascending)
    nodes: int  # a: nodes the parent spans
    local: int  # b: parent ranks on each of those nodes
    intra: Ranks  # this rank's intra-node sub-group {i*b + l'}
    inter: Ranks  # this rank's inter-node sub-group {i'*b + l}
    intra_name: str  # the alias graphs use for `intra` (registered in this process)
    inter_name: str
    intra_pg: Any = field(default=None, compare=False, repr=False)
    inter_pg: Any = field(default=None, compare=False, repr=False)


def hierarchy_layout(ranks: Sequence[int], topology: Topology) -> Union[tuple[int, int], str]:
    """``(a, b)`` if ``ranks`` (a group, in group-rank order) is the node-major mesh
    [a nodes, b ranks each] with a, b >= 2 on ``topology``; else the reason it is not."""
    ranks = tuple(ranks)
    if len(ranks) < 2:
        return "group of one rank"
    if any(r < 0 or r >= topology.world_size for r in ranks):
        return f"ranks {list(ranks)} are not all inside the topology's {topology.world_size} ranks"
    if list(ranks) != sorted(set(ranks)):
        # new_group orders a sub-group's ranks ascending; the index formula needs the
        # parent's group-rank order to agree with it.
        return f"group rank order {list(ranks)} is not ascending (node-major)"
    counts: list[int] = []
    last = None
    for r in ranks:  # ascending ranks: each node's ranks form one run
        node = topology.node_of(r)
        if node != last:
            counts.append(0)
            last = node
        counts[-1] += 1
    if len(counts) == 1:
        return f"group inside one node (node {topology.node_of(ranks[0])})"
    if len(set(counts)) != 1:
        return f"uneven ranks per node ({counts})"
    if counts[0] == 1:
        return "one rank per node: no intra-node level to split off"
    return len(counts), counts[0]


def mesh_blocks(parent: Ranks, a: int, b: int) -> tuple[list[Ranks], list[Ranks]]:
    """The parent's intra-node blocks (a of b ranks) and inter-node blocks (b of a ranks):
    Centauri's ``index(j) = (j // b % a, j % b)`` on group rank j."""
    intra = [parent[i * b : (i + 1) * b] for i in range(a)]
    inter = [tuple(parent[i * b + j] for i in range(a)) for j in range(b)]
    return intra, inter


def ranks_label(ranks: Sequence[int]) -> str:
    """A short name for a rank tuple, the same on every rank: ``0:8`` (a range), ``1:8:2``
    (a strided range), ``0-3-5`` (short lists), or a hash (long irregular lists)."""
    ranks = tuple(ranks)
    if len(ranks) >= 2:
        step = ranks[1] - ranks[0]
        if step > 0 and all(y - x == step for x, y in zip(ranks, ranks[1:], strict=False)):
            stop = ranks[-1] + 1
            return f"{ranks[0]}:{stop}" if step == 1 else f"{ranks[0]}:{stop}:{step}"
    if len(ranks) <= 16:
        return "-".join(map(str, ranks))
    return "h" + hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]


def subgroup_names(parent: Sequence[int]) -> tuple[str, str]:
    """The (intra, inter) aliases graphs use for the sub-groups of ``parent``."""
    label = ranks_label(parent)
    return INTRA_PREFIX + label, INTER_PREFIX + label


__all__ = [
    "INTER_PREFIX",
    "INTRA_PREFIX",
    "Ranks",
    "SubGroups",
    "hierarchy_layout",
    "mesh_blocks",
    "ranks_label",
    "subgroup_names",
]
