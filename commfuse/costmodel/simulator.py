"""Timeline simulator: the single judge of a schedule.

Contract
    Input: an FX graph in its current node order (or any other topological
    order of its nodes, passed explicitly), a :class:`~commfuse.costmodel.estimator.CostEstimator`
    and a :class:`StreamAssignment`. Output: a :class:`SimResult` with the
    makespan, compute busy time, communication time, exposed and hidden
    communication, overlap ratio, peak memory, per-node start/end and a
    Chrome/Perfetto trace. Deterministic: same graph, order, estimator and
    assignment give the same result on every rank.

    Whenever two schedules are compared (commfuse's passes against each other,
    against the unscheduled graph, or against Inductor's FX-level overlap
    scheduler's output) they are compared with :func:`compare_schedules` under
    ONE estimator: never with two different cost models.

Execution model (what every GPU runtime of functional collectives does)
    * One compute stream runs every non-collective node in graph order; its
      duration is ``estimator.compute_time_us(node)`` (placeholders, outputs
      and get_attr are free).
    * A collective start node is *issued* on the compute stream at its
      position (instantly: launch costs belong to the collective estimate) and
      runs on the communication stream of its process group. Collectives are
      therefore issued in the graph's one total order; a collective starts at
      ``max(issue time, end of the previous collective on its stream)``: the
      collectives of one group serialise, different groups overlap.
      ``StreamAssignment.group_streams`` can put several groups on one stream
      (then they serialise too), ``single_comm_stream`` puts all on one.
    * ``wait_tensor`` blocks the compute stream until its collective ends; the
      blocked time is *exposed* communication. A *synchronous* collective (issues
      and waits inside the op, no wait node: the autograd variants of commfuse's
      boundary ops) blocks the compute stream right after it is issued. Communication still running when
      the compute stream reaches the output is exposed too (the step cannot end).
    * Optional contention: ``slowdown(node, concurrent_collectives) -> factor``
      (>= 1) stretches compute while collectives are in flight, piecewise over
      the intervals where the set of in-flight collectives is constant
      (Lagom-style, see ``costmodel/contention.py``). Communication is not
      slowed by compute.

    Metrics
        * ``makespan_us``: end of the last stream;
        * ``compute_us``: compute stream busy time (stretched by contention);
        * ``comm_us``: sum of collective durations (all streams);
        * ``exposed_comm_us``: compute-stream time blocked in waits + comm tail;
        * ``hidden_comm_us``: per collective, the part of its interval during
          which the compute stream is busy, summed; ``overlap_ratio`` =
          hidden / comm (1.0 when there is no communication);
        * ``peak_memory_bytes``: live-tensor accounting in graph order from
          ``meta['val']``: a node's output is allocated when it runs (a
          collective's output when it is issued) and freed after its last user;
          views, in-place ops, ``_unsafe_view``, ``getitem`` and ``wait_tensor``
          alias their source (extending its life) and allocate nothing; graph inputs
          (placeholders) count from the start, and are freed after their last
          user unless ``inputs_persist``; graph outputs stay live. Multi-output
          nodes allocate the sum of their tensors as one block. A node's bytes
          are the estimator's ``value_bytes(node)`` where it has one (the cost
          policy's models: 0 for a size that varies across data-parallel ranks,
          ``passmgr/invariance.py``), else its value's bytes with symbols at
          rank-invariant hints (``symbol_hints.hinted_shape``).

Incremental re-estimation
    :class:`Simulator` estimates every node once and caches the costs (per
    node object). :meth:`Simulator.simulate` only re-runs the timeline sweep, so
    after a local change (moving a wait, reordering nodes) re-simulating costs
    one O(nodes) pass; pass ``order=`` to evaluate a candidate order without
    touching the graph. After nodes were added or their arguments changed, call
    :meth:`Simulator.update` with them (new nodes are also estimated lazily);
    the collective IR is rebuilt only when a collective start changed.

Sources
    "Centauri: Enabling Efficient Scheduling for Communication-Computation Overlap in
    Large Model Training via Communication Partitioning" (Chen et al., ASPLOS '24), §5.4
    (the overlap speedup bound min(1/α, 1/(1-α))); Inductor's
    ``estimate_peak_memory`` and ``comms.sink_waits`` for the memory and
    stream conventions; Chrome trace event format (``ph: "X"``, ``"M"``).
"""

