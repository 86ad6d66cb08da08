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
- objective: the window's compute-stream end, then the sum of its collectives' ends.

The solution's start times give the window's order (Kahn's algorithm keyed by start time,
collectives before compute at equal times, then original index; waits placed right before
their first reader). The whole order is re-simulated and the window is kept only if the
makespan drops and the caller's limits (memory, in flight) hold: the model's simplifications
(no memory, no contention) can cost a window, never correctness.

Determinism: one worker, ``random_seed = 0``, and ``max_deterministic_time`` (the solver's
work counter) as the only limit: the same graph gives the same order on every rank however
fast each compiles. The per-graph budget is spent window by window (each solve's reported
deterministic time is subtracted, also deterministic).
"""

from __future__ import annotations

import heapq
from typing import Callable

from ..costmodel.simulator import NODE_COLLECTIVE, NODE_WAIT, SimResult, Simulator
from .schedule_list import ScheduleProblem

MAX_WINDOWS = 8  # windows re-solved per graph (compile time stays bounded on deep graphs)
NS = 1000  # model time unit: 1 ns (costs are in µs)


def refine_windows(p: ScheduleProblem, sim: Simulator, order: list[int], result: SimResult, *, max_nodes: int,
                   det_time_s: float, acceptable: Callable[[list[int], SimResult], bool]
                   ) -> tuple[list[int], SimResult, dict]:
    """Re-solve up to MAX_WINDOWS windows of ``order``; returns (order, its result, report)."""
    info: dict = {"enabled": True, "windows": [], "deterministic_time_s": 0.0}
    budget = det_time_s
    tried: set[int] = set()
    best_order, best = list(order), result
    for _ in range(MAX_WINDOWS):
        if budget <= 1e-3:
            break
        full = sim.simulate(order=[p.nodes[i] for i in best_order], memory=False, record=True)
        pos = _worst_wait(p, best_order, full, tried)
        if pos is None:
            break
        tried.add(best_order[pos])
        lo, hi = _window(p, best_order, pos, max_nodes)
        if hi - lo < 2:
            continue
        sol = solve_window(p, best_order, lo, hi, full, budget)
        budget -= sol["deterministic_time_s"]
        info["deterministic_time_s"] += sol["deterministic_time_s"]
        entry = {"wait": p.nodes[best_order[pos]].name, "nodes": hi - lo, "status": sol["status"], "kept": False}
        if sol["order"] is not None:
            cand = best_order[:lo] + sol["order"] + best_order[hi:]
            r = sim.simulate(order=[p.nodes[i] for i in cand], record=False)
            entry["makespan_us"] = round(float(r.makespan_us), 3)
            if r.makespan_us < best.makespan_us and acceptable(cand, r):
                best_order, best = cand, r
                entry["kept"] = True
        info["windows"].append(entry)
    info["deterministic_time_s"] = round(info["deterministic_time_s"], 4)
    info["makespan_us"] = round(float(best.makespan_us), 3)
    return best_order, best, info


def _worst_wait(p: ScheduleProblem, order: list[int], r: SimResult, tried: set[int]) -> int | None:
    best = None
    for pos, (code, s, e) in enumerate(zip(r.node_codes, r.node_starts, r.node_ends)):
        i = order[pos]
        if code == NODE_WAIT and e > s and i not in tried and p.segment[i] >= 0 \
                and p.segment[i] not in p.barrier_segments:
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


def solve_window(p: ScheduleProblem, order: list[int], lo: int, hi: int, full: SimResult, det_time_s: float
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
        if p.code[i] == NODE_COLLECTIVE:
            m.add_max_equality(start[i], [t0, *ins])  # issued as soon as its inputs allow
        else:
            for e in ins:
                m.add(start[i] >= e)
    m.add_no_overlap(compute_iv)
    for ivs in stream_iv.values():
        m.add_no_overlap(ivs)
    mk = m.new_int_var(t0, horizon, "makespan")
    for i in win:
        if p.code[i] != NODE_COLLECTIVE:
            m.add(mk >= end[i])
    m.minimize(mk * (len(colls) + 1) + sum(comm_end.values()))

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_deterministic_time = max(det_time_s, 1e-3)
    status = solver.solve(m)
    out = {"status": solver.status_name(status), "deterministic_time_s": float(solver.deterministic_time),
           "order": None}
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        times = {i: solver.value(start[i]) for i in win}
        out["order"] = _extract(p, win, times)
    return out


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
