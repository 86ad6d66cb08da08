"""Layer-level backward scheduling (Centauri §3.2.2, Eq. 1): activation- or weight-gradient first.

Contract
- Matches: backward nodes of a scheduled graph (``CollectiveIR.backward_nodes``), grouped into
  layers by the module that traced them (``fwd_nn_module_stack``/``nn_module_stack``: the path
  up to the first numbered child, e.g. ``layers.3``, else the first child, e.g. ``output``).
  Nodes without a module (gradient accumulation adds) join the layer of their first input; a
  graph with no module information at all (``make_fx`` of a function) is one layer.
- Classifies each layer's nodes into Eq. 1's parts:
  ``G_act``: compute on the path to the gradient that leaves the layer (read by another layer);
  ``G_w``: the layer's other compute that reaches a weight gradient (a graph output or a
  data-parallel reduction); ``others``: the rest. Collectives by parallel role (``ir.roles``):
  all_gather of FSDP -> ``W_AG`` (weights re-gathered for backward), all_gather of TP/SP ->
  ``act_AG``, reduce_scatter/all_reduce of FSDP/DP -> ``G_w_RS``, of TP/SP -> ``act_RS``.
  A layer with any other collective (all_to_all, unknown role, p2p) is left in input order.
- Decides per layer from the graph's cost estimates (times the simulator uses):

      T1 = W_AG + max(G_act, act_AG) + max(G_w, act_RS) + max(G_w_RS, others)
      T2 = act_AG + max(G_w, W_AG) + max(G_act, G_w_RS) + act_RS + others

  T1 <= T2 (ties: T1, the usual order): activation-gradient first, else weight-gradient first.
- Produces a *preferred order*: a topological order of the whole graph by (layer in backward
  order, part rank of the layer's choice, original index), where the part ranks follow the
  sequence of Eq. 1's terms (T1: act_AG, W_AG, G_act, act_RS, G_w, G_w_RS, others; T2: act_AG,
  W_AG, G_w, G_w_RS, G_act, act_RS, others; act_AG first in both because every part of the
  layer reads it). Weight-gradient first also moves the next backward layer's weight gathers
  into this layer's W_AG slot, so they run under this layer's G_w (T2's ``max(G_w, W_AG)``). The list scheduler takes it as its baseline order
  and its collectives' sequence as the one total issue order (``schedule_overlap``).
- Guarantees: the preferred order respects every dependency the scheduling problem has (data,
  random ops, barriers' segments are kept by the scheduler). The choice is a function of the
  graph and the cost model only, so ranks with the same graph choose the same order (uneven
  shards that give ranks different compute shapes could choose differently: the runtime
  agreement check, ``commfuse.agreement``, names the difference instead of hanging).

Source: Centauri §3.2.2 (Eq. 1, Fig. 6). Choices the paper leaves open: docs/scheduler.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

import torch.fx as fx

from commfuse.costmodel.simulator import NODE_COLLECTIVE, NODE_COMPUTE, NODE_WAIT
from commfuse.ir.collective import ParallelRole
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.ir.kinds import CollectiveKind
from commfuse.schedule.list_scheduler import ScheduleProblem, keyed_topological_order

W_AG, ACT_AG, G_ACT, ACT_RS, G_W, G_W_RS, OTHERS = (
    "W_AG",
    "act_AG",
    "G_act",
    "act_RS",
    "G_w",
    "G_w_RS",
    "others",
)
PARTS = (W_AG, ACT_AG, G_ACT, ACT_RS, G_W, G_W_RS, OTHERS)
# Eq. 1's terms in the order each priority runs them.
# The gathered gradient (act_AG) goes first in both: all of the layer's compute reads it.
# Weight-gradient first also pulls the *next* backward layer's weight gathers into this layer,
# right after act_AG, so that they run under G_w (T2's max(G_w, W_AG)).
RANKS = {
    "activation_first": {p: i for i, p in enumerate((ACT_AG, W_AG, G_ACT, ACT_RS, G_W, G_W_RS, OTHERS))},
    "weight_first": {p: i for i, p in enumerate((ACT_AG, W_AG, G_W, G_W_RS, G_ACT, ACT_RS, OTHERS))},
}
GRAPH_LAYER = "<graph>"
_NUMBERED = re.compile(r"^(.*?\.\d+)(?:\.|$)")
_WEIGHT_ROLES = (ParallelRole.FSDP, ParallelRole.DP)
_ACT_ROLES = (ParallelRole.TP, ParallelRole.SP)
_GATHER = (CollectiveKind.ALL_GATHER,)
_REDUCE = (CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE)


@dataclass(frozen=True)
class LayerCosts:
    """Eq. 1's inputs for one backward layer (microseconds)."""

    w_ag: float = 0.0
    act_ag: float = 0.0
    g_act: float = 0.0
    act_rs: float = 0.0
    g_w: float = 0.0
    g_w_rs: float = 0.0
    others: float = 0.0

    @property
    def t1(self) -> float:
        return (
            self.w_ag
            + max(self.g_act, self.act_ag)
            + max(self.g_w, self.act_rs)
            + max(self.g_w_rs, self.others)
        )

    @property
    def t2(self) -> float:
        return (
            self.act_ag + max(self.g_w, self.w_ag) + max(self.g_act, self.g_w_rs) + self.act_rs + self.others
        )

    @property
    def choice(self) -> str:
        return "activation_first" if self.t1 <= self.t2 else "weight_first"


