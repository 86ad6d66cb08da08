"""workload_partition: chunk a collective together with the compute chained to it.

Contract
- Matches: every functional all_gather, reduce_scatter and all_reduce (not coalesced,
  not in place, one wait, static shapes, a group of >= 2 ranks, input never written in
  place) of a forward / backward / inference graph, and the chain of compute that
  depends on its result (*consumer* chain) or that produces its input (*producer*
  chain), found by :mod:`commfuse.analysis.chains` along a dim every op of the chain can be cut along
  (dimension types OD / CD / ND of :mod:`commfuse.ir.dims`, Centauri Table 3).
- Does: cuts the collective into k chunk collectives on the same group along that dim
  (k = ``Config.workload_chunks``, or Centauri's Algorithm 1 count when that is None —
  :mod:`commfuse.analysis.chunking`; at most ``Config.max_chunks``), and the chain into k
  chunk chains. Chunks are even, except when a caller passes a granularity
  (``plan_workload_partition(..., granularity=...)``: the partition search, with Algorithm
  1's fractions for a group-partitioned collective): then every value of the chain is cut
  into U equal units and chunk i takes ``units[i]`` adjacent ones of each block, so the
  uneven cut is valid wherever the even cut into U chunks is (whole rank pieces per chunk
  collective); units that no chain divides are rounded to fewer, and when no uneven
  rounding divides, the cut is even; the plan's ``note`` says which. Order:
  consumer: ``start_0 .. start_{k-1}`` where the collective started, then for each
  chunk ``wait_i -> chain_i`` where the chain's inputs are ready, so chunk i's compute
  runs while chunks i+1.. are in flight; producer: ``chain_i -> start_i`` for each
  chunk where the collective started (chunk i is on the wire while chunk i+1 is
  computed), then the waits where the collective was waited. Every value of the chain
  used outside it is reassembled in its original layout: contiguous chunks are
  concatenated, rank-interleaved chunks (all_gather along its gather dim) permuted
  back, partial sums (a matmul cut along its contraction dim, a sum/mean over the cut
  dim) added (addmm's bias in chunk 0 only; mean divided by k, or, uneven, each chunk's
  mean weighted by its share of the units). Data layouts: see
  docs/centauri-workload-partition.md. ``decisions``: one per cut collective, with the
  chunk sizes along the cut dim.
- Choice (Centauri §3.1): for each direction and each dim the maximal chain; prefer the
  chains whose estimated compute (the topology's cost model, ``passmgr/cost.py``) is at
  least the collective's estimated time, among them the longest; if none covers it
  (or no topology is known), the chain with the most compute. Ties: no partial sum,
  no interleaving, consumer before producer, lower dim.
- Guarantees: values equal to the unoptimised program up to floating-point rounding
  (partial sums are added in another order; a matmul kernel run on a chunk may block its
  sums differently than on the whole); the chunk collectives move exactly the bytes
  the collective moved; decisions depend only on the graph, the config and the topology
  (same on every rank), and every rank issues the chunks in the same order; no process
  group is created.
- Leaves alone (reported, one line per collective): all_to_all (not implemented) and
  other kinds; collectives with no dim whose size the chunk count divides (times the
  group size along a gather/scatter dim); chains with no compute op (the first op is
  non-splittable along every dim, e.g. a softmax over the only divisible dim, or
  nothing but views and graph outputs follow).

Stage: SCHEDULE (partitioned forward and backward graphs). The rewrite changes how the
communication is cut and ordered against compute, not what is communicated or saved
for backward (every value the backward reads is reassembled), and overlap is decided
in these graphs, which run one after the other. In the joint graph the backward reads
forward values (the gathered weight of a SimpleFSDP layer, the matmul output GeLU's
backward needs), the partitioner may recompute or reorder chunks, and a chain could
mix forward and backward ops; the Centauri partition search (``partition_search``) that
composes this pass with the primitive and group partitions runs at this stage too.

Source: Centauri (ASPLOS '24) §3.1 "workload partition" and Table 3 (dimension types).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from commfuse.analysis import chains, chunking
from commfuse.analysis.chains import CONSUMER, PRODUCER, Chain, ChainStep, GraphFacts, Partial, Split
from commfuse.analysis.chunking import independent_compute_us, operation_level_plan
from commfuse.core.torch_private import c10d_functional
from commfuse.costmodel.compute import op_cost
from commfuse.ir import rewrite
from commfuse.ir.collective import Collective
from commfuse.ir.kinds import CollectiveKind
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import Analysis, PassContext

_f = c10d_functional
aten = torch.ops.aten
SUPPORTED = (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE)
FACTS: Analysis[GraphFacts] = Analysis("workload_partition_facts", lambda ctx: GraphFacts.of(ctx.gm))


@dataclass(frozen=True)
class WorkloadPlan:
    """How one collective is cut: pure data (apply re-derives the chain and checks it matches)."""

    collective: str
    kind: str
    direction: str  # "consumer" (the chain reads the result) or "producer" (the chain computes the input)
    dim: int  # dim of the collective's logical input/output the chunks are cut along
    chunks: int
    chain: tuple[str, ...]  # chain node names, graph order
    reduction: bool  # the chain ends in a partial sum whose chunks are added
    interleaved: bool  # chunks are rank-interleaved (cut along the gather/scatter dim)
    compute_us: Optional[float]  # estimated compute of the chain (None: no topology)
    comm_us: Optional[float]  # estimated time of the collective (None: no topology)
    # Uneven chunks: chunk i holds sizes[i] of sum(sizes) equal units of the cut dim (None: even).
    sizes: Optional[tuple[int, ...]] = None
    # Elements of the collective's logical output along ``dim`` in each chunk.
    extents: tuple[int, ...] = ()
    note: str = ""  # how a requested granularity was rounded, or why it fell back to even chunks

    @property
    def units(self) -> int:
        """The number of equal units the chain is cut into (= chunks when even)."""
        return sum(self.sizes) if self.sizes else self.chunks

    def describe(self) -> str:
        cost = ""
        if self.compute_us is not None and self.comm_us is not None:
            cost = f", chain {self.compute_us:.1f} us vs collective {self.comm_us:.1f} us"
        extra = "".join(
            [
                ", partial sums added" if self.reduction else "",
                ", rank-interleaved" if self.interleaved else "",
            ]
        )
        sizes = f" of sizes {list(self.extents)}" if self.extents else ""
        if self.sizes:
            sizes += f" (uneven, {':'.join(map(str, self.sizes))})"
        note = f"; {self.note}" if self.note else ""
        return (
            f"{self.collective}: {self.chunks} chunks{sizes} along dim {self.dim} with a {self.direction} "
            f"chain of {len(self.chain)} ops{extra}{cost}{note}"
        )


# ---------------------------------------------------------------------------- planning
def cuttable_reason(c: Collective) -> Optional[str]:
    """Why no rewrite can cut ``c`` into chunk collectives, whatever its kind (None: it can be)."""
    if c.coalesced or c.inplace:
        return "coalesced or in-place collective"
    if len(c.waits) != 1 or c.logical_output is None or c.logical_input is None:
        return "not exactly one wait / layout not recognised"
    if c.group.size is None or c.group.size < 2:
        return "group of fewer than two ranks (or size unknown)"
    if not isinstance(c.start.meta.get("val"), torch.Tensor):
        return "graph has no fake tensor metadata (meta['val'])"
    return None


def _why_not(ctx: PassContext, c: Collective) -> Optional[str]:
    if c.kind is CollectiveKind.ALL_TO_ALL:
        return (
            "all_to_all: not implemented here (an MoE dispatch -> expert compute -> combine exchange is cut by "
            "expert_exchange_partition)"
        )
    if c.kind not in SUPPORTED:
        return f"{c.kind.value} is not partitioned (all_gather, reduce_scatter, all_reduce only)"
    why = cuttable_reason(c)
    if why is not None:
        return why
    facts = _facts(ctx)
    if c.logical_input in facts.mutated or c.inputs[0] in facts.mutated or c.logical_output in facts.mutated:
        return "its input or result is written in place"
    return None


def _facts(ctx: PassContext) -> GraphFacts:
    return ctx.get(FACTS)


DEFAULT_CHUNKS = 2  # without a topology Algorithm 1 has no costs to decide with


def _chunk_count(ctx: PassContext, chunks: Optional[int]) -> int:
    k = ctx.config.workload_chunks if chunks is None else int(chunks)
    return min(DEFAULT_CHUNKS if k is None else k, ctx.config.max_chunks)


def operation_level_chunks(ctx: PassContext, c: Collective) -> tuple[Optional[int], str]:
    """Centauri's Algorithm 1 count for ``c`` (None: no partition), and why."""

    est = ctx.cost.model
    if est is None:
        return DEFAULT_CHUNKS, f"no topology: {DEFAULT_CHUNKS} chunks"
    probe = _best_chain(ctx, c, DEFAULT_CHUNKS)
    comp = probe[0].compute_us if not isinstance(probe, str) and probe[0].compute_us is not None else 0.0
    comm = est.collective(c).time_us
    plan = operation_level_plan(
        comp, comm, independent_compute_us(ctx.gm, ctx.ir, c, est), ctx.config.max_chunks
    )
    return (plan.num_chunks if plan.num_chunks > 1 else None), plan.why


