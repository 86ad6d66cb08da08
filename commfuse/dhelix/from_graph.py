"""DHelix segments from traced FX graphs: cut one layer's forward / backward graph into strand units.

Contract
- :func:`graph_segments` walks a traced (AOTAutograd forward or backward) graph in its node
  order and cuts it into :class:`~.segments.Segment` units for the Eq. 2 pairing DP:
  * every collective (start node; its wait is free) is one segment, kind ``comm_cross``
    if its group's ranks span nodes on the :class:`~commfuse.costmodel.topology.Topology`,
    else ``comm_local``; its duration is the estimator's collective time on that group;
  * each maximal run of compute between two collectives is one ``compute`` segment whose
    duration is the sum of the estimator's compute times of its nodes (views and other free
    ops cost 0); a run that costs nothing is not a segment — its nodes (and memory) join
    the next segment;
  * with ``split_movable=True``, every *movable* op (below) is its own ``compute``
    segment, so the pairing can put it beside another unit of the other strand.
  Durations are microseconds on one rank, from the same ``Simulator`` cost table the
  schedulers use, so they are deterministic functions of the graph and the topology (every
  rank cuts and prices identically).
- Memory: ``mem_delta`` is the change of live bytes over the segment under the simulator's
  memory model (``buffer_lifetimes``: a node allocates its output unless it aliases an
  input; a buffer is freed after its last use; graph outputs are kept). Placeholders are
  already allocated when the graph starts (not counted); in a backward, placeholders
  that are not forward inputs (saved activations, tangents — AOTAutograd names forward
  inputs ``primals_*``) are freed at their last use, while forward inputs (parameters, the
  layer input) are never freed by the layer. So a forward's deltas are >= 0 in total (it
  keeps its saved activations) and a backward releases them.
- Movable ops (:func:`movable_ops`), the rule kept simple on purpose: in a backward, an
  ``aten.mm`` whose result reaches *only* the graph output, possibly through view-like
  ops (transpose, view, reshape, ...), i.e. a weight-gradient GEMM: nothing else in the
  layer's backward waits for it, so it may run anywhere after its inputs exist (DHelix
  Sec. 4.2: "only the weight-gradient GEMM and the MoE router actually move"; the router
  is not handled). :func:`defer_movable` returns a copy of the graph with those GEMMs (and
  their view chains) moved to just before the output — the other legal order the report
  gives :func:`~.plan_dp.search_plans`; its memory deltas come from re-cutting that graph.

Source: DHelix (Wang et al., "Hiding Communication Cost in Distributed LLM Training via
Micro-batch Co-execution"), Sec. 4.2 ("Operator Sequencing and Partitioning").
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.fx as fx

from commfuse.costmodel.simulator import NODE_COLLECTIVE, NODE_COMPUTE, Simulator, buffer_lifetimes
from commfuse.costmodel.topology import Topology
from commfuse.dhelix.segments import Segment
from commfuse.ir.collective import Collective
from commfuse.ir.graph_ir import CollectiveIR

aten = torch.ops.aten
STRANDS = ("forward", "backward")
# ops that only re-describe their input's storage / layout on the way to the output
_VIEW_LIKE = frozenset(
    {
        aten.t.default,
        aten.transpose.int,
        aten.permute.default,
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.squeeze.dim,
        aten.unsqueeze.default,
        aten.expand.default,
        aten.alias.default,
    }
)
_MATMULS = frozenset({aten.mm.default})


@dataclass(frozen=True)
class GraphSegments:
    """The strand of one graph: its segments, the node names each covers, the movable ops."""

    strand: str  # "forward" | "backward"
    segments: tuple[Segment, ...]
    nodes: tuple[tuple[str, ...], ...]  # per segment, the graph nodes it covers, in order
    movable: tuple[str, ...]  # names of the movable (weight-gradient) mm nodes

    @property
    def total_time(self) -> float:
        return sum(s.duration for s in self.segments)

    def kinds(self) -> tuple[str, ...]:
        return tuple(s.kind for s in self.segments)


def _reaches_only_output(node: fx.Node, through=lambda u: u.target in _VIEW_LIKE) -> bool:
    """Every use of ``node`` leads to the graph output through nodes ``through`` accepts only
    (default: view-like ops)."""
    stack = list(node.users)
    if not stack:
        return False
    seen: set[fx.Node] = set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.op == "output":
            continue
        if u.op != "call_function" or not through(u) or not u.users:
            return False
        stack.extend(u.users)
    return True


def movable_ops(gm: fx.GraphModule) -> tuple[str, ...]:
    """Weight-gradient GEMMs of a backward graph (module docstring), in graph order."""
    return tuple(
        n.name
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target in _MATMULS and _reaches_only_output(n)
    )


def _view_chain(node: fx.Node) -> list[fx.Node]:
    """The view-like nodes between a movable mm and the output, in graph order."""
    out: list[fx.Node] = []
    stack = list(node.users)
    while stack:
        u = stack.pop()
        if u.op == "call_function" and u not in out:
            out.append(u)
            stack.extend(u.users)
    pos = {n: k for k, n in enumerate(node.graph.nodes)}
    return sorted(out, key=pos.__getitem__)


def defer_movable(gm: fx.GraphModule) -> fx.GraphModule:
    """Copy of ``gm`` with every movable mm (and its view chain) moved just before the output.

    Legal because a movable mm's inputs are defined before it and only the output (through
    views) uses it."""
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    out = new.graph.output_node()
    names = set(movable_ops(new))
    for n in [n for n in new.graph.nodes if n.name in names]:
        for m in [n] + _view_chain(n):
            out.prepend(m)
    new.graph.lint()
    new.recompile()
    return new


def _comm_kind(coll: Collective, topology: Topology) -> str:
    """``comm_cross`` if the collective's group spans nodes on ``topology``, else ``comm_local``."""
    ranks = coll.group.ranks
    if ranks is None:
        raise ValueError(
            f"graph_segments: collective {coll.start.name!r} on {coll.group.describe()} has unknown "
            "ranks; cannot tell local from cross-node communication (run commfuse.setup(mesh=...) first)"
        )
    return "comm_cross" if topology.spans_nodes(tuple(ranks)) else "comm_local"


