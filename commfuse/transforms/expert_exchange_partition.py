"""expert_exchange_partition: chunk an MoE expert exchange (dispatch all_to_all, expert compute,
combine all_to_all) so that one chunk's exchange runs under another chunk's expert compute.

Contract
- Matches: a *dispatch* all_to_all, the chain of compute that reads its result (found by
  :mod:`commfuse.analysis.chains`, dimension types of :mod:`commfuse.ir.dims`), and the first
  later *combine* all_to_all on the same group whose input that chain computes. Both
  all_to_alls have equal, static splits (capacity dispatch: ``extra["equal_splits"]`` and
  not ``extra["rank_local_sizes"]``), are not coalesced or in place, have one wait, static
  shapes, a group of >= 2 ranks, and no input or result written in place. The cut: a dim
  that is neither the exchange's split nor its concat dim (contiguous chunks), or, for an
  exchange that splits and concatenates the same dim (``all_to_all_single``'s dim 0), that
  dim in ``blocks`` of a multiple of the group size, each block cut into k (every rank
  piece gets its share of every chunk; in the MoE block's flat ``[experts * capacity, dim]``
  buffer, blocks = experts cuts the capacity slots of every expert). The chain must carry
  the cut from the dispatch's output to the combine's input with chunks independent:
  expert matmuls (bmm over experts) contract over the hidden dim, activations are
  element-wise, views follow the cut. Among the cuts whose chain reaches a combine: the most
  compute ops, then no side input (expert weight) sliced, then no partial sums, then the
  fewest blocks, then the lowest dim.
- Does: cuts both exchanges and the chain into k chunks: ``dispatch_0 .. dispatch_{k-1}``
  issued where the dispatch was; where the chain's inputs are ready, for each chunk
  ``wait(dispatch_i) -> chain_i -> issue combine_i``; the combine chunks are waited where
  the combine was and its result is reassembled in the original layout (concatenated along
  the cut, blocks interleaved back). So chunk i's combine and chunk i+1's dispatch are on
  the wire while chunk i+1 / i is computed. Values of the chain used elsewhere (activations
  saved for backward, weight gradients) are reassembled as ``workload_partition`` does
  (partial sums of a weight gradient's contraction over tokens are added). k =
  ``Config.workload_chunks`` if set; else Centauri's Algorithm 1
  (:func:`commfuse.analysis.chunking.operation_level_plan`: the exchange's estimated time,
  dispatch plus combine, over the independent compute around the dispatch, via ``ctx.cost``)
  bounds it, and among 2..that count (those the shapes divide) the one whose chunk pipeline
  (:func:`pipeline_us`, chunk exchanges priced by the topology's collective model) is
  predicted fastest is taken, since Algorithm 1 does not price the per-chunk launch and
  latency that dominate a small exchange (the span includes putting the chain's values used
  elsewhere back together, :func:`reassembly_us`, under the last combines); without a
  topology 2 chunks (torchtitan
  graph_trainer's fixed split); at most ``Config.max_chunks``, lowered until the shapes
  divide. Chunks are even, except on a group spanning nodes whose intra- and inter-node
  sub-groups ``commfuse.setup`` created: there Algorithm 1 is also run as for the two-level
  exchange (:func:`two_level_granularity`: ``group_partition``'s level times of both
  all_to_alls), and when its granularity is uneven (``2:1:1`` on 2 nodes x 2, ``4:1:3`` on
  2 x 4) every block of the cut is split into ``U`` equal units and chunk i takes ``u_i`` of
  each (whole capacity slots of every expert, so every chunk exchange is still an
  equal-split all_to_all), rounded as ``workload_partition`` rounds (coarser units when the
  shapes do not divide, else the even cut, with the reason); the uneven cut is taken only
  where the pipeline model (:func:`chunk_pipeline_us`, each chunk priced at its bytes) does
  not predict it slower than the best even count nor the whole exchange, and the decision
  says which was taken and why. With
  ``workload_chunks=2`` the pass is the faithful graph_trainer baseline (ep_chunk_pass +
  ep_overlap_pass: two chunks, chunk 0's exchange under chunk 1's compute).
- Guarantees: values equal to the unoptimised program up to floating-point rounding (weight
  gradients cut along tokens are partial sums added in another order; a matmul on a chunk
  may block differently); the chunk exchanges together move exactly the bytes of the two
  exchanges, on the same group; decisions depend only on the graph, the config and the
  topology, and every rank issues the chunks in the same order; no process group is created.
- Leaves alone (one refusal line per all_to_all): unequal or data-dependent splits written as
  graph all_to_alls ("dropless dispatch with data-dependent split sizes written as graph
  all_to_alls: recognise the layer into commfuse::moe_layer (moe_recognition)"); all_to_alls that are not
  matched as a dispatch with a combine (no chain along any cut dim reaches an all_to_all on
  the same group, e.g. a softmax / sum over the cut dim mixes the chunks, or an in-place op
  stops the chain, or the chain reads a value computed after the combine is issued); sizes
  no chunk count divides; coalesced / in-place / multi-wait ones; with a cost model, an
  exchange no chunk count is predicted to speed up (latency-bound).

Dropless dispatch (data-dependent split sizes)
- Matches: a ``commfuse::moe_layer`` / ``moe_layer_backward`` node (the op
  ``moe_recognition`` makes of a hand-written MoE layer, or commfuse's ``MoELayer``) with
  dropless routing (``capacity_factor <= 0``) over an expert-parallel group of >= 2 ranks, not
  already cut. Its split sizes depend on the routing, so the graph cannot carry them: the
  op's kernel does the cut (:mod:`commfuse.ops.moe_layer.op`, ``chunks``): contiguous token
  chunks, one count exchange for all of them, every chunk's rows sent asynchronously and each
  chunk's expert outputs sent back while the next chunk's experts compute.
- Does: sets the node's ``chunks``. k = ``Config.workload_chunks`` if set; without a topology
  2 (graph_trainer's split); else Algorithm 1 with the exchange's time (counts, dispatch and
  combine at balanced routing: :mod:`commfuse.ops.moe_layer.comm_volume`) and no independent
  compute (the op waits for its own exchanges) bounds it at ``Config.max_chunks``, and among
  2..k the count with the fastest op (:func:`commfuse.ops.moe_layer.cost.time_us`: the chunk
  pipeline with the router's and experts' FLOPs on the compute model -- what the simulator,
  and so the step-time gate, prices the op with) is taken; refused when none beats the whole
  exchange. Works wherever the op sits: under tensor or sequence parallelism the op
  sees its rank's tokens and the cut is along them.
- Guarantees: dropless routing makes every token's output depend on that token alone, so the
  chunked call computes the same values (expert weight gradients summed over chunks); the
  same rows cross the wire (plus one count per expert and chunk); every rank of the group
  gets the same count (decided from the graph, config and topology; a chunk with no tokens
  on some rank exchanges empty buffers).
- Leaves alone: capacity routing inside the op (cutting a token group changes which rows are
  dropped; capacity exchanges written as graph all_to_alls are cut above), no group, and
  ops already cut.

Stage: SCHEDULE (the partitioned forward and backward graphs, as ``workload_partition``).

Source: Centauri (ASPLOS '24) §3.1 "workload partition" (the collective cut with its compute
chain) and Algorithm 1 §3.2 (the chunk count; its group-partitioned branch, the uneven
granularity); the exchange pairing follows torchtitan's
graph_trainer experiment (ep_chunk_pass / ep_overlap_pass).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
import math
from typing import Any, Optional

import torch
import torch.fx as fx

from commfuse.analysis import chains
from commfuse.analysis.chains import Chain, ChainStep, Partial, Split
from commfuse.analysis.chunking import GroupCosts, independent_compute_us, operation_level_plan, rounded_units
from commfuse.analysis.rank_local import rank_local_reason
from commfuse.costmodel.collectives import concrete
from commfuse.costmodel.compute import OpCost
from commfuse.costmodel.pipeline import chunk_pipeline_us, pipeline_us
from commfuse.ir import rewrite
from commfuse.ir.collective import Collective
from commfuse.ir.kinds import CollectiveKind
from commfuse.ir.shapes import shape_of
from commfuse.ops.moe_layer import comm_volume
from commfuse.ops.moe_layer import cost as moe_cost
from commfuse.ops.moe_layer.op import CHUNKS_ARG, MOE_LAYER, MOE_LAYER_BACKWARD
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext
from commfuse.transforms.group_partition import plan_group_partition
from commfuse.transforms.workload_partition import (
    DEFAULT_CHUNKS,
    FACTS,
    MAX_UNITS,
    _Builder,
    _Emitter,
    _fmt,
    cuttable_reason,
)

DROPLESS = (
    "dropless dispatch with data-dependent split sizes written as graph all_to_alls: recognise the layer "
    "into commfuse::moe_layer (moe_recognition), whose exchange this pass cuts"
)
MOE_OPS = (MOE_LAYER, MOE_LAYER_BACKWARD)
# Bounds the blocks tried along an all_to_all_single's dim (each is one chain search).
MAX_BLOCK_CANDIDATES = 16
# Why Algorithm 1 has no two-level costs for an exchange (then the even decision stands as is).
NO_LEVEL_TIMES = "no level times"


@dataclass(frozen=True)
class ExchangePlan:
    """How one exchange is cut: pure data (apply re-derives the chain and checks it matches)."""

    dispatch: str
    combine: str
    dim: int  # dim of the dispatch's logical output the chunks are cut along
    blocks: int  # the cut's blocks along ``dim`` (1: contiguous chunks)
    chunks: int
    chain: tuple[str, ...]
    sizes: tuple[int, ...]  # elements of the dispatch's output along ``dim`` in each chunk
    why: str  # how the chunk count was chosen
    # Uneven chunks: chunk i holds units[i] of sum(units) equal units of every block (None: even).
    units: Optional[tuple[int, ...]] = None

    @property
    def granularity(self) -> str:
        """``"2:1:1"`` for an uneven cut, ``"even"`` otherwise."""
        return _fmt(self.units) if self.units else "even"

    def describe(self) -> str:
        cut = f"dim {self.dim}" + (f" in {self.blocks} blocks" if self.blocks > 1 else "")
        uneven = f" (uneven, {self.granularity})" if self.units else ""
        return (
            f"{self.dispatch} -> {self.combine}: {self.chunks} chunks of sizes {list(self.sizes)}{uneven} along "
            f"{cut} with a chain of {len(self.chain)} ops ({self.why})"
        )


# ---------------------------------------------------------------------------- matching
def why_not_exchange(ctx: PassContext, c: Collective) -> Optional[str]:
    """Why ``c`` cannot be one side of a chunked exchange (None: it can)."""
    if c.kind is not CollectiveKind.ALL_TO_ALL:
        return f"{c.kind.value} is not an all_to_all"
    if not c.extra.get("equal_splits", False) or c.extra.get("rank_local_sizes", True):
        return DROPLESS
    why = cuttable_reason(c)
    if why is not None:
        return why
    if chains.static_shape(c.logical_input) is None or chains.static_shape(c.logical_output) is None:
        return "shapes are not static"
    facts = ctx.get(FACTS)
    if any(v in facts.mutated for v in (c.logical_input, c.inputs[0], c.logical_output, c.waits[0])):
        return "its input or result is written in place"
    if c.logical_output is not c.waits[0] and any(u not in c.layout_nodes for u in c.waits[0].users):
        return "its raw result is read besides the layout shuffle"
    return None


def exchange_split(c: Collective, dim: int, blocks: int, k: int) -> Optional[Split]:
    """The chunk layout of ``c``'s output for chunks of its input cut as ``Split(dim, blocks)``
    into ``k`` (the same layout: see the module docstring); None: not a valid cut."""
    ins, outs = chains.static_shape(c.logical_input), chains.static_shape(c.logical_output)
    n, s, cc = c.group.size, c.logical_dim, c.logical_concat_dim
    if not 0 <= dim < len(outs) or len(ins) != len(outs):
        return None
    if dim in (s, cc) and not (s == cc == dim and blocks % n == 0):
        return None
    if ins[dim] != outs[dim] or ins[dim] % (blocks * k):
        return None
    return Split(dim, blocks)


def _cuts(c: Collective, k: int) -> list[Split]:
    outs = chains.static_shape(c.logical_output)
    n, found = c.group.size, []
    for d in range(len(outs)):
        options = (
            [n * m for m in range(1, outs[d] // n + 1) if (outs[d] // n) % m == 0]
            if d == c.logical_dim
            else [1]
        )
        options = [b for b in options if exchange_split(c, d, b, k) is not None]
        found += [Split(d, b) for b in options[:MAX_BLOCK_CANDIDATES]]
    return found


def _views_to(
    chain: Chain, target: fx.Node, own: set[fx.Node], backward_nodes: set[fx.Node]
) -> Optional[list[ChainStep]] | str:
    """The chunk steps of the views that lead from a chain value to ``target`` (the combine's
    input): the chain leaves trailing views out (it reassembles their input instead), the
    exchange needs them per chunk. None: ``target`` is not computed by the chain."""
    layouts = {chain.root: chain.out_split, **{s.node: s.out for s in chain.steps}}
    path, node = [], target
    while node not in layouts:
        if (
            node.op != "call_function"
            or node.target not in chains.VIEWLIKE
            or len(node.all_input_nodes) != 1
            or node.all_input_nodes[0] is not node.args[0]
        ):
            return None
        path.append(node)
        node = node.args[0]
    if any(u not in own for u in target.users):
        return f"its input {target.name} is also used elsewhere"
    if any(len(v.users) != 1 for v in path[1:]):
        return "a view between the chain and its input is also used elsewhere"
    if any(
        (v in backward_nodes) != (chain.root in backward_nodes) or chains.static_shape(v) is None
        for v in path
    ):
        return "a view before its input is in the other phase or has no static shape"
    split = layouts[node]
    if isinstance(split, Partial):
        return "its input is a partial sum of the chunks"
    steps = []
    for v in reversed(path):
        nxt = chains.view_forward(v, split, chain.chunks)
        if isinstance(nxt, str):
            return nxt
        steps.append(ChainStep(v, nxt, {0: split}))
        split = nxt
    return steps


def _combine_of(ctx: PassContext, c: Collective, chain: Chain) -> tuple[Chain, Collective, Split] | str:
    """The first later eligible all_to_all on ``c``'s group whose input the chain computes, and
    the chain extended by the views that lead to that input."""
    for c2 in ctx.ir.collectives:
        if (
            c2.index <= c.index
            or c2.kind is not CollectiveKind.ALL_TO_ALL
            or not c2.group.same_members(c.group)
        ):
            continue
        steps = _views_to(chain, c2.logical_input, {c2.start, *c2.layout_nodes}, ctx.ir.backward_nodes)
        if steps is None:
            continue
        why = why_not_exchange(ctx, c2) or (steps if isinstance(steps, str) else None)
        order = ctx.get(FACTS).order
        if not why and order[chain.anchor] >= order[c2.start]:
            why = f"the chain reads {chain.anchor.name}, computed after the combine is issued"
        if why:
            return f"{c2.name}: {why}"
        full = replace(chain, steps=chain.steps + steps)
        lay = ({s.node: s.out for s in full.steps}).get(c2.logical_input)
        if not isinstance(lay, Split) or exchange_split(c2, lay.dim, lay.blocks, chain.chunks) is None:
            return f"{c2.name}: the cut reaches its input in a layout it cannot exchange per chunk ({lay})"
        return full, c2, lay
    return "the chain reaches no all_to_all on the same group"


def _score(ctx: PassContext, chain: Chain) -> tuple:
    inside = {chain.root, *(s.node for s in chain.steps)}
    sliced = sum(
        1
        for s in chain.steps
        for p, a in enumerate(s.node.args)
        if isinstance(a, fx.Node) and a not in inside and s.args.get(p) is not None
    )
    return (len(chain.compute_nodes), -sliced, not chain.reduction, -chain.out_split.blocks, -chain.dim)


def _best(ctx: PassContext, c: Collective, k: int) -> tuple[Chain, Collective, Split] | str:
    found, reasons = [], []
    for cut in _cuts(c, k):
        ch = chains.consumer_chain(
            c, cut.dim, k, ctx.ir.dims, ctx.get(FACTS), ctx.ir.backward_nodes, splits=(cut, cut)
        )
        where = f"dim {cut.dim}" + (f" in {cut.blocks} blocks" if cut.blocks > 1 else "")
        if isinstance(ch, str):
            reasons.append(f"{where}: {ch}")
            continue
        found_pair = _combine_of(ctx, c, ch)
        if isinstance(found_pair, str):
            reasons.append(f"{where}: {found_pair}")
            continue
        found.append(found_pair)
    if not found:
        if not reasons:
            return f"no dim of {list(chains.static_shape(c.logical_output))} is divisible by {k} chunks"
        return "no cuttable chain to a combine all_to_all (" + "; ".join(dict.fromkeys(reasons)) + ")"
    return max(found, key=lambda t: _score(ctx, t[0]))


def _chunk_count(ctx: PassContext, c: Collective) -> tuple[int, str]:
    """(k, why): ``Config.workload_chunks``, else Algorithm 1's count as the most chunks to try
    (the pipeline model below picks among 2..k), else graph_trainer's 2."""
    cfg = ctx.config
    if cfg.workload_chunks is not None:
        return min(int(cfg.workload_chunks), cfg.max_chunks), "Config.workload_chunks"
    est = ctx.cost.model
    if est is None:
        return min(DEFAULT_CHUNKS, cfg.max_chunks), f"no topology: {DEFAULT_CHUNKS} chunks"
    probe = _best(ctx, c, min(DEFAULT_CHUNKS, cfg.max_chunks))
    if isinstance(probe, str):
        return min(DEFAULT_CHUNKS, cfg.max_chunks), "no chain to price"
    _, c2, _ = probe
    comm = est.collective(c).time_us + est.collective(c2).time_us
    plan = operation_level_plan(0.0, comm, independent_compute_us(ctx.gm, ctx.ir, c, est), cfg.max_chunks)
    # Algorithm 1 keeps a collective whole when independent compute hides it; the combine
    # waits on the chain, which nothing independent hides: try two chunks then (the
    # pipeline model still refuses when they are predicted slower).
    return max(plan.num_chunks, min(DEFAULT_CHUNKS, cfg.max_chunks)), f"Algorithm 1: {plan.why}"