from __future__ import annotations

import bisect
import json
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, cast

import torch
import torch.fx as fx

from commfuse.costmodel.estimator import CollectiveEstimate, CostEstimator
from commfuse.costmodel.symbol_hints import hinted_shape
from commfuse.ir.collective import Collective
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.ir.kinds import collective_spec, is_wait

__all__ = [
    "CollectiveTiming",
    "ScheduleComparison",
    "SimResult",
    "Simulator",
    "SlowdownFn",
    "StreamAssignment",
    "compare_schedules",
    "simulate",
]

SlowdownFn = Callable[[fx.Node, Sequence[Collective]], float]

# node codes
_FREE, _COMPUTE, _COLL, _WAIT = 0, 1, 2, 3
_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default


@dataclass(frozen=True)
class StreamAssignment:
    """Which stream runs what. Default: one compute stream, one comm stream per process group."""

    compute_stream: str = "compute"
    group_streams: Mapping[str, str] = field(default_factory=dict)  # group name -> stream name
    single_comm_stream: bool = False

    def stream_of(self, group: str) -> str:
        if group in self.group_streams:
            return self.group_streams[group]
        return "comm" if self.single_comm_stream else f"comm:{group}"


@dataclass(frozen=True)
class CollectiveTiming:
    name: str
    kind: str
    group: str
    stream: str
    issue_us: float
    start_us: float
    end_us: float
    wire_bytes: Any
    algorithm: str
    hidden_us: float

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


@dataclass
class _NodeCost:
    code: int
    time_us: float = 0.0
    stream: int = -1  # comm stream index (collectives)
    start: Optional[fx.Node] = None  # waits: their collective's start node
    collective: Optional[Collective] = None
    estimate: Optional[CollectiveEstimate] = None
    alloc: int = 0  # bytes this node allocates (0 for aliases)
    alias_src: Optional[fx.Node] = None  # the node whose storage this one aliases
    sync: bool = False  # a synchronous collective: the compute stream waits for its end


@dataclass(frozen=True)
class NodeInfo:
    """Public read-only view of one node's cached cost (see :meth:`Simulator.node_info`)."""

    code: int  # NODE_FREE, NODE_COMPUTE, NODE_COLLECTIVE or NODE_WAIT
    time_us: float
    stream: int  # collectives: index into Simulator.streams; -1 otherwise
    start: Optional[fx.Node]  # waits: their collective's start node
    alloc: int  # bytes the node allocates (0 for aliases)
    alias_src: Optional[fx.Node]


NODE_FREE, NODE_COMPUTE, NODE_COLLECTIVE, NODE_WAIT = _FREE, _COMPUTE, _COLL, _WAIT