def _live_deltas(gm: fx.GraphModule, sim: Simulator, strand: str) -> dict[fx.Node, int]:
    """Per node, live bytes it adds minus bytes freed right after it (module docstring)."""
    nodes = list(gm.graph.nodes)
    never = len(nodes) + 1
    owner, last = buffer_lifetimes(nodes, lambda n: sim.node_info(n).alias_src, never)
    for n in nodes:
        if n.op == "placeholder" and (strand == "forward" or n.name.startswith("primals")):
            last[owner[n]] = never  # forward inputs (parameters, the layer input) outlive the layer
    delta = {n: 0 for n in nodes}
    for n in nodes:
        if n.op != "placeholder" and owner[n] is n:
            delta[n] += sim.node_info(n).alloc
    for o, i in last.items():
        if i != never:
            delta[nodes[i]] -= sim.node_info(o).alloc
    return delta


def cut_segments(
    nodes: list[fx.Node],
    sim: Simulator,
    coll_of: dict[fx.Node, Collective],
    delta: dict[fx.Node, int],
    topology: Topology,
    *,
    prefix: str,
    split: set[str] = frozenset(),
    comm_kind=None,
) -> tuple[tuple[Segment, ...], tuple[tuple[str, ...], ...]]:
    """Cut ``nodes`` (one strand's nodes, in order) into segments (module docstring's rules);
    returns the segments and, per segment, the names of the nodes it covers.

    ``comm_kind(collective)`` overrides how a collective's segment kind is found (default:
    :func:`_comm_kind` on ``topology``)."""
    kind_of = comm_kind or (lambda c: _comm_kind(c, topology))
    segs: list[Segment] = []
    covers: list[tuple[str, ...]] = []
    run: list[fx.Node] = []  # the open compute run (and free nodes carried forward)
    run_time = 0.0

    def emit(kind: str, label: str, nodes: list[fx.Node], duration: float) -> None:
        name = f"{prefix}{len(segs):02d}.{label}"
        segs.append(Segment(name, kind, float(duration), float(sum(delta[n] for n in nodes))))
        covers.append(tuple(n.name for n in nodes))

    def close_run() -> None:
        nonlocal run, run_time
        if run_time > 0:
            emit(
                "compute",
                f"compute:{run[0].name}..{run[-1].name}" if len(run) > 1 else f"compute:{run[0].name}",
                run,
                run_time,
            )
            run, run_time = [], 0.0

    for n in nodes:
        info = sim.node_info(n)
        if info.code == NODE_COLLECTIVE:
            close_run()
            coll = coll_of[n]
            emit(kind_of(coll), f"{coll.kind.value}:{n.name}", run + [n], info.time_us)
            run = []
        elif n.name in split:
            close_run()
            emit("compute", f"wgrad:{n.name}", run + [n], info.time_us)
            run = []
        else:
            run.append(n)
            if info.code == NODE_COMPUTE:
                run_time += info.time_us
    if run:  # trailing nodes: a costed run, or free nodes joining the last segment
        if run_time > 0 or not segs:
            emit("compute", f"compute:{run[0].name}..{run[-1].name}", run, run_time)
        else:
            last = segs[-1]
            segs[-1] = Segment(
                last.name, last.kind, last.duration, last.mem_delta + sum(delta[n] for n in run)
            )
            covers[-1] = covers[-1] + tuple(n.name for n in run)
    return tuple(segs), tuple(covers)


def graph_segments(
    gm: fx.GraphModule, estimator, topology: Topology, *, strand: str, split_movable: bool = True
) -> GraphSegments:
    """Cut ``gm`` (one layer's forward or backward graph) into DHelix segments (module docstring).

    ``estimator`` is a :class:`~commfuse.costmodel.estimator.CostEstimator` (e.g.
    ``AnalyticCostModel(topology)``)."""
    if strand not in STRANDS:
        raise ValueError(f"graph_segments: strand must be one of {STRANDS}, got {strand!r}")
    if not isinstance(topology, Topology):
        raise ValueError(f"graph_segments: topology must be a Topology, got {type(topology).__name__}")
    ir = CollectiveIR(gm)
    sim = Simulator(gm, estimator, ir=ir)
    delta = _live_deltas(gm, sim, strand)
    movable = movable_ops(gm) if strand == "backward" else ()
    segs, covers = cut_segments(
        list(gm.graph.nodes),
        sim,
        {c.start: c for c in ir.collectives},
        delta,
        topology,
        prefix=strand[0],
        split=set(movable) if split_movable else set(),
    )
    return GraphSegments(strand, segs, covers, movable)
