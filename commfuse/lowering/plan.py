"""The lowering plan: what the runtime will do with one scheduled graph, decided before it runs.

A plan is a pure function of the graph (its node order and the ``meta`` the passes
left on it), so it is the same on every rank that compiled the same graph and can
be built, dumped and tested without a process group:

* ``collectives``: every collective start in the graph's order -- which is the
  scheduler's single total issue order, the order the runtime issues them in -- with
  the group named in the graph, the group it is *issued on* (a Lagom communicator-pool
  alias when ``lagom_tune`` chose one, else the graph's group), the bytes it moves
  (NCCL count semantics) and the node(s) that wait on it.
* ``streams``: which compute stream runs each compute node. A pass puts a node on a
  side stream by setting ``node.meta["commfuse_stream"] = k`` (``k >= 1``; 0 or absent
  is the default stream). Collectives and waits always run on the default stream
  (they only *issue*; c10d runs the transfer on the group's own stream).
* ``events``: for every value produced on one stream and consumed on another, the
  consumer's stream waits for an event recorded right after the producer; ``keep_alive``
  lists the values a stream other than their producer's reads, which the CUDA runtime
  marks with ``record_stream`` so the allocator never reuses their memory early.
* ``barriers``: a pass may cut the graph into barrier intervals with
  ``node.meta["commfuse_barrier"]`` (any label; consecutive nodes with the same label form one
  interval, DHelix's segment pairs). No stream starts an interval before every stream has
  finished the previous one: for each pair of streams, an event from the last node one ran
  in the previous interval to the first node the other runs in the next (added to ``events``).

The plan says nothing about the backend: on CPU the same plan runs with asynchronous
work handles (streams are a CUDA notion; side-stream nodes then run in graph order).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch.fx as fx

from commfuse.core.meta import BARRIER_META, SETTING_META, stream_hint
from commfuse.ir.collective import ParallelRole
from commfuse.ir.graph_ir import CollectiveIR, IRBuildOptions
from commfuse.ir.kinds import collective_spec, is_wait


@dataclass(frozen=True)
class PlannedCollective:
    """One collective as the runtime issues it."""

    index: int  # position in the total issue order
    start: str  # start node name
    waits: tuple[str, ...]
    kind: str
    group: str  # the process group the graph names
    issue_group: str  # the process group it is issued on (see module docstring)
    logged_bytes: Optional[int]  # NCCL count x dtype size, per rank
    setting: Optional[dict[str, Any]] = None  # Lagom's choice, if any
    role: Optional[str] = None  # the group's parallel role (tp, sp, ...), None when unknown

    def label(self) -> str:
        """What the runtime calls it in a profiler trace: ``commfuse::<kind>[<role or group>]:<start>``."""
        return f"commfuse::{self.kind}[{self.role or self.group}]:{self.start}"


@dataclass(frozen=True)
class StreamEdge:
    """``consumer`` (on ``dst`` stream) must not start before ``producer`` (on ``src``) ends."""

    producer: str
    consumer: str
    src: int
    dst: int


@dataclass
class LoweringPlan:
    graph_kind: str
    collectives: list[PlannedCollective] = field(default_factory=list)
    node_streams: dict[str, int] = field(default_factory=dict)  # compute nodes off the default stream
    events: list[StreamEdge] = field(default_factory=list)
    keep_alive: dict[str, list[int]] = field(default_factory=dict)  # value -> streams besides its producer's
    notes: list[str] = field(default_factory=list)

    @property
    def num_streams(self) -> int:
        return 1 + max(self.node_streams.values(), default=0)

    def collective_at(self, start_name: str) -> Optional[PlannedCollective]:
        for c in self.collectives:
            if c.start == start_name:
                return c
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "graph_kind": self.graph_kind,
            "collectives": [asdict(c) for c in self.collectives],
            "node_streams": dict(self.node_streams),
            "events": [asdict(e) for e in self.events],
            "keep_alive": {k: list(v) for k, v in self.keep_alive.items()},
            "notes": list(self.notes),
        }

    def describe(self) -> str:
        """Human-readable plan, one line per collective (what the dumps show)."""
        lines = [
            f"lowering plan ({self.graph_kind}): {len(self.collectives)} collectives, "
            f"{self.num_streams} compute stream(s), {len(self.events)} cross-stream event(s)"
        ]
        for c in self.collectives:
            via = "" if c.issue_group == c.group else f" via {c.issue_group}"
            lines.append(
                f"  #{c.index} {c.kind} {c.start} on {c.group}{via}, "
                f"{c.logged_bytes if c.logged_bytes is not None else '?'} B, waited by {', '.join(c.waits)}"
            )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def stream_of(node: fx.Node) -> int:
    """The compute stream a pass assigned to `node` (0: default). Collectives and waits: 0."""
    if node.op != "call_function" or collective_spec(node.target) is not None or is_wait(node.target):
        return 0
    return stream_hint(node)


def _concrete(x: Any) -> Optional[int]:
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


def build_plan(
    gm: fx.GraphModule,
    graph_kind: str = "graph",
    *,
    group_available=None,
    group_roles: Optional[dict[str, str]] = None,
) -> LoweringPlan:
    """The plan for `gm` as it stands (its node order is the issue order).
    ``group_roles``: group name -> role as the pipeline was given them (else inferred; names only).

    ``group_available(name) -> bool`` says whether a Lagom pool alias is registered in
    this process (default: never; the graph's own group is used). It only affects
    ``issue_group``; a missing alias is noted, never an error."""
    plan = LoweringPlan(graph_kind)
    ir = CollectiveIR(gm, IRBuildOptions(group_roles=group_roles or {}))
    for i, c in enumerate(sorted(ir.collectives, key=lambda c: c.index)):
        setting = c.start.meta.get(SETTING_META)
        issue_group = c.group.name
        alias = setting.get("pool_group_alias") if isinstance(setting, dict) else None
        if alias:
            if group_available is not None and group_available(alias):
                issue_group = alias
            else:
                plan.notes.append(
                    f"{c.start.name}: communicator-pool group {alias!r} is not set up in this "
                    f"process (commfuse.setup(communicator_ctas=...)); issued on {c.group.name}"
                )
        plan.collectives.append(
            PlannedCollective(
                index=i,
                start=c.start.name,
                waits=tuple(w.name for w in c.waits),
                kind=c.kind.value,
                group=c.group.name,
                issue_group=issue_group,
                logged_bytes=_concrete(c.logged_bytes),
                setting=dict(setting) if isinstance(setting, dict) else None,
                role=None if c.role is ParallelRole.UNKNOWN else c.role.value,
            )
        )
    _plan_streams(gm, plan)
    return plan


def _plan_streams(gm: fx.GraphModule, plan: LoweringPlan) -> None:
    streams = {n: stream_of(n) for n in gm.graph.nodes}
    plan.node_streams = {n.name: s for n, s in streams.items() if s}
    if not plan.node_streams:
        return
    _plan_barriers(gm, streams, plan)
    seen: set[tuple[str, int]] = set()
    for n in gm.graph.nodes:
        for p in n.all_input_nodes:
            src, dst = streams[p], streams[n]
            if src == dst:
                continue
            if p.op != "placeholder" and (p.name, dst) not in seen:
                # One event per (producer, consumer stream): later consumers on that stream
                # are ordered after the first by the stream itself.
                seen.add((p.name, dst))
                plan.events.append(StreamEdge(p.name, n.name, src, dst))
            plan.keep_alive.setdefault(p.name, [])
            if dst not in plan.keep_alive[p.name]:
                plan.keep_alive[p.name].append(dst)


def _plan_barriers(gm: fx.GraphModule, streams: dict[fx.Node, int], plan: LoweringPlan) -> None:
    """Events that make every barrier interval wait for all streams' work of the previous one."""
    intervals: list[dict[int, list[fx.Node]]] = []  # per interval: stream -> its nodes, in order
    label: Any = None
    for n in gm.graph.nodes:
        b = n.meta.get(BARRIER_META)
        if b is None or n.op != "call_function":
            continue
        if not intervals or b != label:
            intervals.append({})
            label = b
        intervals[-1].setdefault(streams[n], []).append(n)
    for prev, nxt in zip(intervals, intervals[1:], strict=False):
        for src, done in sorted(prev.items()):
            for dst, todo in sorted(nxt.items()):
                if src != dst:  # one stream is ordered by itself
                    plan.events.append(StreamEdge(done[-1].name, todo[0].name, src, dst))
