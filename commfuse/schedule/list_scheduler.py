"""The scheduling problem of one graph and the greedy list scheduler of ``schedule_overlap``.

``ScheduleProblem`` turns a graph into what any order must respect:

* data edges (every node after its inputs);
* the collective chain: collectives keep their relative issue order, across all process
  groups (the one total order; see ``schedule_overlap``'s contract for why);
* random ops (RNG consumers) keep their relative order, so they draw the same numbers;
* barriers: a node that mutates memory (``copy_``, in-place ops, input mutations), an
  in-place collective or its wait, and ops called for a side effect stay where they are
  relative to every other node: the graph is cut into segments at them, and nodes never
  leave their segment.

``list_schedule`` walks the segments in order and, inside one, simulates the machine the
way ``costmodel.simulator`` does (one compute stream, one stream per process group) while
it builds the order:

1. the next collective of the chain is issued as soon as its inputs are scheduled, unless the
   bytes already in flight on its stream would exceed the in-flight limit or the live memory
   plus its output would exceed the memory budget (then it waits for compute to make room,
   and is issued anyway when nothing else can run);
2. otherwise one compute node is scheduled: by default the one with the lowest original
   index among those that would not block on an unfinished collective, preferring those
   the next collective needs (``Priority``);
3. waits are never scheduled on their own: a wait is placed right before the first node that
   needs its result, or at the end of its segment.

With ``Priority.memory_aware`` the compute pick repairs the order as it builds it instead of
leaving the budget to the final simulation: a ready node is deferred when the live memory plus
its output would pass the budget, or, for a node moved ahead of the first unscheduled node of
the input order, when the input order's live memory over the stretch it is moved across plus
the buffers already moved ahead (compute and collectives, while still live) plus its output
would. Among ready nodes that are all deferred, the one that grows the live memory least (frees
the most: last readers of large buffers) runs, ties by position.

Everything is keyed by original node index, so the order is a deterministic function of the
graph, the estimator and the limits.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.fx as fx

from commfuse.costmodel.simulator import NODE_COLLECTIVE, NODE_COMPUTE, NODE_WAIT, Simulator
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.ir.kinds import collective_spec, is_wait
from commfuse.ir.rewrite import mutates

# How many ready nodes the picker looks at to find one that does not block on a collective:
# a bounded window keeps a pick O(log n) on deep graphs.
STALL_WINDOW = 16


@dataclass(frozen=True)
class Priority:
    """Knobs of the compute picker (the pass tries several and keeps the best by simulation)."""

    feed_next_collective: bool = True  # prefer compute the next collective's inputs need
    avoid_stalls: bool = True  # prefer compute that does not block on an unfinished collective
    # Defer compute that would take the live memory past the budget (now, or over the stretch of the
    # input order it is moved across) and prefer ready nodes that free memory (see ``list_schedule``).
    memory_aware: bool = False

    def describe(self) -> str:
        knobs = f"feed={int(self.feed_next_collective)},avoid_stalls={int(self.avoid_stalls)}"
        if not self.memory_aware:
            return knobs
        return (
            "memory-repaired"
            if self.feed_next_collective and self.avoid_stalls
            else f"memory-repaired({knobs})"
        )


@dataclass
class ScheduleProblem:
    """A graph's nodes, dependencies, barriers and costs (indices are original positions)."""

    nodes: list[fx.Node]
    preds: list[list[int]]
    succs: list[list[int]]
    code: list[int]  # simulator node class (NODE_* of costmodel.simulator)
    time: list[float]
    stream: list[int]
    wait_of: dict[int, int]  # wait index -> its collective's start index
    segment: list[int]  # segment id per node (-1: head/tail, fixed)
    segments: list[list[int]]  # node indices per segment, original order; barriers are alone
    barrier_segments: set[int]
    head: list[int]  # placeholders / get_attr: first, in original order
    tail: list[int]  # the output node
    collectives: list[int]  # collective starts in chain (original) order
    coll_bytes: dict[int, int]  # in-flight bytes per collective start
    alloc: list[int]
    owner: list[int]  # alias root per node (memory accounting, as the simulator does it)
    touches: list[list[int]] = field(default_factory=list)  # per node: owners whose life it extends
    n_streams: int = 1
    # Preference among ready compute: position in a baseline order (default: the input order;
    # the layer level supplies its own). ``at_key`` inverts it.
    key: list[int] = field(default_factory=list)
    at_key: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.key:
            self.key = list(range(len(self.nodes)))
        self.at_key = [0] * len(self.key)
        for i, k in enumerate(self.key):
            self.at_key[k] = i

    @property
    def size(self) -> int:
        return len(self.nodes)

    def placeable(self) -> int:
        """Nodes an order can move (not the head/tail)."""
        return sum(len(s) for s in self.segments)


