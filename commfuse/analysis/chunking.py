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
  workload (denominator: the group size). The partition search asks for it on the leaves
  that group-partition a collective and cuts the chunks in these proportions:
  ``rounded_units`` turns the fractions into integer units (exact first, then coarser
  roundings), and the workload partition cuts every chain value into ``sum(units)`` equal
  units, chunk i taking ``units[i]`` of them, falling back to even chunks (and saying why)
  when no rounding divides the chain's shapes.

Source: "Centauri: Enabling Efficient Scheduling for Communication-Computation Overlap in Large Model
Training via Communication Partitioning" (Chen et al., ASPLOS '24), §3.2, Algorithm 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
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


def operation_level_plan(
    comp_cost: float, comm_cost: float, in_cost: float, max_chunks: int, group: Optional[GroupCosts] = None
) -> OperationPlan:
    """Algorithm 1 of Centauri with the rounding above (costs in any one unit)."""
    if in_cost >= comm_cost:
        return OperationPlan(
            1, (1.0,), None, f"hidden by independent compute ({in_cost:.1f} >= {comm_cost:.1f})"
        )
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
        why = (
            f"{len(granularity)} chunks: group-partitioned, {first}-node step first (comm {comm_cost:.1f}, "
            f"inter-node {group.cost_inter:.1f}, independent compute {in_cost:.1f}, chain {comp_cost:.1f})"
        )
    return OperationPlan(len(granularity) if group is not None else num, granularity, first, why)


def rounded_units(granularity, max_units: int = 64) -> list[tuple[int, ...]]:
    """Integer chunk sizes in the proportions ``granularity``: the exact ones first (smallest
    common denominator, at most ``max_units``), then roundings to fewer units (largest
    remainder, every chunk at least one unit), finest first. Only uneven tuples: a rounding
    that makes every chunk equal is left out (that is the even cut)."""
    weights = [float(g) for g in granularity]
    k, total = len(weights), sum(weights)
    if k < 2 or total <= 0 or any(w <= 0 for w in weights):
        return []
    fracs = [Fraction(w / total).limit_denominator(max_units) for w in weights]
    den = math.lcm(*(f.denominator for f in fracs))
    out: list[tuple[int, ...]] = []
    if den <= max_units and sum(fracs) == 1:
        exact = [int(f * den) for f in fracs]
        g = math.gcd(*exact)
        if len(set(exact)) > 1:
            out.append(tuple(u // g for u in exact))
        top = sum(exact) // g
    else:
        top = max_units
    for units in range(top, k, -1):
        shares = [w / total * units for w in weights]
        cut = [max(1, math.floor(s)) for s in shares]
        # largest remainders get the units left over (ties: the earlier chunk)
        order = sorted(range(k), key=lambda i: (-(shares[i] - math.floor(shares[i])), i))
        j = 0
        while sum(cut) < units:
            cut[order[j % k]] += 1
            j += 1
        if sum(cut) != units:
            continue
        t = tuple(cut)
        g = math.gcd(*t)
        t = tuple(u // g for u in t)
        if len(set(t)) > 1 and t not in out:
            out.append(t)
    return out


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
    for n in nodes[pos[c.start] + 1 : end]:
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