def _exchange_us(est, c: Collective, k: int, units: int = 1) -> float:
    """Predicted time of a chunk of ``units`` of ``k`` equal units of the exchange ``c`` (launch
    included; the default: one of ``k`` even chunks)."""
    size = concrete(c.input_bytes) or 0
    t = est.collectives.time(
        CollectiveKind.ALL_TO_ALL, size * units // k, c.group.size, ranks=c.group.ranks
    ).time_us
    extra = est.runtime.collective_in_graph_us or 0.0
    return t + extra if t > 0 else t


def reassembly_us(est, chain: Chain, parts: Optional[int] = None) -> float:
    """What the cut adds after the chunk pipeline: each chain value used outside the chain put
    back together -- a copy of its chunks into one buffer, or ``parts - 1`` adds of partial sums
    (a weight gradient contracted over the cut tokens). ``parts``: the chunks (default: the
    chain's, which counts units when the cut is uneven)."""
    layout = {s.node: s.out for s in chain.steps}
    k = parts or chain.chunks
    total = 0.0
    for node in chain.outputs:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or chains.static_shape(node) is None:
            continue
        numel, nbytes = val.numel(), val.numel() * val.element_size()
        dtype = "bf16" if val.dtype in (torch.bfloat16, torch.float16) else "fp32"
        if isinstance(layout.get(node), Partial):
            add = OpCost(numel, 3 * nbytes, "pointwise", dtype, numel)
            total += (k - 1) * est.compute.estimate_cost(add).time_us
        else:
            total += est.compute.estimate_cost(OpCost(0, 2 * nbytes, "memory", dtype, numel)).time_us
    return total