def _is_barrier(n: fx.Node, inplace: set[fx.Node]) -> bool:
    if n in inplace:
        return True
    if n.op != "call_function":
        return False
    if collective_spec(n.target) is not None or is_wait(n.target):
        return False
    if mutates(n):
        return True
    if isinstance(n.target, torch._ops.OpOverload) and not n.target._schema.returns:
        return True  # called for its side effect (asserts, prints)
    return n.is_impure() and n.target is not operator.getitem


def _draws_random(n: fx.Node) -> bool:
    """Whether ``n`` consumes the global RNG (its order among such ops fixes the values drawn)."""
    t = n.target
    if (
        n.op != "call_function"
        or not isinstance(t, torch._ops.OpOverload)
        or torch.Tag.nondeterministic_seeded not in t.tags
    ):
        return False
    # attention with dropout_p == 0 carries the tag but draws nothing
    for i, a in enumerate(t._schema.arguments):
        if a.name == "dropout_p":
            v = n.args[i] if i < len(n.args) else n.kwargs.get("dropout_p", a.default_value)
            return not (isinstance(v, (int, float)) and v == 0)
    return True


def build_problem(
    gm: fx.GraphModule,
    sim: Simulator,
    ir: CollectiveIR,
    *,
    chain: Optional[Sequence[int]] = None,
    baseline: Optional[Sequence[int]] = None,
) -> ScheduleProblem:
    """``chain``: the collectives' issue order as node indices (default: the input order; empty:
    no chain edges, for building a preferred order). ``baseline``: a topological order the
    compute picker prefers (default: the input order)."""
    nodes = list(gm.graph.nodes)
    idx = {n: i for i, n in enumerate(nodes)}
    inplace: set[fx.Node] = set()
    for c in ir.collectives:
        if c.inplace:
            inplace.add(c.start)
            inplace.update(c.waits)
    preds: list[list[int]] = [sorted({idx[a] for a in n.all_input_nodes}) for n in nodes]
    infos = [sim.node_info(n) for n in nodes]
    code = [i.code for i in infos]
    colls = sorted(idx[c.start] for c in ir.collectives) if chain is None else list(chain)
    for a, b in zip(colls, colls[1:], strict=False):  # the total issue order is kept
        preds[b].append(a)
    rand = [i for i, n in enumerate(nodes) if _draws_random(n)]
    for a, b in zip(rand, rand[1:], strict=False):  # random ops keep their order: the same numbers drawn
        preds[b].append(a)
    wait_of = {
        i: idx[infos[i].start]
        for i in range(len(nodes))
        if code[i] == NODE_WAIT and infos[i].start is not None
    }
    succs: list[list[int]] = [[] for _ in nodes]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
    head = [i for i, n in enumerate(nodes) if n.op in ("placeholder", "get_attr")]
    tail = [i for i, n in enumerate(nodes) if n.op == "output"]
    segment = [-1] * len(nodes)
    segments: list[list[int]] = [[]]
    barrier_segments: set[int] = set()
    for i, n in enumerate(nodes):
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        if _is_barrier(n, inplace):
            if segments[-1]:
                segments.append([])
            barrier_segments.add(len(segments) - 1)
            segments[-1].append(i)
            segments.append([])
        else:
            segments[-1].append(i)
    if not segments[-1]:
        segments.pop()
    for s, seg in enumerate(segments):
        for i in seg:
            segment[i] = s
    coll_bytes = {}
    for c in ir.collectives:
        i = idx[c.start]
        out = sim.value_bytes(c.start)  # as the estimator sizes them: what every rank shares
        ins = sum(sim.value_bytes(a) for a in c.inputs)
        coll_bytes[i] = max(out, ins)
    alloc = [i.alloc for i in infos]
    owner = list(range(len(nodes)))
    touches: list[list[int]] = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        src = infos[i].alias_src
        if src is not None and src in idx:
            owner[i] = owner[idx[src]]
        t = {owner[i]} | {owner[idx[a]] for a in n.all_input_nodes}
        touches[i] = sorted(t)
    key: list[int] = []
    if baseline is not None:
        key = [0] * len(nodes)
        for pos, i in enumerate(baseline):
            key[i] = pos
    return ScheduleProblem(
        nodes,
        preds,
        succs,
        code,
        [i.time_us for i in infos],
        [i.stream for i in infos],
        wait_of,
        segment,
        segments,
        barrier_segments,
        head,
        tail,
        colls,
        coll_bytes,
        alloc,
        owner,
        touches,
        n_streams=len(sim.streams),
        key=key,
    )