def candidate_chains(ctx: PassContext, c: Collective, k: int) -> tuple[list[Chain], list[str]]:
    """Every (direction, dim) chain of ``c`` for ``k`` chunks, and why the others failed."""
    ir = ctx.ir
    facts = _facts(ctx)
    rank = len(chains.static_shape(c.logical_output) or ())
    found, reasons = [], []
    for direction in (CONSUMER, PRODUCER):
        if direction == PRODUCER:
            why = chains.producer_precheck(c, facts)
            if why:
                reasons.append(f"producer: {why}")
                continue
        for dim in range(rank):
            ch = chains.build_chain(c, direction, dim, k, ir.dims, facts, ir.backward_nodes)
            if isinstance(ch, str):
                reasons.append(f"{direction} dim {dim}: {ch}")
            else:
                found.append(ch)
    return found, reasons


def _summarise(reasons: list[str], k: int, shape) -> str:
    per_dim = [r for r in reasons if not r.startswith("producer: ")]
    whole = [r for r in reasons if r.startswith("producer: ")]
    if per_dim and all("not divisible" in r for r in per_dim):
        per_dim = [f"no dim of {list(shape)} is divisible by {k} chunks"]
    return "; ".join(dict.fromkeys(per_dim + whole))


def plan_workload_partition(
    ctx: PassContext,
    c: Collective,
    chunks: Optional[int] = None,
    granularity: Optional[Sequence[float]] = None,
) -> WorkloadPlan | str:
    """The best workload partition of ``c`` into ``chunks`` (default ``Config.workload_chunks``;
    when that is None, Centauri's Algorithm 1 count, lowered until a chain divides; at most
    ``Config.max_chunks``), or why there is none. ``granularity``: uneven chunks instead, in
    these proportions (Algorithm 1's fractions for a group-partitioned collective), rounded to
    what the chain's shapes allow (see ``_planned_uneven``). Pure: the graph is not changed."""
    best = _planned_uneven(ctx, c, granularity) if granularity is not None else _planned_chain(ctx, c, chunks)
    return best if isinstance(best, str) else best[0]