def two_level_granularity(
    ctx: PassContext, c: Collective, c2: Collective, chain: Chain
) -> tuple[Optional[tuple[float, ...]], str]:
    """Centauri's Algorithm 1 for the exchange ``c`` -> ``chain`` -> ``c2`` as if run as the
    two-level exchange (``group_partition``'s plan of both all_to_alls: ``cost_inter`` /
    ``cost_intra`` their inter- and intra-node levels' predicted times, the chain's compute,
    the independent compute around the dispatch): its granularity when uneven, else None; and
    why. None too where the group does not span nodes with sub-groups set up (no level times)."""
    est = ctx.cost.model
    if est is None:
        return None, f"{NO_LEVEL_TIMES} (no topology)"
    plans = [plan_group_partition(ctx, x) for x in (c, c2)]
    bad = next((p for p in plans if isinstance(p, str)), None)
    if bad is not None:
        return None, f"{NO_LEVEL_TIMES} (no two-level exchange: {bad})"

    def level_us(inter: bool) -> float:
        return sum(lv.predicted_us for p in plans for lv in p.levels if (lv.group == p.inter_group) == inter)

    costs = GroupCosts(
        cost_inter=level_us(True),
        cost_intra=level_us(False),
        inter_size=plans[0].nodes,
        intra_size=plans[0].local,
    )
    comp = sum(est.compute_time_us(n) for n in chain.compute_nodes)
    comm = est.collective(c).time_us + est.collective(c2).time_us
    op = operation_level_plan(
        comp, comm, independent_compute_us(ctx.gm, ctx.ir, c, est), ctx.config.max_chunks, group=costs
    )
    why = f"Algorithm 1 on the two-level exchange: {op.why}, granularity {', '.join(f'{g:.3g}' for g in op.granularity)}"
    if op.num_chunks < 2 or len(set(op.granularity)) == 1:
        return None, why
    return op.granularity, why