@dataclass
class SimResult:
    makespan_us: float
    compute_us: float
    comm_us: float
    exposed_comm_us: float
    hidden_comm_us: float
    overlap_ratio: float
    peak_memory_bytes: int
    peak_memory_node: Optional[str]
    streams: list[str]
    collectives: list[CollectiveTiming]
    # per node, in the simulated order: (name, stream, start, end)
    node_names: list[str] = field(default_factory=list, repr=False)
    node_streams: list[int] = field(default_factory=list, repr=False)
    node_starts: list[float] = field(default_factory=list, repr=False)
    node_ends: list[float] = field(default_factory=list, repr=False)
    node_codes: list[int] = field(default_factory=list, repr=False)

    @property
    def serial_us(self) -> float:
        """Compute + communication with no overlap at all (the serial baseline)."""
        return self.compute_us + self.comm_us

    def node_time(self, name: str) -> tuple[str, float, float]:
        """(stream, start, end) of one node (collective starts: their comm-stream interval)."""
        for c in self.collectives:
            if c.name == name:
                return c.stream, c.start_us, c.end_us
        i = self.node_names.index(name)
        return self.streams[self.node_streams[i]], self.node_starts[i], self.node_ends[i]

    @property
    def node_times(self) -> dict[str, tuple[str, float, float]]:
        out = {
            n: (self.streams[s], a, b)
            for n, s, a, b in zip(
                self.node_names, self.node_streams, self.node_starts, self.node_ends, strict=True
            )
        }
        for c in self.collectives:
            out[c.name] = (c.stream, c.start_us, c.end_us)
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "makespan_us": self.makespan_us,
            "compute_us": self.compute_us,
            "comm_us": self.comm_us,
            "exposed_comm_us": self.exposed_comm_us,
            "hidden_comm_us": self.hidden_comm_us,
            "overlap_ratio": self.overlap_ratio,
            "peak_memory_bytes": self.peak_memory_bytes,
        }

    def to_chrome_trace(self, *, include_free: bool = False) -> dict[str, Any]:
        """Chrome / Perfetto trace (``traceEvents``; ts/dur in µs), one track (tid) per stream.

        Compute nodes are ``X`` events on the compute track, blocked waits ``X``
        events named ``wait:<collective>`` (category ``exposed``), collectives
        ``X`` events on their stream's track with an issue instant on the
        compute track. Load with chrome://tracing or ui.perfetto.dev."""
        ev: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "commfuse simulator"}}
        ]
        for tid, s in enumerate(self.streams):
            ev.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": s}})
            ev.append(
                {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid, "args": {"sort_index": tid}}
            )
        for name, code, st, a, b in zip(
            self.node_names, self.node_codes, self.node_streams, self.node_starts, self.node_ends, strict=True
        ):
            if code == _COMPUTE or (code == _FREE and include_free):
                ev.append(
                    {
                        "name": name,
                        "cat": "compute",
                        "ph": "X",
                        "pid": 0,
                        "tid": st,
                        "ts": float(a),
                        "dur": float(b - a),
                    }
                )
            elif code == _WAIT and b > a:
                ev.append(
                    {
                        "name": f"wait:{name}",
                        "cat": "exposed",
                        "ph": "X",
                        "pid": 0,
                        "tid": st,
                        "ts": float(a),
                        "dur": float(b - a),
                    }
                )
        sid = {s: i for i, s in enumerate(self.streams)}
        for c in self.collectives:
            ev.append(
                {
                    "name": c.name,
                    "cat": f"comm,{c.kind}",
                    "ph": "X",
                    "pid": 0,
                    "tid": sid[c.stream],
                    "ts": float(c.start_us),
                    "dur": float(c.end_us - c.start_us),
                    "args": {
                        "kind": c.kind,
                        "group": c.group,
                        "wire_bytes": str(c.wire_bytes),
                        "algorithm": c.algorithm,
                        "issue_us": float(c.issue_us),
                        "hidden_us": float(c.hidden_us),
                    },
                }
            )
            ev.append(
                {
                    "name": f"issue:{c.name}",
                    "cat": "issue",
                    "ph": "i",
                    "s": "t",
                    "pid": 0,
                    "tid": 0,
                    "ts": float(c.issue_us),
                }
            )
        return {
            "traceEvents": ev,
            "displayTimeUnit": "ms",
            "otherData": {k: float(v) for k, v in self.summary().items()},
        }

    def write_chrome_trace(self, path: str, **kw: Any) -> None:
        with open(path, "w") as f:
            json.dump(self.to_chrome_trace(**kw), f)


# --------------------------------------------------------------------------- memory helpers
def _val_bytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return math.prod(hinted_shape(val.shape)) * val.dtype.itemsize
    if isinstance(val, (list, tuple)):
        return sum(_val_bytes(v) for v in val)
    return 0


# public name: bytes of a meta['val'] (tensors, lists); symbols take the rank-invariant flat hints
# (symbol_hints.hinted_shape), never a SymInt's example value
tensor_bytes = _val_bytes


