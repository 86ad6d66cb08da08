"""Centauri's operation-level rule (Algorithm 1): how many chunks, and in which granularity.

``operation_level_plan`` is the paper's logic on numbers; ``operation_costs`` measures those numbers
on a graph. The workload partition asks it for a chunk count when ``Config.workload_chunks``
is None (the default), and the partition search adds its count to the counts it scores.

Choices the paper leaves open, and what commfuse does
* MAX_CHUNKS = ``Config.max_chunks`` (default 8).
* ``comm_cost / in_cost`` is rounded UP: the first chunk's transfer (comm_cost / k) is the part
  nothing can hide except the independent compute, so k must reach comm_cost / in_cost; the
  result is clipped to [2, MAX_CHUNKS] (fewer than 2 chunks is no partition).
* ``in_cost`` (independent compute available to overlap) = the estimated time of the compute
  nodes that neither feed the collective nor use its result and that sit, in the graph's
  current order, between the collective's start and the first use of its result. That is
  what overlaps it when waits are sunk; compute a scheduler could still move there is not
  counted (the global scheduler runs after partitioning).
* ``comp_cost`` = the estimated time of the compute chain the workload partition cuts along
  with the collective; ``comm_cost`` = the collective's estimated time (topology cost model).
* Group-partitioned collectives: ``cost_inter`` / ``cost_intra`` are the estimated times of
  the inter- and intra-node steps of the hierarchical sequence; ``inter_size`` and
  ``intra_size`` the sub-group sizes. The granularity is returned as fractions of the
  workload; the workload partition cuts even chunks only, so an uneven granularity is
  reported in the decision but applied as that many even chunks (not implemented: uneven
  chunk sizes).

Source: "Centauri: Enabling Efficient Scheduling for Communication-Computation Overlap in Large Model
Training via Communication Partitioning" (Chen et al., ASPLOS '24), §3.2, Algorithm 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch.fx as fx

from commfuse.ir.collective import Collective
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.ir.kinds import is_wait


@dataclass(frozen=True)
class GroupCosts:
    """The hierarchical sequence of a group-partitioned collective."""

    cost_inter: float
    cost_intra: float
    inter_size: int
    intra_size: int

    @property
    def world_size(self) -> int:
        return self.inter_size * self.intra_size


@dataclass(frozen=True)
class OperationPlan:
    num_chunks: int
    granularity: tuple[float, ...]
    first: Optional[str]  # group-partitioned: "inter" or "intra" launched first; else None
    why: str


def operation_level_plan(comp_cost: float, comm_cost: float, in_cost: float, max_chunks: int,
               group: Optional[GroupCosts] = None) -> OperationPlan:
    """Algorithm 1 of Centauri with the rounding above (costs in any one unit)."""
    if in_cost >= comm_cost:
        return OperationPlan(1, (1.0,), None, f"hidden by independent compute ({in_cost:.1f} >= {comm_cost:.1f})")
    num = max_chunks
    if in_cost > 0:
        num = min(math.ceil(comm_cost / in_cost), max_chunks)
    num = max(2, num) if max_chunks >= 2 else 1
    granularity: tuple[float, ...] = tuple([1.0 / num] * num)
    first, why = None, f"{num} chunks: comm {comm_cost:.1f} over independent compute {in_cost:.1f}"
    if group is not None:
        w, inter, intra = group.world_size, group.inter_size, group.intra_size
        if in_cost > group.cost_inter:
            first, granularity = "inter", (inter / w, 1 - inter / w)
        elif comp_cost / inter > intra * group.cost_inter:
            first, granularity = "intra", (intra / w, 1 - intra / w)
        else:
            first = "intra"
            granularity = (intra / w, (inter - 1) / w, 1 - (inter + intra - 1) / w)
        why += f"; group-partitioned, {first}-node step first"
    return OperationPlan(len(granularity) if group is not None else num, granularity, first, why)


def independent_compute_us(gm: fx.GraphModule, ir: CollectiveIR, c: Collective, estimator) -> float:
    """``in_cost``: compute independent of ``c`` between its start and its result's first use."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    users = [u for w in c.waits for u in w.users]
    end = min((pos[u] for u in users), default=len(nodes))
    ancestors = _closure(c.start, lambda n: n.all_input_nodes)
    descendants = _closure(c.start, lambda n: n.users)
    starts = {x.start for x in ir.collectives}
    total = 0.0
    for n in nodes[pos[c.start] + 1:end]:
        if n.op != "call_function" or is_wait(n.target) or n in starts or n in ancestors or n in descendants:
            continue
        total += estimator.compute_time_us(n)
    return total


def _closure(root: fx.Node, step) -> set[fx.Node]:
    seen, todo = set(), [root]
    while todo:
        n = todo.pop()
        for m in step(n):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen
