"""Exact re-ordering of small windows of a schedule with OR-Tools CP-SAT (``schedule_overlap``).

A *window* is a contiguous run of at most ``max_nodes`` nodes of one segment of the greedy
order, centred on the wait that blocks the compute stream longest (the simulator says which).
Everything before the window is fixed: its simulated state (compute-stream time, when each
comm stream is free, when each collective issued before ends) is the window's start state.

Model (integer nanoseconds)
- compute (and free) nodes: interval variables on the one compute stream (no-overlap);
- collectives: an issue time equal to the latest end of their inputs (issue as early as the
  inputs allow; ``AddMaxEquality``), and an interval on their group's stream (no-overlap per
  stream) that starts no earlier than the issue, than the stream being free, and than the
  end of the stream's previous collective (streams are FIFO in issue order);
- waits: a time no earlier than their collective's end; a node that reads a wait starts
  after it (the compute stream blocks there);
- precedence: every data edge, the collective chain (issue order kept across all groups)
  and the order of random ops (all in ``ScheduleProblem.preds``);
- memory (only with ``memory_limit``): one cumulative resource, capacity = the limit minus
  the bytes live throughout the window (allocated before it, used after it); one interval
  per other buffer the window touches, from its allocation (or the window's start) to the end
  of its last reader in the window (or the window's end if it is used later), demand = its
  bytes. Then a collective's issue may also be later than its inputs (holding a buffer back
  can be what fits), but never inside a compute node (a zero-length interval on the compute
  stream: the simulator issues at node boundaries);
- objective: the window's compute-stream end, then the sum of its collectives' ends.

Memory follows the simulator's accounting (``costmodel.simulator._peak_memory``, the same
``owner`` / ``touches`` as ``list_scheduler.live_profile``): a node allocates its buffer when it
runs (a collective when it is issued), views, waits and getitems extend their owner's life,
a buffer is freed after its last toucher in order; placeholders persist with
``Simulator.inputs_persist``. Order events are mapped to model time on a doubled clock, so that
ties break the way the order does: compute ``i`` allocates at ``2 s_i`` and releases at
``2 e_i - 1``, a collective allocates at ``2 x - 1`` and releases (as a reader) at ``2 x``.
With every compute node at least 1 ns long (zero-time nodes are given 1 ns, only when memory
is modelled) that is exact for every pair of events except two collectives issued at the same
instant, where it over-counts (conservative). A wait is placed right before its first reader
in the window, whose interval it is counted with; a wait no one in the window reads stays to
the window's end. Reordering inside a window changes neither the live set at its start nor
at its end, so window peak <= limit means the whole order's peak <= limit. With memory, a
window's time is counted in at most ``MEMORY_TICKS`` ticks (``_coarsen``: rounding costs model
precision, which the re-simulation judges, never memory soundness), the current order is the
solution hint, and the LP relaxation and presolve symmetry detection are off (``solve_window``).

The solution's start times give the window's order (Kahn's algorithm keyed by start time,
collectives before compute at equal times, then original index; waits placed right before
their first reader). The whole order is re-simulated and the window is kept only if the
makespan drops and the caller's limits (memory, in flight) hold: the model's simplifications
(no in-flight limit, no contention) can cost a window, never correctness.

Determinism: one worker, ``random_seed = 0``, and ``max_deterministic_time`` (the solver's
work counter) as the only limit: the same graph gives the same order on every rank however
fast each compiles. The per-graph budget is spent window by window (each solve's reported
deterministic time is subtracted, also deterministic).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Optional

from commfuse.costmodel.simulator import NODE_COLLECTIVE, NODE_WAIT, SimResult, Simulator
from commfuse.schedule.list_scheduler import ScheduleProblem

MAX_WINDOWS = 8  # windows re-solved per graph (compile time stays bounded on deep graphs)
NS = 1000  # model time unit: 1 ns (costs are in µs)
# With memory, a window's time is counted in at most this many ticks (see ``_coarsen``).
MEMORY_TICKS = 1000
NEVER = 1 << 62  # "last used" of a buffer the graph output (or a persistent input) keeps


def solver_missing() -> Optional[str]:
    """Why CP-SAT cannot run here (OR-Tools not importable), or None. OR-Tools is a declared
    dependency; an image without it (a CUDA machine one cannot install on) keeps the greedy order."""
    import importlib.util

    if importlib.util.find_spec("ortools") is None:
        return "OR-Tools is not installed: the greedy order is kept unrefined"
    return None


def refine_windows(
    p: ScheduleProblem,
    sim: Simulator,
    order: list[int],
    result: SimResult,
    *,
    max_nodes: int,
    det_time_s: float,
    acceptable: Callable[[list[int], SimResult], bool],
    memory_limit: Optional[float] = None,
) -> tuple[list[int], SimResult, dict]:
    """Re-solve up to MAX_WINDOWS windows of ``order``; returns (order, its result, report).

    ``memory_limit``: bytes the simulated peak may reach; None models no memory."""
    info: dict = {"enabled": True, "windows": [], "deterministic_time_s": 0.0}
    if memory_limit is not None:
        info["memory_limit_bytes"] = int(memory_limit)
    budget = det_time_s
    tried: set[int] = set()
    best_order, best = list(order), result
    live: Optional[Liveness] = None
    full: Optional[SimResult] = None
    for _ in range(MAX_WINDOWS):
        if budget <= 1e-3:
            break
        if full is None:  # the timeline of the current best order: recomputed only when a window is kept
            full = sim.simulate(order=[p.nodes[i] for i in best_order], memory=False, record=True)
        pos = _worst_wait(p, best_order, full, tried)
        if pos is None:
            break
        tried.add(best_order[pos])
        lo, hi = _window(p, best_order, pos, max_nodes)
        if hi - lo < 2:
            continue
        mem = None
        if memory_limit is not None:
            if live is None:  # recomputed only when a window is kept
                live = liveness(p, best_order, sim.inputs_persist)
            mem = window_memory(p, best_order, lo, hi, live, memory_limit)
        entry = {"wait": p.nodes[best_order[pos]].name, "nodes": hi - lo, "kept": False}
        if mem is not None and mem.capacity < 0:
            # the bytes live across the window alone pass the limit: nothing to solve
            entry["status"] = "OVER_MEMORY_LIMIT"
            info["windows"].append(entry)
            continue
        sol = solve_window(p, best_order, lo, hi, full, budget, memory=mem)
        budget -= sol["deterministic_time_s"]
        info["deterministic_time_s"] += sol["deterministic_time_s"]
        entry["status"] = sol["status"]
        if sol["order"] is not None:
            cand = best_order[:lo] + sol["order"] + best_order[hi:]
            r = sim.simulate(order=[p.nodes[i] for i in cand], record=False)
            entry["makespan_us"] = round(float(r.makespan_us), 3)
            entry["peak_memory_bytes"] = int(r.peak_memory_bytes)
            if r.makespan_us < best.makespan_us and acceptable(cand, r):
                best_order, best = cand, r
                live = full = None
                entry["kept"] = True
        info["windows"].append(entry)
    info["deterministic_time_s"] = round(info["deterministic_time_s"], 4)
    info["makespan_us"] = round(float(best.makespan_us), 3)
    return best_order, best, info


@dataclass
class Liveness:
    """Position of every node in an order, and per buffer owner the position of its last toucher."""

    pos: list[int]
    last: list[int]  # NEVER: kept by the graph output, or a persistent input; -1: not an owner


def liveness(p: ScheduleProblem, order: list[int], inputs_persist: bool = False) -> Liveness:
    """The simulator's buffer lifetimes (``buffer_lifetimes``) along ``order``."""
    pos = [0] * p.size
    last = [-1] * p.size
    for k, i in enumerate(order):
        pos[i] = k
        is_output = p.nodes[i].op == "output"
        for o in p.touches[i]:
            if is_output and o != i:
                last[o] = NEVER
            elif last[o] != NEVER:
                last[o] = k
    if inputs_persist:
        for i in p.head:
            if p.nodes[i].op == "placeholder":
                last[p.owner[i]] = NEVER
    return Liveness(pos, last)


@dataclass
class Buffer:
    """One buffer whose allocation or free falls inside a window."""

    owner: int
    bytes: int
    allocated_inside: bool  # else: live from the window's start
    used_after: bool  # live to the window's end
    touchers: list[int]  # window nodes that use it (the allocating node included)


@dataclass
class WindowMemory:
    capacity: int  # the limit minus the bytes live throughout the window
    live_through: int
    buffers: list[Buffer]


def window_memory(
    p: ScheduleProblem, order: list[int], lo: int, hi: int, live: Liveness, limit: float
) -> WindowMemory:
    """Split the bytes a window sees into live-throughout (a constant) and per-buffer intervals."""
    through = 0
    for k in range(lo):  # allocated before the window, freed after it (or never)
        o = order[k]
        if p.owner[o] == o and p.alloc[o] and live.last[o] >= hi:
            through += p.alloc[o]
    touch: dict[int, list[int]] = {}
    for i in order[lo:hi]:
        for o in p.touches[i]:
            if p.alloc[o] and p.owner[o] == o:
                touch.setdefault(o, []).append(i)
    bufs = []
    for o in sorted(touch):
        inside = lo <= live.pos[o] < hi
        after = live.last[o] >= hi
        if not inside and after:
            continue  # in ``through``
        bufs.append(Buffer(o, p.alloc[o], inside, after, touch[o]))
    return WindowMemory(int(limit) - through, through, bufs)