def _uneven_cut(
    ctx: PassContext, c: Collective, granularity: tuple[float, ...]
) -> tuple[tuple[int, ...], tuple[Chain, Collective, Split], str] | str:
    """Chunks in the proportions ``granularity``: every block of the exchange cut into ``U``
    equal units (a chain found for ``U`` even chunks) and chunk i taking ``units[i]`` of each,
    so every chunk exchange is again an equal-split all_to_all. The exact proportions first,
    then coarser roundings (``workload_partition``'s); (units, the cut, a note on rounding), or
    why none divides the shapes."""
    if len(granularity) > ctx.config.max_chunks:
        return f"granularity of {len(granularity)} chunks exceeds max_chunks={ctx.config.max_chunks}"
    candidates = rounded_units(granularity, MAX_UNITS)
    if not candidates:
        return f"no rounding to at most {MAX_UNITS} units keeps it uneven"
    first_why = None
    for units in candidates:
        best = _best(ctx, c, sum(units))
        if not isinstance(best, str):
            note = (
                ""
                if units == candidates[0]
                else (
                    f"granularity {_fmt(candidates[0])} rounded to {_fmt(units)} "
                    f"({sum(candidates[0])} units: {first_why})"
                )
            )
            return units, best, note
        first_why = first_why or best
    return f"granularity {_fmt(candidates[0])}: {first_why}"


def _uneven_span(ctx: PassContext, c: Collective, units: tuple[int, ...], best) -> float:
    """The chunk pipeline of the uneven cut ``units`` (each chunk priced at its bytes)."""
    est, total = ctx.cost.model, sum(units)
    chain, c2, _ = best
    comp = sum(est.compute_time_us(n) for n in chain.compute_nodes)
    return chunk_pipeline_us(
        [_exchange_us(est, c, total, u) for u in units],
        [comp * u / total for u in units],
        [_exchange_us(est, c2, total, u) for u in units],
        reassembly_us(est, chain, len(units)),
    )


def plan_exchange_partition(
    ctx: PassContext, c: Collective, chunks: Optional[int] = None, units: Optional[tuple[int, ...]] = None
) -> tuple[ExchangePlan, Chain, Collective, Split] | str:
    """The chunked exchange with dispatch ``c``, or why there is none. ``chunks``: the count
    (default: ``Config.workload_chunks``, else the count in 2..Algorithm 1's whose pipeline the
    cost model predicts fastest, refused when none beats the unpartitioned exchange; without a
    topology 2), lowered until a cut divides; on a group spanning nodes, Algorithm 1's uneven
    granularity instead where the pipeline model does not predict it slower. ``units``: that
    uneven cut, requested. Pure."""
    why = why_not_exchange(ctx, c)
    if why:
        return why
    if units:
        best = _best(ctx, c, sum(units))
        if isinstance(best, str):
            return best
        return (_plan(c, best, tuple(units), "requested"), *best)
    if chunks:
        k, how = min(chunks, ctx.config.max_chunks), "requested"
    else:
        k, how = _chunk_count(ctx, c)
    if k < 2:
        return "one chunk: nothing to partition"
    est = ctx.cost.model
    choose = not chunks and ctx.config.workload_chunks is None and est is not None
    first, options = None, []
    for kk in range(k, 1, -1):
        best = _best(ctx, c, kk)
        if isinstance(best, str):
            first = first or best
            continue
        options.append((kk, best))
        if not choose:
            break
    if not options:
        return first
    note = how
    if choose:
        chain, c2, _ = options[0][1]
        comp = sum(est.compute_time_us(n) for n in chain.compute_nodes)
        whole = pipeline_us(est.collective(c).time_us, comp, est.collective(c2).time_us, 1)
        # each count's own chain: the values it reassembles depend on the cut it found
        timed = [
            (
                pipeline_us(
                    _exchange_us(est, c, kk), comp, _exchange_us(est, c2, kk), kk, reassembly_us(est, b[0])
                ),
                kk,
                kk,
                b,
            )
            for kk, b in options
        ]  # ties: fewer chunks
        span, _, kk, best = min(timed, key=lambda t: t[:2])
        uneven = _uneven_choice(ctx, c, chain, c2, span, kk, whole)
        if isinstance(uneven, tuple):
            cut, ubest, unote = uneven
            return (_plan(c, ubest, cut, f"{how}; {unote}"), *ubest)
        tail = f"; {uneven}" if uneven else ""
        if span >= whole:
            return (
                f"{how}; every chunk count predicted slower than the whole exchange ({span:.1f} us >= "
                f"{whole:.1f} us: per-chunk launch and latency outweigh the overlap){tail}"
            )
        note = f"{how}; {kk} chunks predicted fastest ({span:.1f} us vs {whole:.1f} us whole){tail}"
    else:
        kk, best = options[0]
        if kk != k:
            note = f"{how}: {k} chunks, lowered to {kk} for the shapes"
    chain, c2, _ = best
    length = chains.static_shape(c.logical_output)[chain.dim]
    plan = ExchangePlan(
        c.name, c2.name, chain.dim, chain.out_split.blocks, kk, chain.node_names, (length // kk,) * kk, note
    )
    return (plan, *best)


def _uneven_choice(
    ctx: PassContext,
    c: Collective,
    chain: Chain,
    c2: Collective,
    even_us: float,
    even_k: int,
    whole_us: float,
) -> tuple[tuple[int, ...], tuple, str] | str:
    """Algorithm 1's uneven cut when it applies and the pipeline model predicts it no slower
    than the best even cut (``even_k`` chunks, ``even_us``) and faster than the whole exchange:
    (units, the cut, the decision's note); else why not ("" where the group gives Algorithm 1
    no level times: the even decision stands as it is)."""
    granularity, why = two_level_granularity(ctx, c, c2, chain)
    if granularity is None:
        return "" if why.startswith(NO_LEVEL_TIMES) else why
    cut = _uneven_cut(ctx, c, granularity)
    if isinstance(cut, str):
        return f"{why}; uneven granularity not applied ({cut})"
    units, best, rounding = cut
    span = _uneven_span(ctx, c, units, best)
    what = f"{why}{'; ' + rounding if rounding else ''}"
    if span > even_us or span >= whole_us:
        slower = (
            f"{even_k} even chunks' {even_us:.1f} us"
            if span > even_us
            else f"the whole exchange's {whole_us:.1f} us"
        )
        return f"{what}; uneven {_fmt(units)} not taken: predicted {span:.1f} us, slower than {slower}"
    return (
        units,
        best,
        (
            f"{what}; uneven {_fmt(units)} taken: predicted {span:.1f} us, not slower than "
            f"{even_k} even chunks ({even_us:.1f} us; {whole_us:.1f} us whole)"
        ),
    )


def _plan(
    c: Collective, best: tuple[Chain, Collective, Split], units: tuple[int, ...], why: str
) -> ExchangePlan:
    """The plan of the uneven cut ``units`` (chunk i: units[i] of sum(units) units of every block)."""
    chain, c2, _ = best
    length = chains.static_shape(c.logical_output)[chain.dim]
    return ExchangePlan(
        c.name,
        c2.name,
        chain.dim,
        chain.out_split.blocks,
        len(units),
        chain.node_names,
        tuple(length // sum(units) * u for u in units),
        why,
        tuple(units),
    )


# ---------------------------------------------------------------------------- dropless MoE op
@dataclass(frozen=True)
class TokenChunkPlan:
    node: str
    chunks: int
    why: str


def plan_token_chunks(ctx: PassContext, node: fx.Node) -> TokenChunkPlan | str:
    """How many token chunks the dropless MoE op ``node`` is cut into, or why it is left whole."""
    off = 3 if node.target is MOE_LAYER_BACKWARD else 0
    capacity_factor, group_name = node.args[off + 6], node.args[off + 8]
    if capacity_factor > 0:
        return (
            "capacity routing inside commfuse::moe_layer: token chunks would change which rows are dropped "
            "(capacity exchanges written as graph all_to_alls are cut by this pass)"
        )
    cut = comm_volume.chunks_of(node)
    if cut > 1:
        return f"already cut into {cut} token chunks"
    ways = [t for t in comm_volume.node_transfers(node) if t.what != "counts"]
    if not group_name or not ways:
        return "no expert-parallel group (or no shapes): nothing is exchanged"
    cfg, est = ctx.config, ctx.cost.model
    if cfg.workload_chunks is not None:
        k = min(int(cfg.workload_chunks), cfg.max_chunks)
        return TokenChunkPlan(node.name, k, "Config.workload_chunks") if k >= 2 else "one chunk requested"
    if est is None:
        k = min(DEFAULT_CHUNKS, cfg.max_chunks)
        return TokenChunkPlan(node.name, k, f"no topology: {k} chunks") if k >= 2 else "max_chunks < 2"
    # the count is priced from this rank's token count: every rank of the group must see the same
    # (chunk counts that differ between ranks would mismatch the count exchange)
    local = rank_local_reason(ctx.ir.collectives, ctx.gm)
    if local:
        return f"the count would be priced from sizes that may differ between ranks: {local}"
    whole = moe_cost.time_us(est, node, 1)
    bound = operation_level_plan(0.0, whole - moe_cost.compute_us(est, node), 0.0, cfg.max_chunks)
    tokens = math.prod(shape_of(node.args[off])[:-1])
    # at most one chunk per token: more would only add empty exchanges
    timed = [(moe_cost.time_us(est, node, k), k) for k in range(2, min(bound.num_chunks, tokens) + 1)]
    if not timed:
        return f"Algorithm 1: {bound.why}"
    span, k = min(timed)
    if span >= whole:
        return (
            f"Algorithm 1: {bound.why}; every chunk count predicted slower than the whole exchange "
            f"({span:.1f} us >= {whole:.1f} us: per-chunk launch and latency outweigh the overlap)"
        )
    return TokenChunkPlan(
        node.name,
        k,
        f"Algorithm 1: {bound.why}; {k} chunks predicted fastest ({span:.1f} us vs {whole:.1f} us whole)",
    )


def _set_chunks(node: fx.Node, k: int) -> None:
    at = CHUNKS_ARG[node.target]
    args = list(node.args)
    if len(args) > at:
        args[at] = k
    elif len(args) == at and "chunks" not in node.kwargs:
        args.append(k)
    else:
        node.kwargs = {**node.kwargs, "chunks": k}
    node.args = tuple(args)


# ---------------------------------------------------------------------------- rewriting
def _emit(
    gm: fx.GraphModule,
    mode: Any,
    chain: Chain,
    c2: Collective,
    split2: Split,
    units: Optional[tuple[int, ...]] = None,
) -> list[fx.Node]:
    """``units``: chunk i takes units[i] of the chain's ``chain.chunks`` equal units (None: even)."""
    c = chain.collective
    sizes = tuple(units) if units else (1,) * chain.chunks
    k = len(sizes)
    n, group = c.group.size, c.group.name
    head = _Builder(gm, mode, c.start)
    dispatched = []
    for i in range(k):
        x = head.take_chunk(c.logical_input, chain.in_split, sizes, i, c.start)
        dispatched.append(
            rewrite.splice(
                gm,
                rewrite.all_to_all_issue,
                [x],
                consts=(c.logical_dim, n, group),
                before=c.start,
                meta_from=c.start,
            )
        )
    inside = {chain.root, *(s.node for s in chain.steps)}
    own = {c2.start, *c2.layout_nodes}  # the combine itself: replaced by the chunk combines
    em = _Emitter(gm, mode, sizes, chain.anchor.next)
    envs, combines = [], []
    for i in range(k):
        env = {
            chain.root: rewrite.splice(
                gm,
                rewrite.all_to_all_receive,
                [dispatched[i]],
                consts=(c.logical_concat_dim, n),
                before=em.before,
                meta_from=c.waits[0],
            )
        }
        for step in chain.steps:
            env[step.node] = em.replay(step, env, i)
        combines.append(
            rewrite.splice(
                gm,
                rewrite.all_to_all_issue,
                [env[c2.logical_input]],
                consts=(c2.logical_dim, n, c2.group.name),
                before=em.before,
                meta_from=c2.start,
            )
        )
        envs.append(env)
    layouts = {chain.root: chain.out_split, **{s.node: s.out for s in chain.steps}}
    # Chain values read outside it (the chain's own outputs; the views appended up to the
    # combine are read by the combine only).
    for v in chain.outputs:
        if not any(u not in inside and u not in own for u in v.users):
            continue
        whole = em.reassemble([env[v] for env in envs], layouts[v], sizes, v)
        v.replace_all_uses_with(whole, delete_user_cb=lambda u: u not in inside and u not in own)
    tail = _Builder(gm, mode, c2.waits[0])
    parts = [
        rewrite.splice(
            gm,
            rewrite.all_to_all_receive,
            [s],
            consts=(c2.logical_concat_dim, n),
            before=c2.waits[0],
            meta_from=c2.waits[0],
        )
        for s in combines
    ]
    whole = tail.reassemble(parts, split2, sizes, c2.logical_output)
    c2.logical_output.replace_all_uses_with(whole)
    pos = {node: i for i, node in enumerate(gm.graph.nodes)}
    roots = {
        c.start,
        *c.waits,
        *c.layout_nodes,
        c.logical_output,
        *inside,
        c2.start,
        *c2.waits,
        *c2.layout_nodes,
        c2.logical_output,
    }
    rewrite.erase_dead(gm, sorted(roots, key=pos.__getitem__))
    if any(not getattr(x, "_erased", False) for x in (c.start, *c.waits, c2.start, *c2.waits)):
        raise RuntimeError(
            f"expert_exchange_partition: {c.name} / {c2.name} still have users after the rewrite"
        )
    return dispatched + combines


def apply_exchange_partition(ctx: PassContext, c: Collective, plan: ExchangePlan) -> list[fx.Node]:
    """Rewrite ``ctx.gm`` as ``plan`` says; returns the chunk exchanges' start nodes (dispatches,
    then combines). Raises ValueError if the plan does not match the graph."""
    best = plan_exchange_partition(ctx, c, plan.chunks, units=plan.units)
    if (
        isinstance(best, str)
        or best[0].chain != plan.chain
        or best[0].combine != plan.combine
        or best[0].sizes != plan.sizes
    ):
        raise ValueError(
            f"plan for {c.name} does not match the graph: {best if isinstance(best, str) else best[0]}"
        )
    _, chain, c2, split2 = best
    return _emit(ctx.gm, rewrite.fake_mode_of(ctx.gm), chain, c2, split2, plan.units)


class ExpertExchangePartition(GraphPass):
    __doc__ = __doc__
    name = "expert_exchange_partition"
    stage = Stage.SCHEDULE
    # The moe family's capacity_exchange block builds the pattern (equal-split all_to_all ->
    # matmul -> activation -> inverse all_to_all on the same group, raw dim-0 or DTensor-style);
    # its dispatch / combine blocks are uneven (refused: dropless). Weight gradients cut along
    # tokens add partial sums and a matmul on a chunk of rows takes another kernel path:
    # tolerance compare, scaled by each output's magnitude (as workload_partition).
    fuzz = FuzzSpec(generators=("moe",), scaled_tolerance=True)

    def run(self, ctx: PassContext) -> PassResult:
        counts = {"exchanges_partitioned": 0, "chunk_collectives": 0, "chain_ops": 0}
        refusals: list[str] = []
        decisions: list[dict] = []
        pending = [c.name for c in ctx.ir.collectives if c.kind is CollectiveKind.ALL_TO_ALL]
        gone: set[str] = set()  # combines already cut with their dispatch
        changed = False
        for name in pending:
            if name in gone:
                continue
            c = next((x for x in ctx.ir.collectives if x.name == name), None)
            if c is None:
                continue
            best = plan_exchange_partition(ctx, c)
            if isinstance(best, str):
                refusals.append(f"{name}: not partitioned: {best}")
                continue
            plan, chain, c2, split2 = best
            starts = _emit(ctx.gm, rewrite.fake_mode_of(ctx.gm), chain, c2, split2, plan.units)
            gone.add(c2.name)
            changed = True
            ctx.invalidate()  # the next exchange is planned on the rewritten graph
            counts["exchanges_partitioned"] += 1
            counts["chunk_collectives"] += len(starts)
            counts["chain_ops"] += len(plan.chain)
            decisions.append(
                {
                    "collective": plan.dispatch,
                    "combine": plan.combine,
                    "dim": plan.dim,
                    "blocks": plan.blocks,
                    "chunks": plan.chunks,
                    "sizes": list(plan.sizes),
                    "granularity": plan.granularity,
                    "decision": plan.describe(),
                }
            )
        for node in [n for n in ctx.gm.graph.nodes if n.op == "call_function" and n.target in MOE_OPS]:
            token_plan = plan_token_chunks(ctx, node)
            if isinstance(token_plan, str):
                refusals.append(f"{node.name}: not partitioned: {token_plan}")
                continue
            _set_chunks(node, token_plan.chunks)
            changed = True
            counts["moe_ops_chunked"] = counts.get("moe_ops_chunked", 0) + 1
            decisions.append(
                {
                    "collective": node.name,
                    "chunks": token_plan.chunks,
                    "dim": 0,
                    "decision": f"{node.name}: dropless exchange cut into {token_plan.chunks} token "
                    f"chunks inside the op ({token_plan.why})",
                }
            )
        if changed:
            ctx.gm.graph.lint()
            ctx.gm.recompile()
        return PassResult(changed=changed, counts=counts, refusals=refusals, decisions=decisions)