def _alias_source(node: fx.Node) -> Optional[fx.Node]:
    """The input whose storage `node`'s output shares (views, in-place ops, getitem, waits)."""
    if node.op != "call_function":
        return None
    t = node.target
    if t is operator.getitem:
        a = node.args[0]
        return a if isinstance(a, fx.Node) else None
    if is_wait(t) or t is _UNSAFE_VIEW:  # _unsafe_view reinterprets its (fresh) input, no copy
        a = node.args[0]
        return a if isinstance(a, fx.Node) else None
    schema = getattr(t, "_schema", None)
    if schema is None or not schema.returns:
        return None
    ret = schema.returns[0].alias_info
    if ret is None:
        return None
    for arg, a in zip(schema.arguments, node.args, strict=False):  # args may omit trailing defaults
        if (
            isinstance(a, fx.Node)
            and arg.alias_info is not None
            and set(arg.alias_info.before_set) & set(ret.before_set)
        ):
            return a
    for a in node.args:  # alias of something we cannot pin down: the first tensor input
        if isinstance(a, fx.Node):
            return a
    return None


# --------------------------------------------------------------------------- simulator
class Simulator:
    """Cached per-node costs of one graph + a fast timeline sweep (see the module docstring)."""

    def __init__(
        self,
        gm: fx.GraphModule,
        estimator: CostEstimator,
        streams: StreamAssignment | None = None,
        *,
        slowdown: SlowdownFn | None = None,
        inputs_persist: bool = False,
        ir: CollectiveIR | None = None,
    ) -> None:
        self.gm = gm
        self.estimator = estimator
        self.assignment = streams or StreamAssignment()
        self.slowdown = slowdown
        self.inputs_persist = inputs_persist
        self.streams: list[str] = [self.assignment.compute_stream]
        self._stream_index: dict[str, int] = {self.assignment.compute_stream: 0}
        self._ir = ir if ir is not None else CollectiveIR(gm)
        self._coll_of: dict[fx.Node, Collective] = {}
        self._wait_of: dict[fx.Node, fx.Node] = {}
        self._index_collectives()
        self._table: dict[fx.Node, _NodeCost] = {}
        for n in gm.graph.nodes:
            self._table[n] = self._estimate(n)

    # -- cost table -----------------------------------------------------------
    def _index_collectives(self) -> None:
        self._coll_of = {c.start: c for c in self._ir.collectives}
        self._wait_of = {w: c.start for c in self._ir.collectives for w in c.waits}

    def _stream(self, name: str) -> int:
        i = self._stream_index.get(name)
        if i is None:
            i = self._stream_index[name] = len(self.streams)
            self.streams.append(name)
        return i

    def _estimate(self, n: fx.Node) -> _NodeCost:
        alias = _alias_source(n)
        alloc = 0 if alias is not None else self.value_bytes(n)
        if n.op in ("placeholder", "output", "get_attr"):
            return _NodeCost(_FREE, alloc=alloc if n.op != "output" else 0, alias_src=alias)
        c = self._coll_of.get(n)
        if c is not None:
            est = self.estimator.collective(c)
            return _NodeCost(
                _COLL,
                est.time_us,
                self._stream(self.assignment.stream_of(c.group.name)),
                collective=c,
                estimate=est,
                alloc=alloc,
                alias_src=alias,
                sync=c.synchronous,
            )
        start = self._wait_of.get(n)
        if start is not None:
            return _NodeCost(_WAIT, start=start, alloc=alloc, alias_src=alias)
        t = self.estimator.compute_time_us(n)
        return _NodeCost(_COMPUTE if t > 0 else _FREE, t if t > 0 else 0, alloc=alloc, alias_src=alias)

    def update(self, changed_nodes: Iterable[fx.Node] = ()) -> None:
        """Re-estimate `changed_nodes` (new nodes, or nodes whose target/args changed).

        Nodes no longer in the graph are dropped. Moving nodes needs no update.
        A changed or new collective start rebuilds the collective IR (cheap) and
        re-estimates only the changed collectives and their waits."""
        changed = list(changed_nodes)
        live = set(self.gm.graph.nodes)
        for n in [n for n in self._table if n not in live]:
            del self._table[n]

        def is_comm(n: fx.Node) -> bool:
            return n.op == "call_function" and (collective_spec(n.target) is not None or is_wait(n.target))

        stale = any(is_comm(n) for n in changed) or any(
            n.op == "call_function" and collective_spec(n.target) is not None and n not in self._coll_of
            for n in live
        )
        if stale:
            self._ir = CollectiveIR(self.gm)
            self._index_collectives()
            for c in self._ir.collectives:  # keep the cached estimates, re-point to fresh records
                e = self._table.get(c.start)
                if e is not None and e.collective is not None:
                    e.collective = c
        for n in changed:
            if n in live:
                self._table[n] = self._estimate(n)

    def value_bytes(self, node: fx.Node) -> int:
        """Bytes of ``node``'s value as the estimator sizes them (its ``value_bytes`` where it has
        one), else with symbols at rank-invariant hints."""
        sized = getattr(self.estimator, "value_bytes", None)
        return int(sized(node)) if sized is not None else _val_bytes(node.meta.get("val"))

    def cost_of(self, node: fx.Node) -> float:
        """Cached time of one node (collective: its duration on its stream)."""
        e = self._lookup(node)
        return e.time_us

    def node_info(self, node: fx.Node) -> NodeInfo:
        """What the sweep knows about one node, for schedulers that build their own order:
        its class, time, comm stream, the collective a wait waits on, and its memory
        accounting (bytes allocated, the node whose storage it aliases)."""
        e = self._lookup(node)
        return NodeInfo(e.code, e.time_us, e.stream, e.start, e.alloc, e.alias_src)

    def _lookup(self, n: fx.Node) -> _NodeCost:
        e = self._table.get(n)
        if e is None:
            if n.op == "call_function" and (
                (collective_spec(n.target) is not None and n not in self._coll_of)
                or (is_wait(n.target) and n not in self._wait_of)
            ):
                self.update([n])
                return self._table[n]
            e = self._table[n] = self._estimate(n)
        return e

    # -- sweep ----------------------------------------------------------------
    def simulate(
        self, order: Sequence[fx.Node] | None = None, *, memory: bool = True, record: bool = True
    ) -> SimResult:
        """Run the timeline over `order` (default: the graph's current order).

        ``memory=False`` skips the peak-memory accounting and ``record=False``
        the per-node timeline (both faster, for search loops)."""
        nodes = list(self.gm.graph.nodes) if order is None else list(order)
        table = self._table
        lookup = self._lookup
        nstreams = len(self.streams)
        stream_free: list[Any] = [0] * nstreams
        coll_end: dict[fx.Node, float] = {}
        coll_rec: list[tuple[fx.Node, float, float, float]] = []  # start node, issue, start, end
        busy_starts: list[float] = []
        busy_ends: list[float] = []
        slowdown = self.slowdown
        active: list[tuple[float, float, Collective]] = []
        # Times stay in the estimator's number type (float, or Fraction for exact checks).
        t: Any = 0
        compute: Any = 0
        exposed: Any = 0
        names: list[str] = []
        sts: list[int] = []
        starts: list[float] = []
        ends: list[float] = []
        codes: list[int] = []
        for n in nodes:
            e = table.get(n)
            if e is None:
                e = lookup(n)
                if len(self.streams) > nstreams:
                    stream_free.extend([0] * (len(self.streams) - nstreams))
                    nstreams = len(self.streams)
            code = e.code
            t0 = t
            if code == _COMPUTE:
                d = e.time_us
                if slowdown is not None and active:
                    active = [a for a in active if a[1] > t]
                    if active:
                        d = self._stretch(n, t, d, active)
                t += d
                compute += d
                if busy_ends and busy_ends[-1] == t0:
                    busy_ends[-1] = t
                else:
                    busy_starts.append(t0)
                    busy_ends.append(t)
            elif code == _COLL:
                si = e.stream
                s = stream_free[si]
                if s < t:
                    s = t
                end = s + e.time_us
                stream_free[si] = end
                coll_end[n] = end
                coll_rec.append((n, t, s, end))
                if slowdown is not None:
                    active.append((s, end, e.collective))  # type: ignore[arg-type]
                if e.sync and end > t:  # issues and waits inside (no wait node): blocks compute
                    exposed += end - t
                    t = end
            elif code == _WAIT:
                start = cast(fx.Node, e.start)  # a wait's entry names its collective's start
                end = coll_end.get(start)
                if end is None:
                    if start in table and start not in nodes:
                        raise ValueError(f"{n.name} waits on {start.name}, which is not in the order")
                    raise ValueError(f"{n.name} waits on {start.name}, which is issued after it")
                if end > t:
                    exposed += end - t
                    t = end
            if record:
                names.append(n.name)
                sts.append(0)
                starts.append(t0)
                ends.append(t)
                codes.append(code)
        comm_end = max(stream_free) if stream_free else 0
        makespan = max(t, comm_end)
        exposed += makespan - t
        # hidden communication: overlap of each collective with the compute busy intervals
        prefix: list[Any] = [0]
        for a, b in zip(busy_starts, busy_ends, strict=True):
            prefix.append(prefix[-1] + (b - a))

        def covered(x: Any) -> Any:
            j = bisect.bisect_right(busy_starts, x) - 1
            if j < 0:
                return 0
            return prefix[j] + min(x, busy_ends[j]) - busy_starts[j]

        comm: Any = 0
        hidden: Any = 0
        timings: list[CollectiveTiming] = []
        for node, issue, s, end in coll_rec:
            e = table[node]
            h = covered(end) - covered(s)
            if h < 0:  # float rounding of the prefix sums
                h = 0
            elif h > end - s:
                h = end - s
            comm += end - s
            hidden += h
            c = e.collective
            assert c is not None and e.estimate is not None
            timings.append(
                CollectiveTiming(
                    node.name,
                    c.kind.value,
                    c.group.name,
                    self.streams[e.stream],
                    issue,
                    s,
                    end,
                    e.estimate.wire_bytes,
                    e.estimate.algorithm,
                    h,
                )
            )
        peak, peak_node = self._peak_memory(nodes) if memory else (0, None)
        return SimResult(
            makespan_us=makespan,
            compute_us=compute,
            comm_us=comm,
            exposed_comm_us=exposed,
            hidden_comm_us=hidden,
            overlap_ratio=(hidden / comm) if comm > 0 else 1,
            peak_memory_bytes=peak,
            peak_memory_node=peak_node,
            streams=list(self.streams),
            collectives=timings,
            node_names=names,
            node_streams=sts,
            node_starts=starts,
            node_ends=ends,
            node_codes=codes,
        )

    def _stretch(
        self, node: fx.Node, t: float, work: float, active: list[tuple[float, float, Collective]]
    ) -> float:
        """Wall time of `work` µs of compute starting at `t` under the contention hook."""
        assert self.slowdown is not None
        cur, remaining = t, work
        while remaining > 0:
            conc = [c for s, e, c in active if s <= cur < e]
            bounds = [x for s, e, _ in active for x in (s, e) if x > cur]
            nxt = min(bounds) if bounds else math.inf
            f = self.slowdown(node, conc) if conc else 1
            if f <= 0:
                raise ValueError(f"slowdown factor must be positive, got {f} for {node.name}")
            if remaining * f <= nxt - cur:
                cur += remaining * f
                remaining = 0
            else:
                remaining -= (nxt - cur) / f
                cur = nxt
        return cur - t

    def _peak_memory(self, nodes: Sequence[fx.Node]) -> tuple[int, Optional[str]]:
        table = self._table
        never = len(nodes) + 1
        owner, last = buffer_lifetimes(nodes, lambda n: table[n].alias_src, never)
        if self.inputs_persist:
            for n in nodes:
                if n.op == "placeholder":
                    last[owner[n]] = never
        frees: dict[int, int] = {}
        for o, i in last.items():
            if i != never and o in table:
                frees[i] = frees.get(i, 0) + table[o].alloc
        live = peak = 0
        peak_node: Optional[str] = None
        for i, n in enumerate(nodes):
            a = table[n].alloc
            if a and owner[n] is n:
                live += a
                if live > peak:
                    peak, peak_node = live, n.name
            live -= frees.get(i, 0)
        return peak, peak_node


