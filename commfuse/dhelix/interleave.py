"""DHelix strand interleaving of a fused train-step graph: which node runs beside which.

Contract
- Input: a fused forward+backward graph (:mod:`.fused_partition`) of ``compile_train_step``
  with M >= 2 micro-batches, every node tagged with its micro-batch (``microbatch_of``), its
  phase (``commfuse_phase``) and, through its module path, its layer (``layer_level.layer_name``;
  a micro-batch's nodes outside any layer go with the layer next to them, as the model level
  assigns them).
- Units and strands: the micro-batches, in the order the graph runs them, are cut into units
  of ``group`` consecutive micro-batches (the model-level grouping, below); units alternate
  between strand alpha (even units) and beta (odd units). The step is the chain

      F(u0) | B(u0) with F(u1) | B(u1) with F(u2) | ... | B(u_last)

  so every backward but the last runs beside the next unit's forward, which is in the other
  strand. Inside a pair, chunk c pairs the forward of layer c with the backward of layer
  L-1-c (the two strands sweep the layers in opposite directions, as in DHelix Fig. 6); a
  unit of several micro-batches runs each layer for all of them before the next layer.
- Per chunk pair: both sides are cut into segments (``from_graph.cut_segments``: a collective
  is one segment, compute between collectives one segment, each weight-gradient GEMM of the
  backward its own); segments of one side that already overlap each other (a collective whose
  wait comes after other segments of the same side) are merged (``merge_overlapping``); the
  backward's legal orders are the input order and the one with its weight-gradient GEMMs
  deferred to the end of the chunk; ``search_plans`` runs Eq. 2 over them with the OEF table.
- Emission: the plan's steps run in order, with a barrier between steps: inside a step, the
  nodes of collective segments (and what they need) first, then compute, then the waits of
  the collectives issued in the step. Nodes of no micro-batch (gradient accumulation adds,
  shared weight reads) run with their first reader when they only read graph inputs, else as
  soon as their inputs exist. The final order is a topological order of the graph (Kahn's
  algorithm, smallest key first), so dependencies win over the plan where they disagree.
- Determinism: every choice is a function of the graph, the cost model's estimates, the OEF
  table and the config, with ties broken by node position: identical on every rank.
  :meth:`InterleavePlan.digest` hashes the chosen order (node names) to check that.

Model-level composition (Centauri Eq. 2): forward and backward micro-batches are in flight
together here, so Eq. 2 is solved with its concurrency constraint ``L1 + L2 <= M`` and the
unit size is ``min(L1, L2)``; ``schedule_model_level=False`` gives units of one micro-batch.

Source: DHelix (Wang et al.), Sec. 4.1 (strands), 4.2 (segments, Eq. 2 pairing), Fig. 6.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from commfuse.core.meta import PHASE_META_KEY, microbatch_of
from commfuse.costmodel.simulator import NODE_COLLECTIVE, Simulator, buffer_lifetimes
from commfuse.costmodel.topology import Topology
from commfuse.dhelix.from_graph import _VIEW_LIKE, _comm_kind, _reaches_only_output, cut_segments
from commfuse.dhelix.overlap import OEFTable, merge_overlapping
from commfuse.dhelix.plan_dp import InfeasiblePlanError, PairingPlan, search_plans
from commfuse.dhelix.segments import Segment
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.schedule.list_scheduler import ScheduleProblem, build_problem, keyed_topological_order
from commfuse.schedule.model_level import MicrobatchGraph, microbatch_graph

aten = torch.ops.aten
_ACCUMULATE = frozenset({aten.add.Tensor, aten.mul.Tensor})


@dataclass(frozen=True)
class ChunkPlan:
    """The plan of one chunk pair (or of one chunk that runs alone)."""

    step: int  # chain step: 0 = the first unit's forward alone
    chunk: int
    fwd: Optional[str]  # "u1:layers.0" (unit and layer) or None
    bwd: Optional[str]
    codes: tuple[str, ...]  # Eq. 2 plan steps ("pair" / "fwd" / "bwd"); () for a chunk alone
    planned_us: float  # Eq. 2 total time of the plan
    solo_us: float  # the same segments one after the other
    bwd_order: int  # 0: input order, 1: weight-gradient GEMMs deferred


@dataclass
class InterleavePlan:
    group: int
    units: list[list[int]]  # micro-batches per unit, in chain order
    chunks: list[ChunkPlan]
    order: list[fx.Node] = field(repr=False)
    # node -> "step.chunk.plan-step" for the nodes of paired steps: the barrier interval it runs in
    step_of: dict[fx.Node, str] = field(default_factory=dict, repr=False)
    positions: list[int] = field(default_factory=list, repr=False)  # each node's position in the input order

    def digest(self) -> str:
        """Hash of the chosen order as positions in the input order, with each node's op: equal on
        ranks that chose the same order for the same graph (node names may differ per rank)."""
        items = [
            f"{k}:{n.op}:{getattr(n.target, '__name__', n.target)}"
            for k, n in zip(self.positions, self.order, strict=True)
        ]
        return hashlib.sha256("\n".join(items).encode()).hexdigest()[:16]

    @property
    def planned_us(self) -> float:
        return sum(c.planned_us for c in self.chunks)

    @property
    def solo_us(self) -> float:
        return sum(c.solo_us for c in self.chunks)

    def summary(self) -> dict:
        return {
            "group": self.group,
            "units": self.units,
            "digest": self.digest(),
            "planned_us": round(self.planned_us, 3),
            "solo_us": round(self.solo_us, 3),
            "pairs": sum(c.codes.count("pair") for c in self.chunks),
            "deferred_wgrad_chunks": sum(c.bwd_order == 1 for c in self.chunks),
            "chunks": [
                {
                    "step": c.step,
                    "chunk": c.chunk,
                    "fwd": c.fwd,
                    "bwd": c.bwd,
                    "codes": "".join(k[0] for k in c.codes),
                    "planned_us": round(c.planned_us, 3),
                    "solo_us": round(c.solo_us, 3),
                }
                for c in self.chunks
            ],
        }


def _movable(node: fx.Node) -> bool:
    """A backward mm whose value only reaches the output (through views and the accumulation
    of micro-batch gradients): a weight-gradient GEMM nothing else in the step waits for."""
    return node.target is aten.mm.default and _reaches_only_output(
        node,
        lambda u: (
            (u.target in _VIEW_LIKE or u.target in _ACCUMULATE) and u.meta.get(PHASE_META_KEY) == "backward"
        ),
    )


def _deferred(nodes: list[fx.Node], movable: set[fx.Node]) -> list[fx.Node]:
    """``nodes`` with each movable mm (and its views inside the chunk) moved to the end."""
    moved: list[fx.Node] = []
    inside = set(nodes)
    for n in nodes:
        if n in movable:
            moved.append(n)
            stack = list(n.users)
            while stack:
                u = stack.pop()
                if u in inside and u.target in _VIEW_LIKE and u not in moved:
                    moved.append(u)
                    stack.extend(u.users)
    pos = {n: k for k, n in enumerate(nodes)}
    moved.sort(key=pos.__getitem__)
    keep = [n for n in nodes if n not in set(moved)]
    return keep + moved


class _Side:
    """One side of a chunk pair: candidate orders, each cut into (merged) segments."""

    def __init__(self, planner: "_Planner", nodes: list[fx.Node], prefix: str, backward: bool) -> None:
        self.candidates: list[tuple[tuple[Segment, ...], dict[str, list[fx.Node]]]] = []
        orders = [nodes]
        movable = {n for n in nodes if _movable(n)} if backward else set()
        if movable:
            alt = _deferred(nodes, movable)
            if alt != nodes:
                orders.append(alt)
        for k, order in enumerate(orders):
            segs, covers = cut_segments(
                order,
                planner.sim,
                planner.coll_of,
                planner.delta,
                planner.topology,
                prefix=f"{prefix}{k}.",
                split={n.name for n in movable},
                comm_kind=planner.comm_kind,
            )
            # per original segment its nodes; a merged segment is named "a+b+..." after its members
            parts = {s.name: [planner.by_name[x] for x in c] for s, c in zip(segs, covers, strict=True)}
            planner.comm_segments.update(s.name for s in segs if s.kind != "compute")
            merged = merge_overlapping(segs, _self_overlaps(segs, parts, planner), planner.oef)
            self.candidates.append((merged, parts))


def _self_overlaps(
    segs: tuple[Segment, ...], members: dict[str, list[fx.Node]], planner: "_Planner"
) -> list[list[str]]:
    """Groups of adjacent segments a collective already overlaps on its own side: from the
    collective's segment to the one before the segment holding its wait."""
    where: dict[fx.Node, int] = {}
    for k, s in enumerate(segs):
        for n in members[s.name]:
            where[n] = k
    spans: list[tuple[int, int]] = []
    for k, s in enumerate(segs):
        if s.kind == "compute":
            continue
        start = next(n for n in members[s.name] if planner.sim.node_info(n).code == NODE_COLLECTIVE)
        waits = [w for w in planner.waits.get(start, []) if w in where]
        end = max((where[w] for w in waits), default=k + 1) - 1
        if end > k:
            spans.append((k, end))
    spans.sort()
    merged: list[list[int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [[segs[i].name for i in range(a, b + 1)] for a, b in merged]


class _Planner:
    def __init__(
        self, gm: fx.GraphModule, sim: Simulator, ir: CollectiveIR, topology: Topology, oef: OEFTable
    ) -> None:
        self.gm, self.sim, self.ir, self.topology, self.oef = gm, sim, ir, topology, oef
        self.nodes = list(gm.graph.nodes)
        self.by_name = {n.name: n for n in self.nodes}
        self.coll_of = {c.start: c for c in ir.collectives}
        self.waits: dict[fx.Node, list[fx.Node]] = {c.start: list(c.waits) for c in ir.collectives}
        self.delta = _live_deltas(self.nodes, sim)
        self.comm_segments: set[str] = set()

    def comm_kind(self, coll) -> str:
        return segment_comm_kind(coll, self.topology)


def segment_comm_kind(coll, topology: Topology) -> str:
    """``comm_cross`` / ``comm_local`` for a collective; a group whose ranks are unknown (no live
    process group, e.g. a graph loaded from disk) counts as local."""
    return "comm_local" if coll.group.ranks is None else _comm_kind(coll, topology)


def _live_deltas(nodes: list[fx.Node], sim: Simulator) -> dict[fx.Node, int]:
    never = len(nodes) + 1
    owner, last = buffer_lifetimes(nodes, lambda n: sim.node_info(n).alias_src, never)
    delta = {n: 0 for n in nodes}
    for n in nodes:
        if n.op not in ("placeholder", "get_attr") and owner[n] is n:
            delta[n] += sim.node_info(n).alloc
    for o, i in last.items():
        if i != never and o.op not in ("placeholder", "get_attr"):
            delta[nodes[i]] -= sim.node_info(o).alloc
    return delta


def _chunks(
    p: ScheduleProblem, g: MicrobatchGraph, unit_of: dict[int, int], phase: list[Optional[str]]
) -> dict[tuple[int, str], list[list[int]]]:
    """(unit, phase) -> node indices per chunk (forward: layers in order; backward: reversed)."""
    pos_layer = {name: r for r, name in enumerate(g.layers)}
    n_layers = len(g.layers)
    out: dict[tuple[int, str], list[list[int]]] = {}
    for i in range(p.size):
        if i not in g.mb or phase[i] is None:
            continue
        u, ph = unit_of[g.mb[i]], phase[i]
        chunks = out.setdefault((u, ph), [[] for _ in range(n_layers)])
        r = pos_layer.get(g.layer.get(i, ""), None)
        if r is None:  # outside every layer and no layered neighbour: with the first / last chunk
            c = 0 if ph == "forward" else n_layers - 1
        else:
            c = r if ph == "forward" else n_layers - 1 - r
        chunks[c].append(i)
    return out


def _microbatch_graph(p: ScheduleProblem) -> Optional[MicrobatchGraph]:
    """The model level's micro-batch/layer map; a graph traced without modules is one layer."""
    g = microbatch_graph(p)
    if g is not None:
        return g
    mb = {
        i: k for i, n in enumerate(p.nodes) if n.op == "call_function" and (k := microbatch_of(n)) is not None
    }
    if len(set(mb.values())) < 2:
        return None
    return MicrobatchGraph(sorted(set(mb.values())), [""], mb, {i: "" for i in mb})


def sequential_order(gm: fx.GraphModule, sim: Simulator, ir: CollectiveIR) -> list[fx.Node]:
    """The non-interleaved step in the fused graph: every forward, then every backward, each in
    micro-batch order (what the plain step runs, with the accumulation in micro-batch order).
    The baseline the interleaved order's memory is judged against."""
    free = build_problem(gm, sim, ir, chain=())
    key: list[Optional[tuple]] = [None] * free.size
    for i, n in enumerate(free.nodes):
        k, ph = microbatch_of(n), n.meta.get(PHASE_META_KEY) if n.op == "call_function" else None
        if k is not None and ph is not None:
            key[i] = (0 if ph == "forward" else 1, k, 0, 1, i)
    order = keyed_topological_order(free, _complete_keys(free, key, 1 << 30))
    return [free.nodes[i] for i in order]


def plan_interleaving(
    gm: fx.GraphModule,
    sim: Simulator,
    ir: CollectiveIR,
    topology: Topology,
    oef: OEFTable,
    *,
    group: int = 1,
    mem_budget: Optional[float] = None,
) -> InterleavePlan | str:
    """The interleaved order of a fused train-step graph (module docstring), or why there is none."""
    free = build_problem(gm, sim, ir, chain=())
    g = _microbatch_graph(free)
    if g is None:
        return "fewer than two micro-batches in the graph"
    phase = [n.meta.get(PHASE_META_KEY) if n.op == "call_function" else None for n in free.nodes]
    if "backward" not in phase:
        return "not a fused forward+backward graph (Config(dhelix=True) partitions train steps that way)"
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    # micro-batches in the order their forwards run (a fused graph runs the backwards in reverse)
    first_fwd: dict[int, int] = {}
    for i, k in g.mb.items():
        if phase[i] == "forward":
            first_fwd[k] = min(first_fwd.get(k, i), i)
    mb_order = sorted(g.mb_order, key=lambda k: (first_fwd.get(k, free.size), k))
    units = [mb_order[k : k + group] for k in range(0, len(mb_order), group)]
    if len(units) < 2:
        return f"one unit of {group} micro-batch(es): no backward has a next forward to run beside"
    unit_of = {mb: u for u, mbs in enumerate(units) for mb in mbs}
    chunks = _chunks(free, g, unit_of, phase)
    planner = _Planner(gm, sim, ir, topology, oef)
    idx = {n: i for i, n in enumerate(free.nodes)}
    INF = 1 << 30
    key: list[Optional[tuple]] = [None] * free.size
    plans: list[ChunkPlan] = []
    n_chunks = len(g.layers)

    def label(u: int, c: int, ph: str) -> str:
        r = c if ph == "forward" else n_chunks - 1 - c
        return f"u{u}:{g.layers[r] or 'graph'}"

    def alone(step: int, u: int, ph: str) -> None:
        for c, members in enumerate(chunks.get((u, ph), [])):
            for i in members:
                key[i] = (step, c, 0, 1, i)
            if members:
                t = sum(free.time[i] for i in members)
                plans.append(
                    ChunkPlan(
                        step,
                        c,
                        label(u, c, ph) if ph == "forward" else None,
                        label(u, c, ph) if ph == "backward" else None,
                        (),
                        t,
                        t,
                        0,
                    )
                )

    alone(0, 0, "forward")
    for step in range(1, len(units)):
        fch, bch = chunks.get((step, "forward"), []), chunks.get((step - 1, "backward"), [])
        for c in range(n_chunks):
            fnodes = [free.nodes[i] for i in (fch[c] if c < len(fch) else [])]
            bnodes = [free.nodes[i] for i in (bch[c] if c < len(bch) else [])]
            fside = _Side(planner, fnodes, f"s{step}c{c}f", backward=False)
            bside = _Side(planner, bnodes, f"s{step}c{c}b", backward=True)
            try:
                found = search_plans(
                    [fside.candidates[0][0]], [s for s, _ in bside.candidates], oef, mem_budget=mem_budget
                )
            except InfeasiblePlanError as e:
                return f"step {step}, chunk {c}: {e}"
            plan: PairingPlan = found.plan
            members = {**fside.candidates[0][1], **bside.candidates[found.bwd_index][1]}
            for q, st in enumerate(plan.steps):
                for name in (st.fwd, st.bwd):
                    if name is None:
                        continue
                    for part in name.split("+"):
                        sub = 0 if part in planner.comm_segments else 1
                        for n in members[part]:
                            key[idx[n]] = (step, c, q, sub, idx[n])
            solo = sum(s.duration for s in fside.candidates[0][0]) + sum(
                s.duration for s in bside.candidates[found.bwd_index][0]
            )
            plans.append(
                ChunkPlan(
                    step,
                    c,
                    label(step, c, "forward") if fnodes else None,
                    label(step - 1, c, "backward") if bnodes else None,
                    plan.codes,
                    plan.total_time,
                    solo,
                    found.bwd_index,
                )
            )
    alone(len(units), len(units) - 1, "backward")
    # A wait of a collective issued in a paired step closes that step (the barrier).
    for start, waits in planner.waits.items():
        ks = key[idx[start]]
        if ks is None or ks[0] in (0, len(units)):
            continue
        for w in waits:
            if w in idx and key[idx[w]] is not None:
                key[idx[w]] = ks[:3] + (2, idx[w])
    full = _complete_keys(free, key, INF)
    order = keyed_topological_order(free, full)
    if len(order) != free.size:  # pragma: no cover - keyed_topological_order over a DAG
        raise AssertionError("plan_interleaving: the order lost nodes")
    step_of = {
        free.nodes[i]: f"{k[0]}.{k[1]}.{k[2]}"
        for i, k in enumerate(key)
        if k is not None and 0 < k[0] < len(units)
    }
    return InterleavePlan(group, units, plans, [free.nodes[i] for i in order], step_of, list(order))


def _complete_keys(p: ScheduleProblem, key: list[Optional[tuple]], inf: int) -> list[tuple]:
    """Keys for the nodes the plan did not place: graph inputs first, the output last, a node of
    no micro-batch with its first reader (if it only reads inputs) or right after its inputs."""
    out: list[Optional[tuple]] = list(key)
    for i in range(p.size):
        n = p.nodes[i]
        if n.op in ("placeholder", "get_attr"):
            out[i] = (-1, -1, -1, -1, i)
        elif n.op == "output":
            out[i] = (inf, inf, inf, inf, i)
    pending = [i for i in range(p.size) if out[i] is None]
    reads_inputs_only = {
        i for i in pending if all(p.nodes[q].op in ("placeholder", "get_attr") for q in p.preds[i])
    }
    # first-reader keys, from the back (readers may themselves be unplaced)
    for i in reversed(pending):
        if i in reads_inputs_only:
            users = [out[u] for u in p.succs[i] if out[u] is not None]
            if users:
                first = min(users)
                out[i] = first[:4] + (i,)
    for i in pending:
        if out[i] is None:
            ins = [out[q] for q in p.preds[i] if out[q] is not None]
            last = max(ins) if ins else (-1, -1, -1, -1, i)
            out[i] = last[:4] + (i,)
    # never across a barrier (an in-place op or other side effect keeps its place)
    return [(p.segment[i],) + k for i, k in enumerate(out)]