@dataclass
class BackwardLayer:
    name: str
    position: int  # order of first appearance in the graph (= backward order)
    nodes: list[int] = field(default_factory=list)
    part: dict[int, str] = field(default_factory=dict)
    costs: LayerCosts = LayerCosts()
    refused: Optional[str] = None  # why the layer keeps its input order

    @property
    def choice(self) -> Optional[str]:
        return None if self.refused else self.costs.choice

    def describe(self) -> dict:
        c = self.costs
        d = {"layer": self.name, "nodes": len(self.nodes)}
        if self.refused:
            d["kept_input_order"] = self.refused
            return d
        d.update(
            {
                "T1_us": round(c.t1, 3),
                "T2_us": round(c.t2, 3),
                "choice": c.choice,
                "terms_us": {p: round(getattr(c, p.lower()), 3) for p in PARTS},
            }
        )
        return d


def layer_name(node: fx.Node) -> Optional[str]:
    """The layer a node was traced in: module path up to the first numbered child."""
    stack = node.meta.get("fwd_nn_module_stack") or node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    if not isinstance(path, str) or not path:
        return None
    m = _NUMBERED.match(path)
    if m:
        return m.group(1)
    parts = path.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else path


def backward_layers(p: ScheduleProblem, ir: CollectiveIR, *, every_node: bool = False) -> list[BackwardLayer]:
    """The graph's backward layers in backward order, each classified and priced (Eq. 1).
    ``every_node``: treat the whole graph as backward (``schedule_overlap_layer_forced``)."""
    idx = {n: i for i, n in enumerate(p.nodes)}
    bwd = set(range(p.size)) if every_node else {idx[n] for n in ir.backward_nodes if n in idx}
    # Work only the backward reads (weights re-gathered for backward, recomputation) belongs
    # to the backward too, though it does not depend on a tangent.
    for i in range(p.size - 1, -1, -1):
        n = p.nodes[i]
        if i not in bwd and n.op == "call_function" and n.users and all(idx[u] in bwd for u in n.users):
            bwd.add(i)
    layer_of: dict[int, str] = {}
    # A graph traced without modules (make_fx of a function) is one layer.
    anonymous = not any(layer_name(p.nodes[i]) for i in bwd)
    for i in sorted(bwd):
        n = p.nodes[i]
        if n.op != "call_function":
            continue
        name = GRAPH_LAYER if anonymous else layer_name(n)
        if name is None:  # accumulation adds, waits: the layer of the first input that has one
            name = next((layer_of[q] for q in p.preds[i] if q in layer_of), None)
        if name is not None:
            layer_of[i] = name
    for i in sorted(bwd, reverse=True):  # still unplaced: the layer of the first reader
        if i not in layer_of and p.nodes[i].op == "call_function":
            name = next((layer_of[u] for u in p.succs[i] if u in layer_of), None)
            if name is not None:
                layer_of[i] = name
    layers: dict[str, BackwardLayer] = {}
    for i in sorted(layer_of):
        name = layer_of[i]
        if name not in layers:
            layers[name] = BackwardLayer(name, len(layers))
        layers[name].nodes.append(i)
    coll_of = {idx[c.start]: c for c in ir.collectives if c.start in idx}
    for lay in layers.values():
        _classify(p, lay, layer_of, coll_of)
    return sorted(layers.values(), key=lambda lay: lay.position)