def buffer_lifetimes(
    nodes: Sequence[fx.Node], alias_of: Callable[[fx.Node], Optional[fx.Node]], never: int
) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, int]]:
    """Who owns each node's storage and when that storage is last used, for ``nodes`` in order.

    ``owner[n]``: the node whose buffer ``n`` uses (views, waits, getitem alias their source,
    ``alias_of``); ``last[o]``: the index of the last node that uses owner ``o``'s buffer, or
    ``never`` for buffers the graph output keeps. The simulator's peak memory and the
    bucketing pass's memory profile both count live bytes from these."""
    owner: dict[fx.Node, fx.Node] = {}
    last: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        src = alias_of(n)
        o = owner.get(src, src) if src is not None else n
        owner[n] = o
        last[o] = i
        if n.op == "output":
            for a in n.all_input_nodes:
                last[owner.get(a, a)] = never
            continue
        for a in n.all_input_nodes:
            oa = owner.get(a, a)
            if last.get(oa, -1) != never:
                last[oa] = i
    return owner, last


alias_source = _alias_source  # public name: the node whose storage a view / wait / getitem aliases


def simulate(
    gm: fx.GraphModule, estimator: CostEstimator, streams: StreamAssignment | None = None, **kw: Any
) -> SimResult:
    """One-shot :class:`Simulator` run over the graph's current order."""
    return Simulator(gm, estimator, streams, **kw).simulate()