def _worst_wait(p: ScheduleProblem, order: list[int], r: SimResult, tried: set[int]) -> int | None:
    best = None
    for pos, (code, s, e) in enumerate(zip(r.node_codes, r.node_starts, r.node_ends, strict=True)):
        i = order[pos]
        if (
            code == NODE_WAIT
            and e > s
            and i not in tried
            and p.segment[i] >= 0
            and p.segment[i] not in p.barrier_segments
        ):
            if best is None or e - s > best[0]:
                best = (e - s, pos)
    return None if best is None else best[1]


def _window(p: ScheduleProblem, order: list[int], pos: int, max_nodes: int) -> tuple[int, int]:
    """Positions [lo, hi) around ``pos``: two thirds before, one third after, inside its segment."""
    seg = p.segment[order[pos]]
    lo = pos
    while lo > 0 and p.segment[order[lo - 1]] == seg and pos - lo + 1 < (2 * max_nodes) // 3:
        lo -= 1
    hi = pos + 1
    while hi < len(order) and p.segment[order[hi]] == seg and hi - lo < max_nodes:
        hi += 1
    while lo > 0 and p.segment[order[lo - 1]] == seg and hi - lo < max_nodes:
        lo -= 1
    return lo, hi


def solve_window(
    p: ScheduleProblem,
    order: list[int],
    lo: int,
    hi: int,
    full: SimResult,
    det_time_s: float,
    *,
    memory: Optional[WindowMemory] = None,
) -> dict:
    """CP-SAT on order[lo:hi] given the simulated state before ``lo`` (see the module docstring)."""
    from ortools.sat.python import cp_model

    win = order[lo:hi]
    inwin = set(win)
    # state at the window's start
    t0 = int(round(float(full.node_ends[lo - 1]) * NS)) if lo > 0 else 0
    before = set(order[:lo])
    stream_free: dict[int, int] = {}
    known_end: dict[int, int] = {}
    by_name = {p.nodes[i].name: i for i in before if i in p.coll_bytes}
    for ct in full.collectives:
        i = by_name.get(ct.name)
        if i is not None:
            e = int(round(float(ct.end_us) * NS))
            known_end[i] = e
            stream_free[p.stream[i]] = max(stream_free.get(p.stream[i], 0), e)
    dur = {i: int(round(float(p.time[i]) * NS)) for i in win}
    if memory is not None:
        t0, dur = _coarsen(p, win, t0, dur, stream_free, known_end)
    horizon = max([t0, *stream_free.values(), *known_end.values()]) + sum(dur.values()) + 1

    m = cp_model.CpModel()
    start: dict[int, object] = {}
    end: dict[int, object] = {}  # when a reader of the node may start
    compute_iv = []
    stream_iv: dict[int, list] = {}
    comm_end: dict[int, object] = {}
    comm_start: dict[int, object] = {}
    colls = [i for i in win if p.code[i] == NODE_COLLECTIVE]
    for i in win:
        if p.code[i] == NODE_COLLECTIVE or i in p.wait_of:
            continue
        s = m.new_int_var(t0, horizon, f"s{i}")
        e = m.new_int_var(t0, horizon, f"e{i}")
        compute_iv.append(m.new_interval_var(s, dur[i], e, f"iv{i}"))
        start[i], end[i] = s, e
    for i in colls:
        x = m.new_int_var(t0, horizon, f"x{i}")
        cs = m.new_int_var(max(t0, stream_free.get(p.stream[i], 0)), horizon, f"cs{i}")
        ce = m.new_int_var(t0, horizon, f"ce{i}")
        stream_iv.setdefault(p.stream[i], []).append(m.new_interval_var(cs, dur[i], ce, f"c{i}"))
        m.add(cs >= x)
        if memory is not None:  # issued at a compute-node boundary, as the simulator issues
            compute_iv.append(m.new_interval_var(x, 0, x, f"xi{i}"))
        start[i], end[i], comm_start[i], comm_end[i] = x, x, cs, ce
    for i in win:
        if i in p.wait_of:
            w = m.new_int_var(t0, horizon, f"w{i}")
            c = p.wait_of[i]
            if c in comm_end:
                m.add(w >= comm_end[c])
            elif c in known_end:
                m.add(w >= known_end[c])
            start[i], end[i] = w, w
    last_on_stream: dict[int, int] = {}
    for i in colls:  # FIFO streams in issue (chain) order
        s = p.stream[i]
        if s in last_on_stream:
            m.add(comm_start[i] >= comm_end[last_on_stream[s]])
        last_on_stream[s] = i
    for i in win:
        ins = [end[q] for q in p.preds[i] if q in inwin]
        if p.code[i] == NODE_COLLECTIVE and memory is None:
            m.add_max_equality(start[i], [t0, *ins])  # issued as soon as its inputs allow
        else:
            for e in ins:
                m.add(start[i] >= e)
    m.add_no_overlap(compute_iv)
    for ivs in stream_iv.values():
        m.add_no_overlap(ivs)
    if memory is not None:
        _add_memory(m, p, win, start, end, memory, t0, horizon)
        # The current order meets the limit: hand it over, or a tight limit leaves the search
        # without a first solution for most of its budget.
        _hint_current(m, p, win, t0, dur, stream_free, known_end, start, comm_start, comm_end)
    mk = m.new_int_var(t0, horizon, "makespan")
    for i in win:
        if p.code[i] != NODE_COLLECTIVE:
            m.add(mk >= end[i])
    m.minimize(mk * (len(colls) + 1) + sum(comm_end.values()))

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_deterministic_time = max(det_time_s, 1e-3)
    if memory is not None:
        # no LP relaxation: it gives no useful bound with the cumulative resource and slowed every
        # search node down (the prefetch test window: optimal in 0.06 det-s instead of 0.25)
        solver.parameters.linearization_level = 0
        # OR-Tools 9.15's symmetry detection in presolve fails on some models with a solution
        # hint (IndexError absl::btree_map::at, found by the fuzzer); windows are too small for
        # symmetry breaking to matter
        solver.parameters.symmetry_level = 0
    try:
        status = solver.solve(m)
    except Exception as e:  # a solver failure costs the window, never the pass (same on every rank)
        return {"status": f"SOLVER_ERROR {type(e).__name__}: {e}", "deterministic_time_s": 0.0, "order": None}
    out = {
        "status": solver.status_name(status),
        "deterministic_time_s": float(solver.deterministic_time),
        "order": None,
    }
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        times = {i: solver.value(start[i]) for i in win}
        out["order"] = _extract(p, win, times)
    return out


def _coarsen(
    p: ScheduleProblem,
    win: list[int],
    t0: int,
    dur: dict[int, int],
    stream_free: dict[int, int],
    known_end: dict[int, int],
) -> tuple[int, dict[int, int]]:
    """Window times in ticks of at most MEMORY_TICKS per window, counted from its start (in place for
    the stream states; returns the new start and durations).

    With the cumulative constraint the solver's work grows with the time resolution (a 15-node
    window at 1 ns did not prove optimality in 3 s, at 1/600 of its span in 0.04 s). Compute
    nodes last at least one tick, so their start times are distinct (the memory mapping needs it).
    Stream states round up: the model never assumes a stream frees earlier than it does."""
    span = max([t0, *stream_free.values(), *known_end.values()]) - t0 + sum(dur.values())
    unit = max(1, -(-span // MEMORY_TICKS))
    for d in (stream_free, known_end):
        for k, v in d.items():
            d[k] = max(0, -(-(v - t0) // unit))
    out = {}
    for i in win:
        out[i] = int(round(dur[i] / unit))
        if p.code[i] != NODE_COLLECTIVE and i not in p.wait_of:
            out[i] = max(out[i], 1)
    return 0, out


def _hint_current(
    m,
    p: ScheduleProblem,
    win: list[int],
    t0: int,
    dur: dict[int, int],
    stream_free: dict[int, int],
    known_end: dict[int, int],
    start: dict,
    comm_start: dict,
    comm_end: dict,
) -> None:
    """Solution hint: the window's times in its current order, as the simulator runs it."""
    t = t0
    free = dict(stream_free)
    ends: dict[int, int] = {}
    for i in win:
        if p.code[i] == NODE_COLLECTIVE:
            cs = max(t, free.get(p.stream[i], 0))
            free[p.stream[i]] = ends[i] = cs + dur[i]
            m.add_hint(start[i], t)
            m.add_hint(comm_start[i], cs)
            m.add_hint(comm_end[i], cs + dur[i])
        elif i in p.wait_of:
            t = max(t, ends.get(p.wait_of[i], known_end.get(p.wait_of[i], t)))
            m.add_hint(start[i], t)
        else:
            m.add_hint(start[i], t)
            t += dur[i]


def _add_memory(
    m, p: ScheduleProblem, win: list[int], start: dict, end: dict, memory: WindowMemory, t0: int, horizon: int
) -> None:
    """The cumulative memory constraint on the doubled clock (see the module docstring)."""
    low, high = 2 * t0 - 2, 2 * horizon + 2  # before every event of the window / after all of them
    inwin = set(win)
    readers = {i: [u for u in p.succs[i] if u in inwin] for i in win if i in p.wait_of}

    def alloc_at(i: int):
        return 2 * start[i] - 1 if p.code[i] == NODE_COLLECTIVE else 2 * start[i]

    def releases(i: int) -> Optional[list]:
        """Model times at which ``i`` stops holding what it touches (None: the window's end)."""
        if p.code[i] == NODE_COLLECTIVE:
            return [2 * start[i]]
        if i in p.wait_of:  # placed right before its first reader, which touches the same buffer
            if not readers[i]:
                return None  # a wait no one in the window reads goes to the window's end
            out = []
            for u in readers[i]:
                r = releases(u)
                if r is None:
                    return None
                out.extend(r)
            return out
        return [2 * end[i] - 1]

    ivs, demands = [], []
    for b in memory.buffers:
        s = alloc_at(b.owner) if b.allocated_inside else low
        rel: Optional[list] = None
        if not b.used_after:
            rel = []
            for i in b.touchers:
                r = releases(i)
                if r is None:
                    rel = None
                    break
                rel.extend(r)
        if rel is None:
            e = high
        elif len(rel) == 1:
            e = rel[0]
        else:
            e = m.new_int_var(low, high, f"free{b.owner}")
            m.add_max_equality(e, rel)
        size = m.new_int_var(0, high - low, f"life{b.owner}")
        ivs.append(m.new_interval_var(s, size, e, f"buf{b.owner}"))
        demands.append(b.bytes)
    if ivs:
        m.add_cumulative(ivs, demands, memory.capacity)


def _extract(p: ScheduleProblem, win: list[int], times: dict[int, int]) -> list[int]:
    """Topological order of the window by solved start time (waits lazily before their reader)."""
    inwin = set(win)
    missing = {i: 0 for i in win}
    for i in win:
        missing[i] = sum(1 for q in p.preds[i] if q in inwin)
    placed: set[int] = set()
    avail: set[int] = set()
    heap: list[tuple[int, int, int]] = []

    def key(i: int) -> tuple[int, int, int]:
        return (times[i], 0 if p.code[i] == NODE_COLLECTIVE else 1, i)

    def release(i: int) -> None:
        stack = [i]
        while stack:
            x = stack.pop()
            for u in p.succs[x]:
                if u not in inwin:
                    continue
                missing[u] -= 1
                if missing[u] == 0:
                    if u in p.wait_of:
                        avail.add(u)
                        stack.append(u)
                    else:
                        heapq.heappush(heap, key(u))

    out: list[int] = []

    def place(i: int) -> None:
        for q in p.preds[i]:
            if q in inwin and q not in placed and q in p.wait_of:
                place(q)
        placed.add(i)
        out.append(i)
        if i not in p.wait_of:
            release(i)

    for i in win:
        if missing[i] == 0:
            if i in p.wait_of:
                avail.add(i)
                release(i)
            else:
                heapq.heappush(heap, key(i))
    while heap:
        _, _, i = heapq.heappop(heap)
        if i not in placed:
            place(i)
    for i in win:  # waits nobody in the window reads: at its end
        if i not in placed and i in avail:
            place(i)
    if len(out) != len(win):
        raise RuntimeError("schedule_overlap: CP-SAT window order lost nodes")
    return out
