"""Model-level scheduling (Centauri §3.2.3, Eq. 2): how many micro-batches run a layer together.

Contract
- Matches: graphs of ``commfuse.compile_train_step`` with at least two micro-batches (nodes
  tagged by ``train_step.microbatch_of``), forward or backward, whose nodes carry module paths
  (``layer_level.layer_name``).
- Decides L (L1 in a forward graph, L2 in a backward graph) by exact enumeration of Eq. 2:

      min  max(C_AG - L1 * C_fw, 0) + max(C_RS - L2 * C_bw, 0)
      s.t. L1 * m <= M,  L2 * m <= M,  (L1 + L2 <= mb only when forward and backward
           micro-batches are in flight together, i.e. under pipeline parallelism)

  with, per layer, C_AG the forward's weight all_gathers, C_RS the backward's gradient
  reductions of L2 micro-batches (each micro-batch reduces its own gradients in this graph, as
  the plain accumulation loop does, so C_RS grows with L2), C_fw / C_bw one micro-batch's
  compute, all from the graph's cost estimates; m the bytes one micro-batch's forward keeps
  for backward (the forward graph's outputs it produces), M ``Config.model_level_memory_bytes``
  (None: no limit). Ties: the smaller L (less memory).
- Produces a preferred order: micro-batches in groups of L (in the order the graph runs them),
  inside a group layer by layer, each layer for every micro-batch of the group. L = 1 is the
  input's depth-first order; L = mb is breadth-first. ``schedule_overlap`` schedules it like
  any candidate and keeps it only when the simulator prefers it; it also records, for every L,
  the simulated makespan (the brute force Eq. 2 is checked against).
- Guarantees: the preferred order is a topological order of the problem (shared nodes, e.g.
  the forward's deduplicated weight gathers, go with their first reader), decided from the
  graph and config only.

Source: Centauri §3.2.3 (Eq. 2, Fig. 7). Choices the paper leaves open: docs/scheduler.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from commfuse.core.meta import microbatch_of
from commfuse.costmodel.simulator import NODE_COMPUTE
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.ir.kinds import CollectiveKind
from commfuse.schedule.layer_level import layer_name
from commfuse.schedule.list_scheduler import ScheduleProblem, keyed_topological_order


@dataclass(frozen=True)
class GroupingCosts:
    """Per-layer costs (us) and memory (bytes) of Eq. 2."""

    c_ag: float
    c_rs: float  # gradient reductions of ONE micro-batch (the group's cost is L2 times this)
    c_fw: float
    c_bw: float
    m: float
    memory: Optional[float]  # M; None = unlimited
    microbatches: int
    concurrent: bool = False  # forward and backward micro-batches in flight together (PP)


@dataclass(frozen=True)
class Grouping:
    l1: int
    l2: int
    t: float


def exposed_comm_us(x: GroupingCosts, l1: int, l2: int) -> float:
    return max(x.c_ag - l1 * x.c_fw, 0.0) + max(l2 * x.c_rs - l2 * x.c_bw, 0.0)


def grouping_fits(x: GroupingCosts, l1: int, l2: int) -> bool:
    if x.memory is not None and (l1 * x.m > x.memory or l2 * x.m > x.memory):
        return False
    return not x.concurrent or l1 + l2 <= x.microbatches


def best_grouping(x: GroupingCosts) -> Grouping:
    """Exact enumeration (two small integers); smallest (L1, L2) among equal objectives. When no
    pair fits the memory, depth-first (1, 1)."""
    best: Optional[Grouping] = None
    for l1 in range(1, x.microbatches + 1):
        for l2 in range(1, x.microbatches + 1):
            if not grouping_fits(x, l1, l2):
                continue
            t = exposed_comm_us(x, l1, l2)
            if best is None or t < best.t - 1e-9:
                best = Grouping(l1, l2, t)
    return best if best is not None else Grouping(1, 1, exposed_comm_us(x, 1, 1))


@dataclass
class MicrobatchGraph:
    """Micro-batch and layer of every node of a train-step graph (indices of a ScheduleProblem)."""

    mb_order: list[int]  # micro-batches in the order the graph first runs them
    layers: list[str]  # layers in the order the graph first runs them
    mb: dict[int, int]
    layer: dict[int, str]


def microbatch_graph(p: ScheduleProblem) -> Optional[MicrobatchGraph]:
    mb: dict[int, int] = {}
    layer: dict[int, str] = {}
    layers: list[str] = []
    where: dict[int, list[int]] = {}
    for i, n in enumerate(p.nodes):
        if n.op != "call_function":
            continue
        k, name = microbatch_of(n), layer_name(n)
        if k is not None:
            mb[i] = k
            where.setdefault(k, []).append(i)
        if name is not None:
            layer[i] = name
            if name not in layers:
                layers.append(name)
    if len(where) < 2 or not layers:
        return None
    # A micro-batch's nodes outside any layer (loss, its gradient, head) run with the layer
    # next to them: the first reader's, else the first input's.
    for i in range(p.size - 1, -1, -1):
        if i in mb and i not in layer:
            name = next((layer[u] for u in p.succs[i] if u in layer), None)
            if name is not None:
                layer[i] = name
    for i in range(p.size):
        if i in mb and i not in layer:
            name = next((layer[q] for q in p.preds[i] if q in layer), None)
            if name is not None:
                layer[i] = name
    # The order the graph runs them: by median position (a backward graph runs the last
    # micro-batch first, though each one's recomputation or shared reads may come early).
    mb_order = sorted(where, key=lambda k: (sorted(where[k])[len(where[k]) // 2], k))
    return MicrobatchGraph(mb_order, layers, mb, layer)


def grouping_costs(
    p: ScheduleProblem, ir: CollectiveIR, g: MicrobatchGraph, memory: Optional[float]
) -> GroupingCosts:
    idx = {n: i for i, n in enumerate(p.nodes)}
    n_layers, n_mb = len(g.layers), len(g.mb_order)
    ag = rs = 0.0
    for c in ir.collectives:
        i = idx.get(c.start)
        if i is None:
            continue
        if c.kind is CollectiveKind.ALL_GATHER and c.start not in ir.backward_nodes:
            ag += p.time[i]
        elif (
            c.kind in (CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE)
            and c.start in ir.backward_nodes
        ):
            rs += p.time[i]
    compute = sum(p.time[i] for i in g.mb if p.code[i] == NODE_COMPUTE)
    backward = bool(ir.backward_nodes)
    per = compute / (n_layers * n_mb)
    out = next((n for n in p.nodes if n.op == "output"), None)
    saved = 0
    if out is not None and not backward:
        for a in out.all_input_nodes:
            if idx.get(a) in g.mb:
                # the bytes of its storage as the estimator sized it (what every rank shares)
                saved += p.alloc[p.owner[idx[a]]]
    return GroupingCosts(
        c_ag=ag / n_layers,
        c_rs=rs / (n_layers * n_mb),
        c_fw=0.0 if backward else per,
        c_bw=per if backward else 0.0,
        m=saved / n_mb,
        memory=memory,
        microbatches=n_mb,
    )


def grouped_order(p: ScheduleProblem, g: MicrobatchGraph, group: int) -> list[int]:
    """Topological order of ``p`` (built without a chain) with micro-batches in groups of
    ``group``, each group layer-major."""
    INF = 1 << 30
    pos_mb = {k: r for r, k in enumerate(g.mb_order)}
    pos_layer = {name: r for r, name in enumerate(g.layers)}
    tail = set(p.tail)
    key: list[tuple[int, int, int, int, int]] = [(0, 0, 0, 0, 0)] * p.size
    for i in range(p.size - 1, -1, -1):
        if p.nodes[i].op in ("placeholder", "get_attr"):
            key[i] = (-1, -1, -1, -1, i)
        elif i in tail:
            key[i] = (INF, INF, INF, INF, i)
        elif i in g.mb:
            r = pos_mb[g.mb[i]]
            key[i] = (p.segment[i], r // group, pos_layer.get(g.layer.get(i, ""), INF), r, i)
        else:  # shared (deduplicated gathers, accumulation): with its first reader
            users = [key[u] for u in p.succs[i] if u not in tail]
            first = min(users) if users else (p.segment[i], INF, INF, INF, i)
            key[i] = (p.segment[i],) + first[1:4] + (i,)  # never leaves its own segment
    return keyed_topological_order(p, key)