# --------------------------------------------------------------------------- comparison
@dataclass
class ScheduleComparison:
    """Metrics of several schedules under one estimator; ``table()`` prints them side by side."""

    names: list[str]
    results: dict[str, SimResult]
    collective_counts: dict[str, int]

    METRICS = (
        "makespan_us",
        "compute_us",
        "comm_us",
        "exposed_comm_us",
        "hidden_comm_us",
        "overlap_ratio",
        "peak_memory_bytes",
    )

    @property
    def rows(self) -> list[tuple[str, list[float]]]:
        return [(m, [getattr(self.results[n], m) for n in self.names]) for m in self.METRICS]

    @property
    def best(self) -> str:
        """The schedule with the smallest makespan (first one on ties)."""
        return min(self.names, key=lambda n: (self.results[n].makespan_us, self.names.index(n)))

    def speedup(self, name: str, baseline: str | None = None) -> float:
        base = self.results[baseline or self.names[0]].makespan_us
        mine = self.results[name].makespan_us
        return base / mine if mine > 0 else math.inf

    def table(self) -> str:
        w = max(12, *(len(n) + 2 for n in self.names))
        lines = [f"{'metric':<18}" + "".join(f"{n:>{w}}" for n in self.names)]
        for m, vals in self.rows:
            spec = ".3f" if m == "overlap_ratio" else ",.1f"
            lines.append(f"{m:<18}" + "".join(f"{float(v):>{w}{spec}}" for v in vals))
        lines.append(f"{'speedup':<18}" + "".join(f"{float(self.speedup(n)):>{w}.3f}" for n in self.names))
        lines.append(
            f"{'collectives':<18}" + "".join(f"{self.collective_counts[n]:>{w}}" for n in self.names)
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def compare_schedules(
    gm_a: fx.GraphModule | Mapping[str, fx.GraphModule],
    gm_b: fx.GraphModule | None = None,
    estimator: CostEstimator | None = None,
    *,
    names: Sequence[str] = ("a", "b"),
    streams: StreamAssignment | None = None,
    slowdown: SlowdownFn | None = None,
) -> ScheduleComparison:
    """Simulate two schedules (or a ``{name: graph}`` mapping of any number) under ONE estimator.

    The graphs may be different rewrites of one program (commfuse's passes,
    Inductor's ``schedule_overlap_bucketing`` output, the unscheduled graph);
    the collective counts are reported so a comparison of programs that
    communicate differently is visible as such."""
    if estimator is None:
        raise TypeError("compare_schedules needs an estimator: the one judge of both schedules")
    if isinstance(gm_a, Mapping):
        graphs = dict(gm_a)
    else:
        if gm_b is None:
            raise TypeError("compare_schedules needs two graphs (or a mapping)")
        if len(names) != 2 or names[0] == names[1]:
            raise ValueError(f"need two distinct names, got {names!r}")
        graphs = {names[0]: gm_a, names[1]: gm_b}
    results: dict[str, SimResult] = {}
    counts: dict[str, int] = {}
    for name, gm in graphs.items():
        sim = Simulator(gm, estimator, streams, slowdown=slowdown)
        results[name] = sim.simulate()
        counts[name] = len(sim._ir.collectives)
    return ScheduleComparison(list(graphs), results, counts)
