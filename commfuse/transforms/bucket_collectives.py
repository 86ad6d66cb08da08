"""bucket_collectives: merge runs of small same-kind collectives on one group into one
collective on a flat buffer, where the simulator says it costs no overlap and little memory.

Contract
- Matches: functional ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and
  ``all_reduce`` (not coalesced, not in place, one input, exactly one wait, static shapes)
  in a scheduled (forward / backward / inference) graph. Candidates are taken in issue
  order; a bucket holds *consecutive* collectives of one key (kind, group, dtype, reduce op):
  a collective that cannot join the open bucket of its key closes it and opens the next.
- Does: replaces a bucket's members by one collective on the concatenation of their inputs
  (layouts in docs/bucketing.md: all_gather gathers the flat shards and re-stacks each
  member rank-major; reduce_scatter lays every input out as [N, chunk] and concatenates
  along the chunk dim; all_reduce concatenates flat). The bucket is issued where its last
  member's input is ready, but never earlier than its first member was issued (no prefetch
  beyond what the schedule chose), and waited where the first of its members' results is
  needed (the wait positions ``sink_waits`` gives, so it composes with that pass).
- Joins a member only if: the bucket stays within the byte cap (``Config.bucket_cap_bytes``,
  else the message size at which the collective's latency term is 10% of its time under
  the topology's cost model, else 25 MiB without a topology); no member's input depends on
  another member's result; no op that mutates memory (or hides collectives) lies between a
  member's old and new issue point; the graph's simulated makespan does not grow (the
  simulator's execution model: one compute stream, one stream per group, waits block); and
  the simulated peak memory stays within ``1 + Config.bucket_max_memory_increase`` of the
  input graph's. After rewriting, the real :class:`Simulator` re-checks the whole graph
  (makespan and peak memory, waits at their first use) and the pass restores the input
  graph if either got worse than allowed.
- Guarantees: the same values (all_gather bitwise; reductions reduce each element over the
  same ranks, only the ring chunk it travels in changes); the decisions depend only on the
  graph, the config and the topology (or, without one, the model the step-time gate uses: gloo's
  default for a graph on CPU tensors, else the cost policy's documented default), priced on what
  every rank shares (``passmgr/invariance.py``: the compute and memory that follow from a
  data-parallel rank's local batch, static or symbolic, are not priced; the collectives' own
  sizes are), so every rank buckets identically and the new total issue order is the same on
  every rank. Graphs whose ranks may hold different graphs or collective sizes (point-to-point
  ops, unequal all_to_all splits) are left unchanged.
- Leaves alone (each reported in ``refusals``): other kinds, coalesced / in-place /
  symbolic-shape collectives, a collective whose dtype, group or reduce op differs from the
  previous one of its kind, and every refused join with its reason (dependency, mutation in
  between, would expose overlap, memory budget). Buckets closed by the cap are listed in
  ``decisions``.

Source: bucketing of DDP / FSDP and Inductor's ``bucketing.py`` + overlap-preserving
bucketer (merge same-key collectives into one flat buffer; keep the scheduler's hiding
intervals), XLA's all-gather / reduce-scatter / all-reduce combiners (byte threshold);
the cap from the alpha-beta model of NCCL's tuner (Chimera §2 / Centauri §3 cost terms).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.fx as fx

from commfuse.analysis.rank_local import rank_local_reason
from commfuse.core.torch_private import c10d_functional as _f
from commfuse.costmodel.analytic import AnalyticCostModel
from commfuse.costmodel.collectives import message_bytes
from commfuse.costmodel.compute import OpCost
from commfuse.costmodel.simulator import Simulator, alias_source, buffer_lifetimes
from commfuse.ir import rewrite
from commfuse.ir.collective import Collective
from commfuse.ir.kinds import CollectiveKind, is_wait
from commfuse.ir.shapes import shape_of
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext, PassContext as _Ctx
from commfuse.passmgr.gate import gate_model
from commfuse.passmgr.pipeline import restore_graph, snapshot_graph

K = CollectiveKind
_KINDS = (K.ALL_GATHER, K.REDUCE_SCATTER, K.ALL_REDUCE)
# Without a topology: PyTorch DDP's default bucket size (bucket_cap_mb=25). The formula below
# gives 2-57 MiB on the presets (docs/bucketing.md), so it sits inside the range of real links.
DEFAULT_CAP_BYTES = 25 * 2**20
# The cap is the message size at which the latency term is this share of the collective's time.
LATENCY_SHARE = 0.10
_EPS = 1e-9


# ----------------------------------------------------------------- the bucketed forms
def _issue_ag(*args):
    *xs, n, group = args
    return _f.all_gather_into_tensor(torch.cat([x.reshape(-1) for x in xs]), n, group)


def _wait_ag(out, n, sizes, shapes):
    # Rank r's flat shard is row r of [N, sum(sizes)]; member i is column block i, which
    # re-stacked row by row is exactly its own all_gather output (rank-major along dim 0).
    # Contiguous, as the member's own output was: code downstream may `view` it.
    rows = _f.wait_tensor(out).view(n, -1)
    return tuple(
        p.contiguous().view(s) for p, s in zip(torch.split(rows, list(sizes), dim=1), shapes, strict=True)
    )


def _issue_rs(*args):
    *xs, op, n, group = args
    # Row r of x_i.reshape(N, -1) is the chunk rank r receives; concatenating along the chunk
    # dim keeps every rank's chunks contiguous, so one reduce_scatter serves every member.
    flat = torch.cat([x.reshape(n, -1) for x in xs], dim=1).reshape(-1)
    return _f.reduce_scatter_tensor(flat, op, n, group)


def _issue_ar(*args):
    *xs, op, group = args
    return _f.all_reduce(torch.cat([x.reshape(-1) for x in xs]), op, group)


def _wait_flat(out, sizes, shapes):
    flat = _f.wait_tensor(out)
    return tuple(p.view(s) for p, s in zip(torch.split(flat, list(sizes)), shapes, strict=True))


# ----------------------------------------------------------------- records
@dataclass
class _Member:
    c: Collective
    key: tuple
    start: int  # positions in the sunk order (waits at their first use, as sink_waits leaves them)
    ready: int  # first position at which every input is computed
    need_gap: int  # position of the sunk wait: the result must exist from here on
    need: int  # the node the result is first needed by (the first non-wait after need_gap)
    in_bytes: int
    out_bytes: int
    size: int  # nccl-tests message size (the cap's unit)
    in_owner: Optional[fx.Node]  # the storage the input lives in, and its last use
    in_last: int
    out_last: int  # last use of the output's storage


@dataclass
class _Bucket:
    members: list[_Member]
    issue: int = 0
    wait: int = 0
    size: int = 0
    dur: float = 0.0
    pre: float = 0.0  # copy-in on the compute stream before the issue
    post: float = 0.0  # copy-out after the wait
    delta: Optional[np.ndarray] = None  # its change of the live-memory profile
    closed_by_cap: bool = False


@dataclass
class _Graph:
    """The sunk order with everything the planning model needs, indexed by position."""

    nodes: list[fx.Node]
    pos: dict[fx.Node, int]
    prefix: list[float]  # compute time before each position
    barriers: list[int]  # prefix counts of memory-mutating / collective-hiding nodes
    waits: list[bool]
    profile: np.ndarray  # live bytes at each node's allocation (simulator accounting)
    owner: dict[fx.Node, fx.Node]
    last: dict[fx.Node, int]
    events: list[tuple]  # (gap, sub, seq, kind, stream, value, collective index)
    coll_events: dict[int, list[int]] = field(default_factory=dict)  # collective index -> event indices


# ----------------------------------------------------------------- the pass
class BucketCollectives(GraphPass):
    __doc__ = __doc__
    name = "bucket_collectives"
    stage = Stage.SCHEDULE
    # Bucketing merges same-kind collectives into one on a flat buffer: the interpreter reduces
    # every element over the same ranks in the same order whatever buffer it sits in, so values
    # are bitwise equal; the collective sequence changes (fewer, larger collectives). Every family:
    # gathers, scatters and all_reduces appear in all of them, next to the kinds it must leave alone.
    fuzz = FuzzSpec(exact=True)

    def run(self, ctx: PassContext) -> PassResult:
        ir = ctx.ir
        why = _graph_refusal(ctx)
        cands = [c for c in ir.collectives if c.kind in _KINDS]
        if why is not None:
            return PassResult(False, {"buckets": 0}, [why] if cands else [])
        if len(cands) < 2:
            return PassResult(False, {"buckets": 0})
        # the model the step-time gate judges with: on a CPU graph without a topology, gloo's
        est = gate_model(ctx)[0]
        planner = _Planner(ctx, est)
        buckets, refusals = planner.plan()
        counts = {
            "buckets": len(buckets),
            "collectives_bucketed": sum(len(b.members) for b in buckets),
            "collectives_removed": sum(len(b.members) - 1 for b in buckets),
            "refused": len(refusals),
        }
        if not buckets:
            return PassResult(False, counts, refusals)

        planner.simulate_before()
        snapshot = snapshot_graph(ctx.gm.graph)
        before_nodes = set(ctx.gm.graph.nodes)
        _apply(ctx.gm, buckets, planner.g.nodes)
        ctx.gm.graph.lint()
        ctx.gm.recompile()
        verdict = planner.recheck(before_nodes)
        decisions = [planner.describe(b) for b in buckets]
        if verdict is not None:
            restore_graph(ctx.gm.graph, snapshot)
            ctx.gm.recompile()
            counts = {
                "buckets": 0,
                "collectives_bucketed": 0,
                "collectives_removed": 0,
                "refused": len(refusals) + 1,
            }
            return PassResult(False, counts, refusals + [f"all buckets undone: {verdict}"])
        decisions.append(planner.summary)
        return PassResult(True, counts, refusals, decisions)


def _graph_refusal(ctx: PassContext) -> Optional[str]:
    """A reason to leave the whole graph alone: ranks might not see the same graph or sizes."""
    why = rank_local_reason(ctx.ir.collectives, ctx.gm)
    return (
        None
        if why is None
        else f"{why}, so cost-based bucketing could decide differently on each; left unchanged"
    )


def _key(c: Collective) -> tuple:
    return (c.kind.value, c.group.name, str(c.dtype), c.reduce_op)


def _static(shape) -> bool:
    return shape is not None and all(isinstance(s, int) for s in shape)


def _eligible(c: Collective) -> Optional[str]:
    if c.coalesced or c.inplace:
        return "in place or coalesced"
    if len(c.inputs) != 1 or len(c.waits) != 1:
        return "not one input with exactly one wait"
    if not (_static(shape_of(c.inputs[0])) and _static(shape_of(c.start))):
        return "symbolic shapes (not static)"
    if c.dtype is None or not c.group.size:
        return "dtype or group size unknown"
    if c.kind is K.ALL_GATHER and not shape_of(c.inputs[0]):
        return "0-d input"
    return None


# ----------------------------------------------------------------- planning
class _Planner:
    def __init__(self, ctx: PassContext, est: AnalyticCostModel) -> None:
        self.ctx = ctx
        self.est = est
        self.cfg = ctx.config
        ir = ctx.ir
        self.sim = Simulator(ctx.gm, est, ir=ir)
        self.g = _build(ctx.gm, ir, self.sim)
        self.base_peak = float(self.g.profile.max()) if len(self.g.profile) else 0.0
        self.budget_peak = self.base_peak * (1 + self.cfg.bucket_max_memory_increase)
        self.cur_profile = self.g.profile.copy()
        self.buckets: list[_Bucket] = []  # committed (>= 2 members) or open
        self.cur_makespan = self._makespan([])
        self.base_makespan = self.cur_makespan
        self.summary: dict = {}
        self._caps: dict[tuple, int] = {}

    # -- the cap
    def cap(self, c: Collective) -> int:
        if self.cfg.bucket_cap_bytes is not None:
            return self.cfg.bucket_cap_bytes
        if self.ctx.topology is None:
            return DEFAULT_CAP_BYTES
        key = (c.kind, c.group.size, c.group.ranks)
        if key not in self._caps:
            self._caps[key] = latency_bound_cap(self.est, c.kind, c.group.size, c.group.ranks)
        return self._caps[key]

    # -- the plan
    def plan(self) -> tuple[list[_Bucket], list[str]]:
        g = self.g
        refusals: list[str] = []
        open_: dict[tuple, _Bucket] = {}
        prev_of_kind: dict[K, Collective] = {}
        ordered = sorted(
            (c for c in self.ctx.ir.collectives if c.kind in _KINDS), key=lambda c: g.pos[c.start]
        )
        for c in ordered:
            prev = prev_of_kind.get(c.kind)
            prev_of_kind[c.kind] = c
            why = _eligible(c)
            if why is not None:
                refusals.append(f"{c.name}: not bucketed: {why} ({c.kind.value})")
                continue
            m = self._member(c)
            b = open_.get(m.key)
            if b is None:
                if prev is not None and _key(prev) != m.key and prev.kind is c.kind:
                    refusals.append(f"{c.name}: not bucketed with {prev.name}: {_difference(prev, c)}")
                open_[m.key] = self._new_bucket(m)
                continue
            why = self._try_join(b, m)
            if why is None:
                continue
            if why == "cap":
                b.closed_by_cap = True
            else:
                refusals.append(f"{c.name}: not added to the bucket of {_names(b)}: {why}")
            open_[m.key] = self._new_bucket(m)
        return [b for b in self.buckets if len(b.members) > 1], refusals

    def _member(self, c: Collective) -> _Member:
        g = self.g
        start = g.pos[c.start]
        ready = max((g.pos[a] + 1 for a in c.start.all_input_nodes), default=0)
        w = c.waits[0]
        need = g.pos[w] + 1  # the sunk wait sits right before the node that needs the result
        while need < len(g.nodes) and g.waits[need]:
            need += 1
        inp = c.inputs[0]
        in_owner = g.owner.get(inp, inp)
        out_owner = g.owner.get(c.start, c.start)
        return _Member(
            c,
            _key(c),
            start,
            ready,
            g.pos[w],
            min(need, len(g.nodes) - 1),
            self.sim.value_bytes(inp),
            self.sim.value_bytes(c.start),
            message_bytes(c),
            in_owner,
            g.last.get(in_owner, start),
            g.last.get(out_owner, start),
        )

    def _new_bucket(self, m: _Member) -> _Bucket:
        b = _Bucket([m])
        self.buckets.append(b)
        return b

    def _try_join(self, b: _Bucket, m: _Member) -> Optional[str]:
        g = self.g
        members = b.members + [m]
        size = sum(x.size for x in members)
        if size > self.cap(m.c):
            return "cap"
        issue = max(min(x.start for x in members), max(x.ready for x in members))
        # A member's input may be another member's (sunk) wait, which the bucket replaces: the
        # check is against the waits' own positions, not the nodes after them.
        if issue > min(x.need_gap for x in members):
            return self._window_reason(b, m)
        while issue < len(g.nodes) and g.waits[issue]:  # anchor on a node whose place sink_waits keeps
            issue += 1
        wait = min(x.need for x in members)
        for x in members:
            # nodes between the old read of the input (its start) and the new one (the copy-in,
            # placed before node `issue`)
            lo, hi = (issue, x.start) if issue <= x.start else (x.start + 1, issue)
            if g.barriers[hi] - g.barriers[lo] > 0:
                return (
                    f"an op that mutates memory (or hides collectives) lies between {x.c.name} and the "
                    "bucket's issue point"
                )
        cand = _Bucket(members, issue, wait, size)
        self._price(cand)
        others = [x for x in self.buckets if x is not b and len(x.members) > 1]
        span = self._makespan(others + [cand])
        if span > self.cur_makespan * (1 + _EPS) + _EPS:
            return (
                f"would expose overlapped communication (simulated makespan {self.cur_makespan:.1f} -> "
                f"{span:.1f} us)"
            )
        cand.delta = self._delta(cand)
        prof = self.cur_profile + cand.delta - (b.delta if b.delta is not None else 0)
        peak = float(prof.max())
        if peak > self.budget_peak * (1 + _EPS) and peak > float(self.cur_profile.max()):
            return (
                f"memory budget: simulated peak {self.base_peak / 2**20:.2f} -> {peak / 2**20:.2f} MiB "
                f"(at most +{self.cfg.bucket_max_memory_increase:.0%})"
            )
        b.members, b.issue, b.wait, b.size = members, issue, wait, size
        b.dur, b.pre, b.post, b.delta = cand.dur, cand.pre, cand.post, cand.delta
        self.cur_profile = prof
        self.cur_makespan = span
        return None

    def _window_reason(self, b: _Bucket, m: _Member) -> str:
        inp = m.c.start.all_input_nodes
        lo = min(x.start for x in b.members)
        waits = {x.c.waits[0]: x for x in b.members}
        seen: set[fx.Node] = set()
        stack = list(inp)
        while stack:
            n = stack.pop()
            if n in seen or self.g.pos.get(n, -1) < lo:
                continue
            seen.add(n)
            if n in waits:
                return f"dependency: its input depends on the result of {waits[n].c.name}"
            stack.extend(n.all_input_nodes)
        first = min(b.members, key=lambda x: x.need)
        return (
            f"its input is ready at {self.g.nodes[max(m.ready - 1, 0)].name}, after the result of "
            f"{first.c.name} is needed at {self.g.nodes[first.need].name}"
        )

    def _price(self, b: _Bucket) -> None:
        first = b.members[0].c
        in_b = sum(x.in_bytes for x in b.members)
        out_b = sum(x.out_bytes for x in b.members)
        synth = dataclasses.replace(first, input_bytes=in_b, output_bytes=out_b)
        b.dur = float(self.est.collective(synth).time_us)
        fam = "bf16" if first.dtype in (torch.bfloat16, torch.float16) else "fp32"
        itemsize = first.dtype.itemsize if first.dtype is not None else 4
        copy = self.est.compute.estimate_cost
        b.pre = float(copy(OpCost(0, 2 * in_b, "memory", fam, in_b // itemsize)).time_us)
        if first.kind is K.ALL_GATHER:  # re-stacking copies every member's gathered block once
            b.post = sum(
                float(copy(OpCost(0, 2 * x.out_bytes, "memory", fam, x.out_bytes // itemsize)).time_us)
                for x in b.members
            )
        else:  # the results are views of the flat buffer
            b.post = 0.0

    def _delta(self, b: _Bucket) -> np.ndarray:
        """The bucket's change of the live-memory profile (simulator accounting, see docs/bucketing.md)."""
        n = len(self.g.nodes)
        d = np.zeros(n + 1)

        def add(a: int, z: int, v: float) -> None:
            a, z = max(a, 0), min(z, n - 1)
            if a <= z:
                d[a] += v
                d[z + 1] -= v

        in_b = sum(x.in_bytes for x in b.members)
        out_b = sum(x.out_bytes for x in b.members)
        add(b.issue, b.issue, in_b)  # the concatenated input, freed once issued
        ag = b.members[0].c.kind is K.ALL_GATHER
        if ag:
            add(b.issue, b.wait, out_b)  # the gathered flat buffer until the copies out
        else:  # the member results are views of one flat buffer: it lives as long as the longest
            add(b.issue, max(x.out_last for x in b.members), out_b)
        for x in b.members:
            add(x.start, x.out_last, -x.out_bytes)
            if ag:
                add(b.wait, x.out_last, x.out_bytes)
            if x.in_last < b.issue:  # the input now lives until the bucket copies it
                add(x.in_last + 1, b.issue, x.in_bytes)
            elif x.in_last == x.start and b.issue < x.start:  # ... or dies when copied, earlier
                add(b.issue + 1, x.start, -x.in_bytes)
        return np.cumsum(d)[:n]

    # -- the timeline (the simulator's execution model over the sunk order)
    def _makespan(self, buckets: list[_Bucket]) -> float:
        g = self.g
        skip = {x.c.index for b in buckets for x in b.members}
        events = [e for e in g.events if e[6] not in skip]
        for i, b in enumerate(buckets):
            stream = g.events[g.coll_events[b.members[0].c.index][0]][4]
            events.append((b.issue, 0, -1, 0, stream, (b.dur, b.pre), -(i + 1)))
            events.append((b.wait, 1, -1, 1, None, b.post, -(i + 1)))
        events.sort(key=lambda e: (e[0], e[1], e[2]))
        prefix = g.prefix
        t = 0.0
        gap0 = 0
        free: dict[Any, float] = {}
        ends: dict[int, float] = {}
        for gap, _sub, _seq, kind, stream, value, cid in events:
            t += prefix[gap] - prefix[gap0]
            gap0 = gap
            if kind == 0:  # issue
                dur, pre = value
                t += pre
                s = max(t, free.get(stream, 0.0))
                free[stream] = ends[cid] = s + dur
            else:  # wait
                end = ends.get(cid, 0.0)
                if end > t:
                    t = end
                t += value
        t += prefix[-1] - prefix[gap0]
        return max([t, *free.values()])

    # -- the real simulator, before and after rewriting
    def simulate_before(self) -> None:
        self._before = self.sim.simulate(self.g.nodes, record=False)

    def recheck(self, before_nodes: set[fx.Node]) -> Optional[str]:
        """Simulate the rewritten graph (waits at first use) with the real simulator."""
        gm = self.ctx.gm
        before = self._before
        self.sim.update([n for n in gm.graph.nodes if n not in before_nodes])

        ir = _Ctx(gm, self.cfg).ir
        after = self.sim.simulate(_sunk_order(gm, ir), record=False)
        self.summary = {
            "simulated_makespan_us": [before.makespan_us, after.makespan_us],
            "simulated_exposed_comm_us": [before.exposed_comm_us, after.exposed_comm_us],
            "simulated_peak_memory_bytes": [before.peak_memory_bytes, after.peak_memory_bytes],
            "planned_makespan_us": [self.base_makespan, self.cur_makespan],
        }
        if after.makespan_us > before.makespan_us * (1 + 1e-6) + 1e-6:
            return (
                f"the simulator prices the bucketed graph slower ({before.makespan_us:.1f} -> "
                f"{after.makespan_us:.1f} us)"
            )
        limit = before.peak_memory_bytes * (1 + self.cfg.bucket_max_memory_increase)
        if after.peak_memory_bytes > limit and after.peak_memory_bytes > before.peak_memory_bytes:
            return (
                f"simulated peak memory {before.peak_memory_bytes} -> {after.peak_memory_bytes} bytes exceeds "
                "the budget"
            )
        return None

    def describe(self, b: _Bucket) -> dict:
        return {
            "bucket": [x.c.name for x in b.members],
            "kind": b.members[0].c.kind.value,
            "group": b.members[0].c.group.name,
            "message_bytes": b.size,
            "cap_bytes": self.cap(b.members[0].c),
            "closed_by_cap": b.closed_by_cap,
            "issue_before": self.g.nodes[b.issue].name,
            "wait_before": self.g.nodes[b.wait].name,
            "predicted_us": round(b.dur, 3),
        }