def _classify(p: ScheduleProblem, lay: BackwardLayer, layer_of: dict[int, str], coll_of: dict) -> None:
    mine = set(lay.nodes)
    for i in lay.nodes:
        c = coll_of.get(i)
        if c is None:
            continue
        weight, act = c.role in _WEIGHT_ROLES, c.role in _ACT_ROLES
        if c.kind in _GATHER and (weight or act):
            lay.part[i] = W_AG if weight else ACT_AG
        elif c.kind in _REDUCE and (weight or act):
            lay.part[i] = G_W_RS if weight else ACT_RS
        else:
            lay.refused = (
                f"{c.kind.value} of role {c.role.value} ({p.nodes[i].name}) is not one of Eq. 1's parts"
            )
            return
    # G_act: ancestors (inside the layer) of values another layer reads and of what the TP/SP
    # reductions send on.
    act_roots = [
        i
        for i in lay.nodes
        if any(layer_of.get(u, lay.name) != lay.name for u in p.succs[i] if p.nodes[u].op != "output")
    ]
    act_roots += [q for i, part in lay.part.items() if part == ACT_RS for q in p.preds[i]]
    g_act = _ancestors_within(p, act_roots, mine)
    # G_w: other compute reaching a weight-gradient reduction or a graph output.
    weight_roots = [q for i, part in lay.part.items() if part == G_W_RS for q in p.preds[i]]
    weight_roots += [i for i in lay.nodes if any(p.nodes[u].op == "output" for u in p.succs[i])]
    g_w = _ancestors_within(p, weight_roots, mine) - g_act
    times = dict.fromkeys(PARTS, 0.0)
    for i in lay.nodes:
        if i in lay.part:
            times[lay.part[i]] += p.time[i]
            continue
        part = G_ACT if i in g_act else G_W if i in g_w else OTHERS
        if p.code[i] == NODE_WAIT:  # ordered with its collective, so its readers are not held back
            part = lay.part.get(p.wait_of.get(i, -1), part)
        lay.part[i] = part
        if p.code[i] == NODE_COMPUTE:
            times[part] += p.time[i]
    lay.costs = LayerCosts(**{k.lower(): v for k, v in times.items()})


def _ancestors_within(p: ScheduleProblem, roots: list[int], within: set[int]) -> set[int]:
    seen: set[int] = set()
    stack = [r for r in roots if r in within]
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        stack.extend(q for q in p.preds[x] if q in within and q not in seen)
    return seen


def preferred_order(p: ScheduleProblem, layers: list[BackwardLayer]) -> Optional[list[int]]:
    """A topological order of ``p`` by (segment, layer position, part rank, index); None when no
    layer has a choice. ``p`` must be built without a collective chain (``chain=()``): the order
    chooses the chain. Segments first, so that no collective is chained ahead of a barrier it
    follows in the input."""
    tail = set(p.tail)
    key: list[tuple[int, int, int, int]] = [
        (len(p.segments) if i in tail else p.segment[i], -1, 0, i) for i in range(p.size)
    ]
    decided = False
    for lay in layers:
        choice = lay.choice
        ranks = RANKS[choice] if choice else None
        decided |= choice is not None
        for i in lay.nodes:
            r = ranks.get(lay.part.get(i, OTHERS), len(PARTS)) if ranks else 0
            key[i] = (p.segment[i], lay.position, r, i)
    for k, lay in enumerate(layers[:-1]):
        nxt = layers[k + 1]
        if lay.choice != "weight_first" or nxt.refused:
            continue
        for i in nxt.nodes:  # prefetch: the next layer's weight gathers run under this G_w
            if nxt.part.get(i) == W_AG:
                key[i] = (p.segment[i], lay.position, RANKS["weight_first"][W_AG], i)
    if not decided:
        return None
    order = keyed_topological_order(p, key)
    if len(order) != p.size:  # a cycle: cannot happen for a graph's own edges
        return None
    return order


def chain_of(p: ScheduleProblem, order: list[int]) -> list[int]:
    """The collectives of ``order`` in its sequence (the issue order the preferred order implies)."""
    return [i for i in order if p.code[i] == NODE_COLLECTIVE and i in p.coll_bytes]