def keyed_topological_order(p: ScheduleProblem, key: Sequence[tuple]) -> list[int]:
    """Kahn's algorithm over ``p``'s edges, always taking the ready node with the smallest
    ``key`` (each key a tuple ending in the node index, so ties are deterministic)."""
    missing = [len(ps) for ps in p.preds]
    heap = [key[i] for i in range(p.size) if missing[i] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        i = heapq.heappop(heap)[-1]
        order.append(i)
        for u in p.succs[i]:
            missing[u] -= 1
            if missing[u] == 0:
                heapq.heappush(heap, key[u])
    return order


@dataclass
class ListResult:
    order: list[int]
    deferred_inflight: int = 0  # issues delayed by the in-flight limit (counted once per collective)
    deferred_memory: int = 0  # issues delayed by the memory budget
    forced: int = 0  # issues that went over a limit because nothing else could run


def list_schedule(
    p: ScheduleProblem,
    priority: Priority,
    *,
    max_inflight_bytes: Optional[int],
    memory_limit: Optional[float],
) -> ListResult:
    """Greedy list schedule of ``p`` (see the module docstring); returns node indices in order."""
    n = p.size
    scheduled = [False] * n
    avail = [False] * n  # scheduled, or a wait whose collective was issued (schedulable on demand)
    missing = [0] * n
    for i in range(n):
        missing[i] = len(p.preds[i])
    order: list[int] = []
    res = ListResult(order)
    key, at_key = p.key, p.at_key

    # machine state, as the simulator's sweep keeps it
    t = 0.0
    stream_free = [0.0] * max(p.n_streams, 1)
    coll_end: dict[int, float] = {}
    inflight = [0] * max(p.n_streams, 1)
    inflight_of: dict[int, int] = {}  # collective start -> bytes still counted (until its last wait)
    waits_left: dict[int, int] = {}
    for c in p.wait_of.values():
        waits_left[c] = waits_left.get(c, 0) + 1

    # memory: owners are freed when every node touching them is scheduled
    pending = [0] * n
    for i in range(n):
        for o in p.touches[i]:
            pending[o] += 1
    live = 0
    # The input order's live memory per node: a collective issued before its original position
    # keeps its buffer live over every node in between, on top of what the input order holds there.
    peak_ahead = _RangeMax(live_profile(p, range(n))) if memory_limit is not None else None
    raised: list[int] = []  # collectives issued (memory-aware: nodes placed) ahead of their original position
    seg_nodes: list[int] = []
    seg_ptr = 0

    cur_seg = -1
    ready: list[int] = []  # heap of ready non-wait, non-collective nodes of the current segment
    urgent: list[int] = []  # subset: ancestors of the next collective
    urgent_for = [-1] * n
    ready_coll: list[int] = []
    next_coll_pos = 0
    deferred: set[int] = set()

    def front() -> int:
        """The first unscheduled node of the segment in the input order (where the input order is)."""
        nonlocal seg_ptr
        while seg_ptr < len(seg_nodes) and scheduled[seg_nodes[seg_ptr]]:
            seg_ptr += 1
        return seg_nodes[seg_ptr] if seg_ptr < len(seg_nodes) else n

    def held(now: int) -> int:
        """Bytes moved ahead of ``now`` that the input order's profile does not count there."""
        if priority.memory_aware:  # a moved node's buffer freed early is no longer held
            raised[:] = [r for r in raised if r > now and pending[r] > 0]
        return sum(p.alloc[r] for r in raised if r > now)

    def growth(x: int) -> int:
        """Live bytes after ``x`` minus before: its output, less the buffers it reads last."""
        g = p.alloc[x] if p.owner[x] == x else 0
        return g - sum(p.alloc[o] for o in p.touches[x] if pending[o] == 1)

    def over_memory(x: int, now: int, ahead: int) -> bool:
        """Whether ``x`` would pass the budget, with ``ahead`` = ``held(now)``."""
        if memory_limit is None:
            return False
        grow = p.alloc[x] if p.owner[x] == x else 0
        if live + grow > memory_limit:
            return True
        assert peak_ahead is not None
        return grow > 0 and x > now and peak_ahead.query(now, x) + ahead + grow > memory_limit

    def wait_stall(i: int) -> float:
        s = 0.0
        for q in p.preds[i]:
            if not scheduled[q] and q in p.wait_of:
                end = coll_end.get(p.wait_of[q], 0.0)
                if end - t > s:
                    s = end - t
        return s

    def make_avail(i: int) -> None:
        stack = [i]
        while stack:
            x = stack.pop()
            if avail[x]:
                continue
            avail[x] = True
            for u in p.succs[x]:
                missing[u] -= 1
                if missing[u] == 0:
                    if u in p.wait_of:
                        stack.append(u)
                    elif p.segment[u] == cur_seg:
                        enqueue(u)

    def enqueue(u: int) -> None:
        if p.code[u] == NODE_COLLECTIVE:
            ready_coll.append(u)
        else:
            heapq.heappush(ready, key[u])
            if urgent_for[u] == next_coll_pos:
                heapq.heappush(urgent, key[u])

    def place(i: int) -> None:
        nonlocal t, live
        # lazily placed waits first (just before their first user)
        for q in p.preds[i]:
            if not scheduled[q] and q in p.wait_of:
                place(q)
        scheduled[i] = True
        order.append(i)
        c = p.code[i]
        if c == NODE_COMPUTE:
            t += p.time[i]
        elif c == NODE_COLLECTIVE:
            s = p.stream[i]
            st = max(stream_free[s], t)
            stream_free[s] = coll_end[i] = st + p.time[i]
            b = p.coll_bytes.get(i, 0)
            inflight[s] += b  # a collective never waited stays in flight to the end
            inflight_of[i] = b
        elif c == NODE_WAIT:
            start = p.wait_of[i]
            t = max(t, coll_end.get(start, t))
            waits_left[start] -= 1
            if waits_left[start] == 0 and start in inflight_of:
                inflight[p.stream[start]] -= inflight_of.pop(start)
        if p.owner[i] == i and p.alloc[i]:
            live += p.alloc[i]
        for o in p.touches[i]:
            pending[o] -= 1
            if pending[o] == 0:
                live -= p.alloc[o]
        if i not in p.wait_of:
            make_avail(i)

    def mark_urgent(ci: int) -> None:
        """Tag the unscheduled ancestors of collective ``ci`` in this segment as urgent."""
        stack = [q for q in p.preds[ci] if not scheduled[q]]
        while stack:
            x = stack.pop()
            if scheduled[x] or urgent_for[x] == next_coll_pos or p.segment[x] != cur_seg:
                continue
            urgent_for[x] = next_coll_pos
            if missing[x] == 0 and x not in p.wait_of and p.code[x] != NODE_COLLECTIVE:
                heapq.heappush(urgent, key[x])
            stack.extend(q for q in p.preds[x] if not scheduled[q])

    def pick(heap: list[int]) -> tuple[Optional[int], int]:
        """First live entry by key; with avoid_stalls, the first of the window that does not block;
        memory-aware, the first that also stays within the budget. The second value ranks the pick:
        0 fine, 1 blocks on a collective, 2 over the memory budget (the least growing of the window)."""
        while heap and scheduled[at_key[heap[0]]]:
            heapq.heappop(heap)
        if not heap:
            return None, 0
        if not priority.avoid_stalls and not priority.memory_aware:
            return at_key[heap[0]], 0
        now = front() if priority.memory_aware else -1
        ahead = held(now) if priority.memory_aware and memory_limit is not None else 0
        seen: list[int] = []
        found, rank = None, 3
        while heap and len(seen) < STALL_WINDOW:
            k = heapq.heappop(heap)
            x = at_key[k]
            if scheduled[x] or k in seen:
                continue
            seen.append(k)
            r = (
                2
                if priority.memory_aware and over_memory(x, now, ahead)
                else int(priority.avoid_stalls and wait_stall(x) > 0)
            )
            if r < rank:
                found, rank = x, r
            if r == 0:
                break
        for k in seen:
            heapq.heappush(heap, k)
        if rank == 2:  # every node of the window over the budget: the one that frees most goes
            found = min((at_key[k] for k in seen), key=lambda x: (growth(x), key[x]))
        return found, rank if found is not None else 0

    def place_compute(x: int) -> None:
        if priority.memory_aware and x > front():
            raised.append(x)
        place(x)

    for i in p.head:
        place(i)
    for s, seg in enumerate(p.segments):
        cur_seg = s
        ready.clear()
        urgent.clear()
        ready_coll.clear()
        for i in seg:
            if missing[i] == 0 and i not in p.wait_of and not scheduled[i]:
                enqueue(i)
        if s in p.barrier_segments:
            for i in seg:
                place(i)
            continue
        seg_nodes, seg_ptr = seg, 0
        marked = -1
        while True:
            while next_coll_pos < len(p.collectives) and scheduled[p.collectives[next_coll_pos]]:
                next_coll_pos += 1
            nc = p.collectives[next_coll_pos] if next_coll_pos < len(p.collectives) else -1
            if priority.feed_next_collective and nc >= 0 and p.segment[nc] == s and marked != nc:
                marked = nc
                urgent.clear()
                mark_urgent(nc)
            ready_coll[:] = [c for c in ready_coll if not scheduled[c]]
            if ready_coll:
                c = ready_coll[0]
                now = min(front(), c)
                why = _blocked(p, c, inflight, live, max_inflight_bytes, memory_limit)
                if why is None and peak_ahead is not None and now < c:
                    if peak_ahead.query(now, c) + held(now) + p.alloc[c] > memory_limit:
                        why = "memory"
                if why is None and now < c:
                    raised.append(c)
                if why is None:
                    # a collective whose input is still in flight would block the compute
                    # stream at its wait: run compute that does not block first
                    if priority.avoid_stalls and wait_stall(c) > 0:
                        y, yrank = pick(ready)
                        if y is not None and yrank == 0:
                            place_compute(y)
                            continue
                    place(c)
                    continue
                if c not in deferred:
                    deferred.add(c)
                    if why == "inflight":
                        res.deferred_inflight += 1
                    else:
                        res.deferred_memory += 1
            x, xrank = (None, 1)
            if priority.feed_next_collective:
                x, xrank = pick(urgent)
            if x is None or xrank:
                y, yrank = pick(ready)
                if y is not None and (x is None or yrank < xrank):
                    x = y
            if x is not None:
                place_compute(x)
                continue
            if ready_coll:  # nothing else can run: issue over the limit
                res.forced += 1
                place(ready_coll[0])
                continue
            break
        # waits nobody in the segment needed: at the segment's end (never past a barrier)
        for i in seg:
            if not scheduled[i]:
                if i in p.wait_of and avail[i]:
                    place(i)
        left = [i for i in seg if not scheduled[i]]
        if left:
            raise RuntimeError(
                f"schedule_overlap: list scheduler left {[p.nodes[i].name for i in left][:5]} "
                "unscheduled (a dependency cycle the graph order does not have)"
            )
    for i in p.tail:
        for q in p.preds[i]:
            if not scheduled[q]:
                place(q)
        place(i)
    if len(order) != n:
        missing_nodes = [p.nodes[i].name for i in range(n) if not scheduled[i]][:5]
        raise RuntimeError(f"schedule_overlap: nodes left unscheduled: {missing_nodes}")
    return res


def _blocked(
    p: ScheduleProblem,
    c: int,
    inflight: Sequence[int],
    live: float,
    max_inflight_bytes: Optional[int],
    memory_limit: Optional[float],
) -> Optional[str]:
    s = p.stream[c]
    b = p.coll_bytes.get(c, 0)
    # a collective larger than the limit alone still goes when its stream is empty
    if max_inflight_bytes is not None and inflight[s] > 0 and inflight[s] + b > max_inflight_bytes:
        return "inflight"
    if memory_limit is not None and live + p.alloc[c] > memory_limit:
        return "memory"
    return None


def max_inflight(p: ScheduleProblem, order: Sequence[int]) -> int:
    """Largest number of bytes in flight on one stream (issued, not every wait placed) along ``order``."""
    inflight = [0] * max(p.n_streams, 1)
    waits_left: dict[int, int] = {}
    for c in p.wait_of.values():
        waits_left[c] = waits_left.get(c, 0) + 1
    peak = 0
    for i in order:
        if i in p.coll_bytes:
            s = p.stream[i]
            inflight[s] += p.coll_bytes[i]
            peak = max(peak, inflight[s])
        elif i in p.wait_of:
            c = p.wait_of[i]
            waits_left[c] -= 1
            if waits_left[c] == 0:
                inflight[p.stream[c]] -= p.coll_bytes.get(c, 0)
    return peak


def live_profile(p: ScheduleProblem, order: Sequence[int]) -> list[int]:
    """Live bytes after each node of ``order`` (indexed by node), the simulator's accounting."""
    pending = [0] * p.size
    for i in range(p.size):
        for o in p.touches[i]:
            pending[o] += 1
    live = 0
    out = [0] * p.size
    for i in order:
        if p.owner[i] == i:
            live += p.alloc[i]
        out[i] = live
        for o in p.touches[i]:
            pending[o] -= 1
            if pending[o] == 0 and p.nodes[i].op != "output":
                live -= p.alloc[o]
    return out


class _RangeMax:
    """Sparse table: max of ``values[a:b]`` in O(1) after O(n log n) set-up."""

    def __init__(self, values: list[int]) -> None:
        self.table = [list(values)]
        k = 1
        while 2 * k <= len(values):
            prev = self.table[-1]
            self.table.append([max(prev[i], prev[i + k]) for i in range(len(values) - 2 * k + 1)])
            k *= 2

    def query(self, a: int, b: int) -> int:
        if b <= a:
            return 0
        j = (b - a).bit_length() - 1
        row = self.table[j]
        return max(row[a], row[b - (1 << j)])


def apply_order(gm: fx.GraphModule, order: list[fx.Node]) -> None:
    """Move ``gm``'s nodes into ``order`` (a topological order of all of them)."""
    cur = order[0]
    if cur is not next(iter(gm.graph.nodes)):
        next(iter(gm.graph.nodes)).prepend(cur)
    for n in order[1:]:
        if cur.next is not n:
            cur.append(n)
        cur = n