def _names(b: _Bucket) -> str:
    ms = b.members
    return ms[0].c.name if len(ms) == 1 else f"{ms[0].c.name} .. {ms[-1].c.name} ({len(ms)} collectives)"


def _difference(a: Collective, b: Collective) -> str:
    if a.group.name != b.group.name:
        return f"different group ({a.group.name!r} vs {b.group.name!r})"
    if a.dtype != b.dtype:
        return f"different dtype ({a.dtype} vs {b.dtype})"
    return f"different reduce op ({a.reduce_op!r} vs {b.reduce_op!r})"


def latency_bound_cap(est: AnalyticCostModel, kind: CollectiveKind, n: int, ranks=None) -> int:
    """Smallest message size S (bytes, nccl-tests convention) with
    ``time(S) >= time(1) / LATENCY_SHARE``: from there on the latency (``time(1)``, the
    alpha term) is at most 10% of the collective's time and merging more saves little."""

    def time(s: int) -> float:
        return float(est.collectives.time(kind, s, n, ranks=ranks).time_us)

    target = time(1) / LATENCY_SHARE
    if target <= 0:
        return DEFAULT_CAP_BYTES
    lo, hi = 1, 1024
    while time(hi) < target:
        lo, hi = hi, hi * 2
        if hi > 2**42:  # no bandwidth term (a fit with beta = 0): nothing says where to stop
            return DEFAULT_CAP_BYTES
    while hi - lo > max(1, lo // 1000):
        mid = (lo + hi) // 2
        if time(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi


# ----------------------------------------------------------------- the model's graph view
def _sunk_order(gm: fx.GraphModule, ir) -> list[fx.Node]:
    """The graph's nodes with every wait moved to just before its first use, stopping at
    memory-mutating ops: the order sink_waits produces (its rules, without moving anything)."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    inplace_waits = {w for c in ir.collectives if c.inplace for w in c.waits}
    muts = [i for i, n in enumerate(nodes) if rewrite.mutates(n)]
    deferred: dict[fx.Node, list[fx.Node]] = {}
    moved: set[fx.Node] = set()
    j = 0
    for i, w in enumerate(nodes):
        if not (w.op == "call_function" and is_wait(w.target)) or w in inplace_waits or not w.users:
            continue
        target = min(w.users, key=order.__getitem__)
        while j < len(muts) and muts[j] <= i:
            j += 1
        if j < len(muts) and muts[j] < order[target]:
            target = nodes[muts[j]]
        deferred.setdefault(target, []).append(w)
        moved.add(w)
    out: list[fx.Node] = []
    for n in nodes:
        out.extend(deferred.get(n, ()))
        if n not in moved:
            out.append(n)
    return out


def _build(gm: fx.GraphModule, ir, sim: Simulator) -> _Graph:
    nodes = _sunk_order(gm, ir)
    pos = {n: i for i, n in enumerate(nodes)}
    hidden = set(ir.hidden_collectives)
    coll = {c.start: c for c in ir.collectives}
    wait_of = {w: c for c in ir.collectives for w in c.waits}
    prefix = [0.0]
    barriers = [0]
    waits: list[bool] = []
    for n in nodes:
        cost = 0.0 if (n in coll or n in wait_of or n.op != "call_function") else float(sim.cost_of(n))
        prefix.append(prefix[-1] + cost)
        barriers.append(barriers[-1] + (1 if (rewrite.mutates(n) and n not in coll) or n in hidden else 0))
        waits.append(n.op == "call_function" and is_wait(n.target))
    # live memory, the simulator's accounting (allocated when run, freed after the last use,
    # views / waits / getitem alias their source, outputs stay live)
    never = len(nodes) - 1
    owner, last = buffer_lifetimes(nodes, alias_source, never)
    # bytes as the estimator sizes them: what every rank shares (passmgr/invariance.py)
    alloc = [sim.value_bytes(n) if alias_source(n) is None and n.op != "output" else 0 for n in nodes]
    frees = np.zeros(len(nodes) + 1)
    for o, i in last.items():
        if i < never:
            frees[i + 1] += alloc[pos[o]] if o in pos else 0
    allocs = np.array(alloc, dtype=float)
    live_before = np.cumsum(allocs) - np.cumsum(frees[: len(nodes)])  # after alloc at i, before its frees
    profile = live_before
    events: list[tuple] = []
    coll_events: dict[int, list[int]] = {}
    for c in ir.collectives:
        stream = f"comm:{c.group.name}"
        idx = [len(events)]
        events.append((pos[c.start], 3, pos[c.start], 0, stream, (float(sim.cost_of(c.start)), 0.0), c.index))
        for w in c.waits:
            idx.append(len(events))
            events.append((pos[w], 2, pos[w], 1, None, 0.0, c.index))
        coll_events[c.index] = idx
    return _Graph(nodes, pos, prefix, barriers, waits, profile, owner, last, events, coll_events)


# ----------------------------------------------------------------- rewriting
def _apply(gm: fx.GraphModule, buckets: list[_Bucket], nodes: list[fx.Node]) -> None:
    """Splice every bucket (issue and wait templates), then rewire and erase the members."""
    # a member's input may be the result of a collective an earlier bucket replaced (a
    # reduce_scatter of a bucketed all_gather's result): read it from the bucket's output
    replaced: dict[fx.Node, fx.Node] = {}
    for b in sorted(buckets, key=lambda b: (b.issue, b.wait)):
        ms = b.members
        c0 = ms[0].c
        n, group = c0.group.size, c0.group.name
        xs = [replaced.get(x.c.inputs[0], x.c.inputs[0]) for x in ms]
        shapes = tuple(tuple(shape_of(x.c.start)) for x in ms)
        if c0.kind is K.ALL_GATHER:
            issue_fn, consts = _issue_ag, (n, group)
            wait_fn = _wait_ag
            wconsts = (n, tuple(math.prod(shape_of(x)) for x in xs), shapes)
        elif c0.kind is K.REDUCE_SCATTER:
            issue_fn, consts = _issue_rs, (c0.reduce_op, n, group)
            wait_fn, wconsts = _wait_flat, (tuple(math.prod(s) for s in shapes), shapes)
        else:
            issue_fn, consts = _issue_ar, (c0.reduce_op, group)
            wait_fn, wconsts = _wait_flat, (tuple(math.prod(s) for s in shapes), shapes)
        anchor_issue, anchor_wait = nodes[b.issue], nodes[b.wait]
        start = rewrite.splice(gm, issue_fn, xs, consts=consts, before=anchor_issue, meta_from=c0.start)
        outs = rewrite.splice(gm, wait_fn, [start], consts=wconsts, before=anchor_wait, meta_from=c0.waits[0])
        for x, o in zip(ms, outs, strict=True):
            x.c.waits[0].replace_all_uses_with(o)
            replaced[x.c.waits[0]] = o
    for b in buckets:
        for x in b.members:
            gm.graph.erase_node(x.c.waits[0])
            gm.graph.erase_node(x.c.start)