# More units than this would cut a chunk finer than any real shape divides.
MAX_UNITS = 64


def _fmt(units: Sequence[int]) -> str:
    return ":".join(map(str, units))


def _planned_uneven(
    ctx: PassContext, c: Collective, granularity: Sequence[float]
) -> tuple[WorkloadPlan, Chain] | str:
    """Chunks in the proportions ``granularity``. Every value of a chain is cut into ``U`` equal
    units (the layout rules and divisibility of ``U`` even chunks) and chunk i takes ``units[i]``
    adjacent ones, so an uneven cut is valid wherever the even cut into ``U`` is: each chunk
    collective gets whole rank pieces (a reduce_scatter chunk stays divisible by the group size).
    The exact proportions are tried first, then coarser roundings (fewer units); when none
    divides, or rounding leaves them equal, the cut falls back to as many even chunks, and the
    plan's ``note`` says why."""
    weights = [float(g) for g in granularity]
    k = len(weights)
    if k < 2 or any(not w > 0 for w in weights):
        return f"granularity {list(granularity)}: needs two or more positive parts"
    if k > ctx.config.max_chunks:
        return f"granularity of {k} chunks exceeds max_chunks={ctx.config.max_chunks}"
    if len(set(weights)) == 1:
        return _best_chain(ctx, c, k)
    candidates = chunking.rounded_units(weights, MAX_UNITS)
    exact = candidates[0] if candidates else None
    first_why = None
    for units in candidates:
        best = _best_chain(ctx, c, None, sizes=units)
        if not isinstance(best, str):
            plan, chain = best
            if units != exact:
                plan = replace(
                    plan,
                    note=f"granularity {_fmt(exact)} rounded to {_fmt(units)} "
                    f"({sum(exact)} units: {first_why})",
                )
            return plan, chain
        first_why = first_why or best
    want = _fmt(exact) if exact else ", ".join(f"{w:.3g}" for w in weights)
    why = first_why or f"no rounding to at most {MAX_UNITS} units keeps it uneven"
    best = _best_chain(ctx, c, k)
    if isinstance(best, str):
        return f"granularity {want}: {why}; {k} even chunks: {best}"
    plan, chain = best
    return replace(plan, note=f"granularity {want} not applied ({why}): {k} even chunks"), chain


def _planned_chain(
    ctx: PassContext, c: Collective, chunks: Optional[int]
) -> tuple[WorkloadPlan, Chain] | str:
    if chunks is not None or ctx.config.workload_chunks is not None:
        return _best_chain(ctx, c, chunks)
    k, why = operation_level_chunks(ctx, c)
    if k is None:
        return f"Algorithm 1: {why}"
    first = None
    for kk in range(k, 1, -1):
        best = _best_chain(ctx, c, kk)
        if not isinstance(best, str):
            return best
        first = first or best
    return f"Algorithm 1 ({why}): {first}"


def _best_chain(
    ctx: PassContext, c: Collective, chunks: Optional[int], sizes: Optional[tuple[int, ...]] = None
) -> tuple[WorkloadPlan, Chain] | str:
    # Uneven: the chain is cut into sum(sizes) units (max_chunks bounds the chunks, not the units).
    k = sum(sizes) if sizes else _chunk_count(ctx, chunks)
    if k < 2:
        return "one chunk: nothing to partition"
    why = _why_not(ctx, c)
    if why:
        return why
    found, reasons = candidate_chains(ctx, c, k)
    if not found:
        return _summarise(reasons, k, chains.static_shape(c.logical_output))

    est = ctx.cost.model
    comm_us = est.collective(c).time_us if est is not None else None

    def score(ch: Chain) -> tuple:
        nodes = [s.node for s in ch.steps]
        compute = sum(est.compute_time_us(n) for n in nodes) if est is not None else None
        flops = sum(op_cost(n).flops for n in nodes if ctx.cost.prices(n))  # only what every rank shares
        size = compute if compute is not None else float(flops)
        covers = compute is not None and comm_us is not None and compute >= comm_us
        n_ops = len(ch.compute_nodes)
        main = (1, n_ops, size) if covers else (0, size, n_ops)
        tie = (
            not ch.reduction,
            ch.in_split.blocks == 1 and ch.out_split.blocks == 1,
            ch.direction == CONSUMER,
            -ch.dim,
        )
        return main + tie, compute

    best = max(found, key=lambda ch: score(ch)[0])
    units = sizes or (1,) * k
    length = chains.static_shape(c.logical_output)[best.dim]
    return WorkloadPlan(
        collective=c.name,
        kind=c.kind.value,
        direction=best.direction,
        dim=best.dim,
        chunks=len(units),
        chain=best.node_names,
        reduction=best.reduction,
        interleaved=best.in_split.blocks > 1 or best.out_split.blocks > 1,
        compute_us=score(best)[1],
        comm_us=comm_us,
        sizes=tuple(sizes) if sizes else None,
        extents=tuple(length // k * u for u in units),
    ), best


# ---------------------------------------------------------------------------- rewriting
# Nodes are emitted one by one with their fake values computed in the graph's fake mode
# (detected once per rewrite), not spliced from traced templates: templates copied from one
# cache entry share fake tensor objects, which make_fx would take for a single input when a
# later template reads several of them, and detecting the mode per splice scans the graph.
class _Builder:
    def __init__(self, gm: fx.GraphModule, mode: Any, before: fx.Node) -> None:
        self.gm, self.mode, self.before = gm, mode, before

    def _fake(self, target: Callable, args: tuple, kwargs: dict) -> Any:
        def val(a):
            return a.meta["val"] if isinstance(a, fx.Node) else a

        with self.mode:
            return target(*fx.node.map_aggregate(args, val), **fx.node.map_aggregate(kwargs, val))

    def call(
        self, target: Callable, args: tuple, meta_from: fx.Node, kwargs: Optional[dict] = None
    ) -> fx.Node:
        kwargs = kwargs or {}
        try:
            value = self._fake(target, args, kwargs)
        except RuntimeError:
            if target is not aten.view.default:
                raise
            # A chunk may not be viewable where the whole value was (a slice along an inner
            # dim): copy it first, as reshape would.
            args = (self.contiguous(args[0], meta_from, force=True), *args[1:])
            value = self._fake(target, args, kwargs)
        with self.gm.graph.inserting_before(self.before):
            node = self.gm.graph.call_function(target, args, kwargs)
        node.meta["val"] = value
        rewrite.inherit_meta(meta_from, node)
        return node

    def contiguous(self, x: fx.Node, meta_from: fx.Node, force: bool = False) -> fx.Node:
        if not force and x.meta["val"].is_contiguous():
            return x
        return self.call(aten.clone.default, (x,), meta_from, {"memory_format": torch.contiguous_format})

    def pieces(self, x: fx.Node, n: int, dim: int, meta_from: fx.Node) -> list[fx.Node]:
        """The n equal pieces of x along dim (split + getitems, as DTensor's shuffles)."""
        parts = self.call(aten.split.Tensor, (x, x.meta["val"].shape[dim] // n, dim), meta_from)
        out = []
        for j in range(n):
            with self.gm.graph.inserting_before(self.before):
                g = self.gm.graph.call_function(operator.getitem, (parts, j))
            g.meta["val"] = parts.meta["val"][j]
            rewrite.inherit_meta(meta_from, g)
            out.append(g)
        return out

    def take_chunk(
        self, x: fx.Node, split: Split, sizes: tuple[int, ...], i: int, meta_from: fx.Node
    ) -> fx.Node:
        """Chunk i of x (layout :class:`chains.Split` over ``sum(sizes)`` units; chunk i takes
        ``sizes[i]`` adjacent units of every block)."""
        shape = list(x.meta["val"].shape)
        d, size, units = split.dim, shape[split.dim], sum(sizes)
        lo, u, blocks = sum(sizes[:i]), sizes[i], split.blocks
        q = size // (blocks * units)
        if blocks == 1:
            return self.call(aten.slice.Tensor, (x, d, lo * q, (lo + u) * q), meta_from)
        grid = self.call(aten.view.default, (x, shape[:d] + [blocks, units, q] + shape[d + 1 :]), meta_from)
        if u == 1:
            piece = self.call(aten.select.int, (grid, d + 1, lo), meta_from)
        else:
            piece = self.call(aten.slice.Tensor, (grid, d + 1, lo, lo + u), meta_from)
        piece = self.contiguous(piece, meta_from)
        return self.call(aten.view.default, (piece, shape[:d] + [blocks * u * q] + shape[d + 1 :]), meta_from)

    def start(self, x: fx.Node, c: Collective, meta_from: fx.Node) -> fx.Node:
        """Issue c on one chunk of its logical input (DTensor's shuffle for a reduce_scatter
        along dim != 0); returns the un-waited result."""
        n, group, g = c.group.size, c.group.name, c.logical_dim or 0
        if c.kind is CollectiveKind.REDUCE_SCATTER and g != 0:
            x = self.call(aten.cat.default, (self.pieces(x, n, g, meta_from), 0), meta_from)
        x = self.contiguous(x, meta_from)
        if c.kind is CollectiveKind.ALL_GATHER:
            return self.call(_f.all_gather_into_tensor.default, (x, n, group), meta_from)
        if c.kind is CollectiveKind.REDUCE_SCATTER:
            return self.call(_f.reduce_scatter_tensor.default, (x, c.reduce_op, n, group), meta_from)
        return self.call(_f.all_reduce.default, (x, c.reduce_op, group), meta_from)

    def finish(self, started: fx.Node, c: Collective, meta_from: fx.Node) -> fx.Node:
        """Wait for one chunk (and DTensor's shuffle for an all_gather along dim != 0)."""
        out = self.call(_f.wait_tensor.default, (started,), meta_from)
        g = c.logical_dim or 0
        if c.kind is CollectiveKind.ALL_GATHER and g != 0:
            out = self.call(aten.cat.default, (self.pieces(out, c.group.size, 0, meta_from), g), meta_from)
        return out

    def reassemble(
        self, parts: list[fx.Node], layout: Split | Partial, sizes: tuple[int, ...], original: fx.Node
    ) -> fx.Node:
        """The whole value whose chunks (of ``sizes`` units) are ``parts``, laid out in memory as
        ``original``: concatenated (contiguous chunks), stacked (even) or concatenated per block
        (uneven) and flattened (rank-interleaved chunks), or added (partial sums; the mean of k
        even chunks divided by k, of uneven ones each weighted by its share of the units)."""
        k, units, even = len(parts), sum(sizes), len(set(sizes)) == 1
        if isinstance(layout, Partial):
            if layout.how == "mean" and not even:  # a chunk's mean covers sizes[i] / units of the rows
                parts = [
                    self.call(aten.mul.Tensor, (p, u / units), original)
                    for p, u in zip(parts, sizes, strict=True)
                ]
            whole = parts[0]
            for p in parts[1:]:
                whole = self.call(aten.add.Tensor, (whole, p), original)
            if layout.how == "mean" and even:
                whole = self.call(aten.div.Tensor, (whole, k), original)
            return self.with_layout_of(whole, original)
        # Concatenate in the original's memory order (outermost dim first), so that the
        # result has its strides without another copy.
        order = _dim_order(original.meta["val"])
        permuted = order != sorted(order)
        if permuted:
            parts = [self.call(aten.permute.default, (p, order), original) for p in parts]
        d, blocks = order.index(layout.dim), layout.blocks
        if blocks == 1:
            whole = self.call(aten.cat.default, (list(parts), d), original)
        else:
            pieces = []
            for p in parts:
                shape = list(p.meta["val"].shape)
                pieces.append(
                    self.call(
                        aten.view.default,
                        (p, shape[:d] + [blocks, shape[d] // blocks] + shape[d + 1 :]),
                        original,
                    )
                )
            if even:
                stacked = self.call(aten.stack.default, (pieces, d + 1), original)
                full = list(stacked.meta["val"].shape)
                whole = self.call(
                    aten.view.default,
                    (stacked, full[:d] + [full[d] * full[d + 1] * full[d + 2]] + full[d + 3 :]),
                    original,
                )
            else:  # block b of the whole is block b of chunk 0, then of chunk 1, ...
                grid = self.call(aten.cat.default, (pieces, d + 1), original)
                full = list(grid.meta["val"].shape)
                whole = self.call(
                    aten.view.default, (grid, full[:d] + [full[d] * full[d + 1]] + full[d + 2 :]), original
                )
        if permuted:
            whole = self.call(
                aten.permute.default, (whole, [order.index(i) for i in range(len(order))]), original
            )
        return self.with_layout_of(whole, original)

    def with_layout_of(self, whole: fx.Node, original: fx.Node) -> fx.Node:
        """``whole`` with ``original``'s strides. Users outside the chain keep their metadata,
        and views among them only work on the strides they were traced with (a value computed
        from a transposed tensor keeps that order; a plain cat of its chunks would not)."""
        want = original.meta["val"]
        if _same_strides(whole.meta["val"], want):
            return whole
        order = _dim_order(want)
        p = self.call(aten.permute.default, (whole, order), original)
        dense = self.contiguous(p, original, force=True)
        out = self.call(aten.permute.default, (dense, [order.index(d) for d in range(want.dim())]), original)
        if not _same_strides(out.meta["val"], want):
            raise RuntimeError(
                f"workload_partition: cannot give the reassembled {original.name} its strides "
                f"{tuple(want.stride())}"
            )
        return out


def _dim_order(val: torch.Tensor) -> list[int]:
    """Dims from outermost to innermost in memory (ties, i.e. size-1 dims, in dim order)."""
    return sorted(range(val.dim()), key=lambda d: (-val.stride()[d], d))


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    return tuple(a.shape) == tuple(b.shape) and all(
        sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape, strict=True) if n > 1
    )


class _Emitter(_Builder):
    """Emits chunk copies of chain steps before one anchor node."""

    def __init__(self, gm: fx.GraphModule, mode: Any, sizes: tuple[int, ...], before: fx.Node) -> None:
        super().__init__(gm, mode, before)
        self.sizes = sizes
        self._slices: dict[tuple[fx.Node, Split, int], fx.Node] = {}

    def side(self, a: fx.Node, split: Optional[Split], i: int, meta_from: fx.Node) -> fx.Node:
        if split is None:
            return a
        key = (a, split, i)
        if key not in self._slices:
            self._slices[key] = self.take_chunk(a, split, self.sizes, i, meta_from)
        return self._slices[key]

    def replay(self, step: ChainStep, env: dict[fx.Node, fx.Node], i: int) -> fx.Node:
        n = step.node
        args = list(n.args)
        for pos, a in enumerate(n.args):
            if isinstance(a, fx.Node):
                args[pos] = env[a] if a in env else self.side(a, step.args.get(pos), i, n)
        target = n.target
        if target in chains.SIZED:
            shape = list(chains.static_shape(n))
            shape[step.out.dim] = shape[step.out.dim] // sum(self.sizes) * self.sizes[i]
            args[1] = shape
        if isinstance(step.out, Partial) and target is aten.addmm.default and i > 0:
            target, args = aten.mm.default, args[1:3]  # the bias belongs to one chunk only
        return self.call(target, tuple(args), n, dict(n.kwargs))


def _erase(gm: fx.GraphModule, c: Collective, chain: Chain) -> None:
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    roots = [c.start, *c.waits, *c.layout_nodes, c.logical_output, *(s.node for s in chain.steps)]
    rewrite.erase_dead(gm, sorted(set(roots), key=pos.__getitem__))  # pops from the end: last first
    if any(not getattr(n, "_erased", False) for n in (c.start, *c.waits)):
        raise RuntimeError(f"workload_partition: {c.name} still has users after its chain was rewritten")


def _sizes(chain: Chain, sizes: Optional[tuple[int, ...]]) -> tuple[int, ...]:
    sizes = tuple(sizes) if sizes else (1,) * chain.chunks
    if sum(sizes) != chain.chunks:
        raise ValueError(f"chunk sizes {list(sizes)} do not add up to the chain's {chain.chunks} units")
    return sizes


def _emit_consumer(
    gm: fx.GraphModule, mode: Any, chain: Chain, sizes: Optional[tuple[int, ...]] = None
) -> list[fx.Node]:
    c, sizes = chain.collective, _sizes(chain, sizes)
    k = len(sizes)
    head = _Builder(gm, mode, c.start)
    starts = [
        head.start(head.take_chunk(c.logical_input, chain.in_split, sizes, i, c.start), c, c.start)
        for i in range(k)
    ]
    inside = {chain.root, *(s.node for s in chain.steps)}
    em = _Emitter(gm, mode, sizes, chain.anchor.next)
    envs = []
    for i in range(k):
        env = {chain.root: em.finish(starts[i], c, c.waits[0])}
        for step in chain.steps:
            env[step.node] = em.replay(step, env, i)
        envs.append(env)
    layouts = {chain.root: chain.out_split, **{s.node: s.out for s in chain.steps}}
    for v in chain.outputs:
        whole = em.reassemble([env[v] for env in envs], layouts[v], sizes, v)
        v.replace_all_uses_with(whole, delete_user_cb=lambda u: u not in inside)
    _erase(gm, c, chain)
    return starts


def _emit_producer(
    gm: fx.GraphModule, mode: Any, chain: Chain, sizes: Optional[tuple[int, ...]] = None
) -> list[fx.Node]:
    c, sizes = chain.collective, _sizes(chain, sizes)
    k = len(sizes)
    em = _Emitter(gm, mode, sizes, c.start)
    starts = []
    for i in range(k):
        env: dict[fx.Node, fx.Node] = {}
        for step in chain.steps:
            env[step.node] = em.replay(step, env, i)
        starts.append(em.start(env[chain.root], c, c.start))
    tail = _Builder(gm, mode, c.waits[0])
    parts = [tail.finish(s, c, c.waits[0]) for s in starts]
    whole = tail.reassemble(parts, chain.out_split, sizes, c.logical_output)
    c.logical_output.replace_all_uses_with(whole)
    _erase(gm, c, chain)
    return starts


def apply_workload_partition(ctx: PassContext, c: Collective, plan: WorkloadPlan) -> list[fx.Node]:
    """Rewrite ``ctx.gm`` as ``plan`` says; returns the chunk collectives' start nodes in graph
    order. No lint/recompile (the caller does it); raises ValueError if the plan does not
    match the graph (e.g. it was made on another graph version)."""
    if plan.collective != c.name:
        raise ValueError(f"plan is for {plan.collective}, not {c.name}")
    chain = chains.build_chain(
        c, plan.direction, plan.dim, plan.units, ctx.ir.dims, _facts(ctx), ctx.ir.backward_nodes
    )
    if isinstance(chain, str) or chain.node_names != plan.chain:
        got = chain if isinstance(chain, str) else list(chain.node_names)
        raise ValueError(
            f"plan for {c.name} does not match the graph: planned {list(plan.chain)}, found {got}"
        )
    emit = _emit_consumer if chain.direction == CONSUMER else _emit_producer
    return emit(ctx.gm, rewrite.fake_mode_of(ctx.gm), chain, plan.sizes)


class WorkloadPartition(GraphPass):
    __doc__ = __doc__
    name = "workload_partition"
    stage = Stage.SCHEDULE
    # Workload partition chunks a collective together with the matmul / element-wise chain that
    # reads its result or computes its input, in the families that put matmul chains after gathers
    # (tp_mlp, sp_block, fsdp_linear) and before all_reduces / reduce_scatters. A chain cut along a
    # contraction dim adds partial sums, and a matmul on a chunk of rows takes another kernel path
    # than on all rows: tolerance compare, scaled by each output's magnitude (seed 1: 1 of 188
    # rewritten programs flagged with values ~10^2; equal to the unchunked program to 1e-14 in float64).
    fuzz = FuzzSpec(generators=("tp", "sp", "fsdp", "mixed"), scaled_tolerance=True)

    def run(self, ctx: PassContext) -> PassResult:
        counts = {
            "collectives_partitioned": 0,
            "chunk_collectives": 0,
            "chain_ops": 0,
            "consumer_chains": 0,
            "producer_chains": 0,
            "partial_sums": 0,
        }
        refusals: list[str] = []
        decisions: list[dict] = []
        pending = [c.name for c in ctx.ir.collectives]
        # Rounds: plan every pending collective on one IR, apply them in graph order, and
        # defer (to the next round, re-planned on the rewritten graph) any whose plan reads a
        # node an earlier rewrite of the round erased, rewired or gave new users. Rebuilding
        # the IR after every rewrite instead would make the pass quadratic in graph size.
        while pending:
            by_name = {c.name: c for c in ctx.ir.collectives}
            planned = []
            for name in pending:
                best = _planned_chain(ctx, by_name[name], None)
                if isinstance(best, str):
                    refusals.append(f"{name}: not partitioned: {best}")
                else:
                    planned.append((by_name[name], *best))
            mode = rewrite.fake_mode_of(ctx.gm)
            erased: set[fx.Node] = set()  # erased by this round's rewrites
            rewired: set[fx.Node] = set()  # whose inputs this round's rewrites replaced
            used: set[fx.Node] = set()  # given new users (slices) by this round's rewrites
            deferred = []
            for c, plan, chain in planned:
                fp = _footprint(c, chain)
                if fp.erased & (erased | rewired | used) or fp.kept & erased:
                    deferred.append(c.name)
                    continue
                erased |= fp.erased
                rewired |= fp.rewired
                used |= fp.side | {c.logical_input}
                emit = _emit_consumer if chain.direction == CONSUMER else _emit_producer
                starts = emit(ctx.gm, mode, chain, plan.sizes)
                counts["collectives_partitioned"] += 1
                counts["chunk_collectives"] += len(starts)
                counts["chain_ops"] += len(plan.chain)
                counts[f"{plan.direction}_chains"] += 1
                counts["partial_sums"] += int(plan.reduction)
                decisions.append(plan_decision(plan))
            ctx.invalidate()
            if len(deferred) == len(pending):  # cannot happen (the first plan never conflicts): stop anyway
                break
            pending = deferred
        changed = counts["collectives_partitioned"] > 0
        if changed:
            ctx.gm.graph.lint()
            ctx.gm.recompile()
        return PassResult(changed=changed, counts=counts, refusals=refusals, decisions=decisions)


def plan_decision(plan: WorkloadPlan) -> dict:
    """The report's record of one applied plan: the cut and the chunk sizes it chose."""
    return {
        "collective": plan.collective,
        "kind": plan.kind,
        "direction": plan.direction,
        "dim": plan.dim,
        "chunks": plan.chunks,
        "sizes": list(plan.extents),
        "granularity": _fmt(plan.sizes) if plan.sizes else "even",
        "decision": plan.describe(),
    }


@dataclass
class _Footprint:
    """What a rewrite changes, and what its plan assumes about nodes other rewrites may change."""

    erased: set[fx.Node]  # erased by the rewrite (must not have been touched at all)
    rewired: set[fx.Node]  # outside users whose inputs it replaces
    side: set[fx.Node]  # the chain's side inputs (sliced: new users)
    kept: set[fx.Node]  # must still exist: side inputs, outside users, the input, the anchor


def _footprint(c: Collective, chain: Chain) -> _Footprint:
    inside = {s.node for s in chain.steps}
    erased = {c.start, *c.waits, *c.layout_nodes, c.logical_output, *inside}
    if chain.direction == CONSUMER:
        inside.add(chain.root)
        rewired = {u for v in chain.outputs for u in v.users if u not in inside}
    else:
        rewired = set(c.logical_output.users)
    side = {a for s in chain.steps for a in s.node.all_input_nodes if a not in inside}
    kept = side | rewired | {c.logical_input} | ({chain.anchor} if chain.anchor is not None else set())
    return _Footprint(erased, rewired, side, kept)
