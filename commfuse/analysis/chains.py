"""Chains of compute a collective can be chunked together with (Centauri §3.1, workload partition).

A *chain* is the compute that depends on a collective's result (``consumer``) or that
produces its input (``producer``), split along one dim so that chunk ``i`` of the chain
only needs chunk ``i`` of the collective. This module finds chains; it never changes the
graph (``workload_partition`` rewrites).

Chunk layout. A value's chunk is described by :class:`Split` ``(dim, blocks)``: view
``dim`` (size ``L``) as ``[blocks, k, L / (blocks * k)]`` and take index ``i`` of the
middle axis. ``blocks == 1`` is the contiguous slice ``[i*L/k, (i+1)*L/k)``;
``blocks == N`` is the rank-interleaved layout a chunked all_gather produces along its
gather dim (chunk ``i`` holds rows ``r*L/N + i*L/(N*k) + q`` for every rank ``r``).

Propagation rules (the dim types come from :mod:`commfuse.ir.dims`, Centauri Table 3):

* element-wise ops (and clone/contiguous/_to_copy/detach/alias): the split dim maps to
  the same output dim (right-aligned broadcasting); side inputs broadcast along it are
  used whole, the others are sliced with the same ``Split``;
* matmuls (mm, addmm, bmm): an OD input dim maps to its output dim; a CD (contraction)
  split makes the op's result a *partial sum* over chunks: the chain ends there and the
  chunk results are added (addmm adds its bias in chunk 0 only);
* reductions: a split dim that is not reduced maps through; a reduced one is CD for
  sum/mean (partial sum; mean divides by k) and ND for amax/amin/var/...;
* softmax / log_softmax (and their backward): the softmax dim is ND;
* views (view/reshape/_unsafe_view/squeeze/unsqueeze/permute/transpose/t/expand, slices
  of other dims or the identity slice DTensor puts after a gather): the split follows the dim; a reshape that merges the split dim with outer dims turns
  those into blocks (a merge ``[B, S] -> [B*S]`` of a split along S gives ``blocks=B``);
  a reshape that splits it needs the chunk structure to survive (else the chain stops);
* everything else (norms with several outputs, attention, cat/split, indexing, random
  ops, in-place ops, collectives) stops the chain.

Consumer chains grow forward in graph order from the collective's logical output; a
node joins when every input is in the chain (all split the same way) or independent of
it, its other inputs are ready before any later-issued collective (a chunk's compute
must not wait on another collective), nothing writes them in place, and it runs in the
same phase (forward/backward) as the collective. Values used outside the chain are
*reassembled* in their original layout (cat, un-interleave, or a sum of partials); views
at the end of a chain are left out (their input is reassembled instead). The chain is
cut back (from the end, in graph order) until every outside user of a reassembled value
comes after the point where the chunked chain is emitted.

Producer chains grow backward from the collective's logical input: a node joins when all
its users are in the chain and need it split the same way; the chain's side inputs are
sliced per chunk. Views that only reshape a side input are left out (the side input is
sliced in the shape the chain reads it).
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.fx as fx

from commfuse.ir import rewrite
from commfuse.ir.collective import Collective
from commfuse.ir.dims import DimType, DimTypeAnalysis, OpCategory
from commfuse.ir.kinds import CollectiveKind, collective_spec, is_wait
from commfuse.ir.shapes import shape_of

aten = torch.ops.aten

# Bounds the rewrite's size (each chain node is emitted k times); a chain this long
# already holds far more compute than one collective needs to hide behind.
MAX_CHAIN_OPS = 64

CONSUMER, PRODUCER = "consumer", "producer"

_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default}
_IDENTITY = {
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.detach.default,
    aten._to_copy.default,
}
_RESHAPES = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.unsqueeze.default,
}
_PERMUTES = {aten.permute.default, aten.transpose.int, aten.t.default}
VIEWLIKE = _IDENTITY | _RESHAPES | _PERMUTES | {aten.expand.default, aten.slice.Tensor}
# Ops whose size argument (args[1]) must be rewritten to the chunk's shape when replayed.
SIZED = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
_SUM_REDUCTIONS = {aten.sum.dim_IntList, aten.sum.default}
_MEAN_REDUCTIONS = {aten.mean.dim, aten.mean.default}


@dataclass(frozen=True)
class Split:
    """Chunk ``i`` of ``k``: view ``dim`` as ``[blocks, k, size/(blocks*k)]``, take ``[:, i, :]``."""

    dim: int
    blocks: int = 1


@dataclass(frozen=True)
class Partial:
    """The chain's value is a partial result per chunk: ``how`` = "sum" (add the chunks) or
    "mean" (add and divide by k)."""

    how: str


ChunkLayout = Union[Split, Partial]


@dataclass
class ChainStep:
    node: fx.Node
    out: ChunkLayout  # the layout of this node's chunk result
    args: dict[int, Optional[Split]]  # tensor arg position -> how that arg's chunk is taken (None: whole)

    @property
    def is_view(self) -> bool:
        return self.node.target in VIEWLIKE


@dataclass
class Chain:
    direction: str  # CONSUMER or PRODUCER
    collective: Collective
    chunks: int
    dim: int  # the dim of the collective's logical input/output the chunks are cut along
    in_split: Split  # layout of the collective input's chunks
    out_split: Split  # layout of the collective output's chunks
    root: fx.Node  # consumer: the collective's logical output; producer: its logical input
    steps: list[ChainStep] = field(default_factory=list)  # graph order
    outputs: list[fx.Node] = field(default_factory=list)  # consumer: values reassembled for outside users
    anchor: Optional[fx.Node] = None  # consumer: the chunked chain is emitted right after this node

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(s.node.name for s in self.steps)

    @property
    def compute_nodes(self) -> list[fx.Node]:
        return [s.node for s in self.steps if not s.is_view]

    @property
    def reduction(self) -> bool:
        return any(isinstance(s.out, Partial) for s in self.steps)


# --------------------------------------------------------------------------- graph facts
@dataclass
class GraphFacts:
    """Per-graph facts every chain search needs (cached as an analysis on the context)."""

    order: dict[fx.Node, int]
    # Position of the latest collective start each node depends on (-1: none).
    last_collective: dict[fx.Node, int]
    mutated: set[fx.Node]  # nodes whose memory an in-place op writes (through views)

    @classmethod
    def of(cls, gm: fx.GraphModule) -> "GraphFacts":
        order: dict[fx.Node, int] = {}
        last: dict[fx.Node, int] = {}
        for i, n in enumerate(gm.graph.nodes):
            order[n] = i
            dep = max((last[a] for a in n.all_input_nodes), default=-1)
            if n.op == "call_function" and collective_spec(n.target) is not None:
                dep = i
            last[n] = dep
        return cls(order, last, _mutated_roots(gm))


def _mutated_roots(gm: fx.GraphModule) -> set[fx.Node]:
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or not rewrite.mutates(n):
            continue
        for a, arg in zip(
            n.args, n.target._schema.arguments, strict=False
        ):  # args may omit trailing defaults
            if not (isinstance(a, fx.Node) and arg.alias_info is not None and arg.alias_info.is_write):
                continue
            while True:  # the written memory is also the memory of every view's base
                out.add(a)
                if (
                    a.op == "call_function"
                    and (a.target in VIEWLIKE or a.target is operator.getitem)
                    and a.args
                    and isinstance(a.args[0], fx.Node)
                ):
                    a = a.args[0]
                else:
                    break
    return out


# --------------------------------------------------------------------------- shapes
def static_shape(node) -> Optional[tuple[int, ...]]:
    s = shape_of(node)
    if s is None or not all(isinstance(x, int) for x in s):
        return None
    return tuple(s)


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def divisible(shape: tuple[int, ...], split: Split, k: int) -> bool:
    size = shape[split.dim]
    return size > 0 and size % (split.blocks * k) == 0


# --------------------------------------------------------------------------- collective transfer
def transfer(c: Collective, dim: int, k: int) -> tuple[Split, Split] | str:
    """(input chunk layout, output chunk layout) of ``c`` chunked along ``dim``.

    all_reduce: contiguous on both sides. all_gather along g: chunking g gathers chunk i
    of every rank's shard, i.e. rank-interleaved rows of the output (blocks = N); another
    dim stays contiguous. reduce_scatter along g: chunking g needs, per chunk, the rows
    each rank receives a piece of, i.e. the rank-interleaved rows of the input (blocks =
    N), and yields a contiguous chunk of each rank's result."""
    n = c.group.size
    g = c.logical_dim
    ins, outs = static_shape(c.logical_input), static_shape(c.logical_output)
    if ins is None or outs is None:
        return "shapes are not static"
    if not 0 <= dim < len(outs):
        return f"dim {dim} out of range for shape {list(outs)}"
    if c.kind is CollectiveKind.ALL_GATHER and dim == g:
        split_in, split_out = Split(dim, 1), Split(dim, n)
    elif c.kind is CollectiveKind.REDUCE_SCATTER and dim == g:
        split_in, split_out = Split(dim, n), Split(dim, 1)
    else:
        split_in = split_out = Split(dim, 1)
    if not divisible(ins, split_in, k) or not divisible(outs, split_out, k):
        what = "rank pieces of " if (split_in.blocks > 1 or split_out.blocks > 1) else ""
        return f"{what}size {ins[dim]} is not divisible by {k} chunks"
    return split_in, split_out


# --------------------------------------------------------------------------- op mappings
@dataclass(frozen=True)
class LoopMap:
    """An op's iteration space: one label per output dim and per input dim (None: a
    broadcast size-1 dim), labels only inputs have are reduced ("sum"/"mean"/"nd")."""

    out: tuple[Optional[int], ...]
    ins: dict[int, tuple[Optional[int], ...]]
    reduced: dict[int, str]
    nd: frozenset[int] = frozenset()


def _tensor_args(node: fx.Node) -> dict[int, fx.Node]:
    return {i: a for i, a in enumerate(node.args) if isinstance(a, fx.Node)}


def _broadcast_labels(shape: tuple[int, ...], out: tuple[int, ...]) -> tuple[Optional[int], ...] | str:
    off = len(out) - len(shape)
    if off < 0:
        return "input of higher rank than the output"
    labels: list[Optional[int]] = []
    for e, s in enumerate(shape):
        if s == out[e + off]:
            labels.append(e + off)
        elif s == 1:
            labels.append(None)
        else:
            return "shapes do not broadcast"
    return tuple(labels)


def loop_map(node: fx.Node, dims: DimTypeAnalysis) -> LoopMap | str:
    name = getattr(node.target, "__name__", str(node.target))
    out = static_shape(node)
    targs = _tensor_args(node)
    if out is None or any(static_shape(a) is None for a in targs.values()):
        return f"{name}: shapes are not static"
    t = node.target
    if t is aten.mm.default:
        return LoopMap((0, 1), {0: (0, 2), 1: (2, 1)}, {2: "sum"})
    if t is aten.bmm.default:
        return LoopMap((0, 1, 2), {0: (0, 1, 3), 1: (0, 3, 2)}, {3: "sum"})
    if t is aten.addmm.default:
        bias = _broadcast_labels(static_shape(targs[0]), out) if 0 in targs else ()
        if isinstance(bias, str):
            return f"{name}: {bias}"
        # A contraction split adds the bias in chunk 0 only; scaled forms are left alone.
        how = "sum" if not node.kwargs and len(node.args) == 3 else "nd"
        return LoopMap((0, 1), {0: bias, 1: (0, 2), 2: (2, 1)}, {2: how})
    nd = dims[node]
    if nd.category is OpCategory.ELEMENTWISE:
        ins = {}
        for pos, a in targs.items():
            lab = _broadcast_labels(static_shape(a), out)
            if isinstance(lab, str):
                return f"{name}: {lab}"
            ins[pos] = lab
        return LoopMap(tuple(range(len(out))), ins, {})
    if nd.category is OpCategory.SOFTMAX:
        types = nd.inputs.get(0, ())
        nds = frozenset(d for d, ty in enumerate(types) if ty is DimType.ND)
        return LoopMap(tuple(range(len(out))), {p: tuple(range(len(out))) for p in targs}, {}, nds)
    if nd.category is OpCategory.REDUCTION and nd.outs is None and list(targs) == [0]:
        types = nd.inputs.get(0, ())
        rank_in = len(types)
        reduced = {d for d, ty in enumerate(types) if ty is not DimType.OD}
        how = "sum" if t in _SUM_REDUCTIONS else "mean" if t in _MEAN_REDUCTIONS else "nd"
        if len(out) == rank_in:  # keepdim: reduced dims stay as size-1 dims nothing splits
            out_labels = tuple(None if d in reduced else d for d in range(rank_in))
        else:
            out_labels = tuple(d for d in range(rank_in) if d not in reduced)
        return LoopMap(out_labels, {0: tuple(range(rank_in))}, {d: how for d in reduced})
    return (
        f"{name} is not splittable here (only element-wise, matmul, reduction, softmax ops and views chain)"
    )


def _reject_node(node: fx.Node) -> Optional[str]:
    """Why ``node`` can never be part of a chain (None: it may)."""
    if node.op != "call_function":
        return f"{node.name} is not an op"
    t = node.target
    name = getattr(t, "__name__", str(t))
    if collective_spec(t) is not None or is_wait(t):
        return f"{name} is a collective"
    if not isinstance(t, torch._ops.OpOverload):
        return f"{name} is not an ATen op"
    if rewrite.mutates(node):
        return f"{name} writes in place"
    if torch.Tag.nondeterministic_seeded in t.tags:
        return f"{name} draws random numbers (chunks would change the stream)"
    if any(isinstance(v, fx.Node) for v in node.kwargs.values()) or any(
        isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a) for a in node.args
    ):
        return f"{name} takes tensors in keyword or list arguments"
    if static_shape(node) is None:
        return f"{name}: output shape is not static"
    return None


# ----------------------------------------------------------------------- views
def _reshape_groups(
    src: tuple[int, ...], dst: tuple[int, ...]
) -> Optional[list[tuple[list[int], list[int]]]]:
    """Pair up runs of src and dst dims whose products match (a reshape's dim groups)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        gi = [i] if i < len(src) else []
        gj = [j] if j < len(dst) else []
        ps = src[i] if gi else 1
        pd = dst[j] if gj else 1
        i, j = i + bool(gi), j + bool(gj)
        while ps != pd:
            if ps < pd and i < len(src):
                ps *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                pd *= dst[j]
                gj.append(j)
                j += 1
            elif i < len(src):
                ps *= src[i]
                gi.append(i)
                i += 1
            else:
                return None
        groups.append((gi, gj))
    return groups


def _map_reshape(src: tuple[int, ...], dst: tuple[int, ...], split: Split, k: int) -> Split | str:
    groups = _reshape_groups(src, dst)
    if groups is None:
        return "reshape groups not found"
    for gi, gj in groups:
        if split.dim not in gi:
            continue
        a = gi.index(split.dim)
        outer = _prod(src[x] for x in gi[:a]) * split.blocks
        inner = (src[split.dim] // (split.blocks * k)) * _prod(src[x] for x in gi[a + 1 :])
        before = 1
        for b, e in enumerate(gj):
            after = _prod(dst[x] for x in gj[b + 1 :])
            if (
                outer % before == 0
                and inner % after == 0
                and dst[e] == (outer // before) * k * (inner // after)
            ):
                return Split(e, outer // before)
            before *= dst[e]
        return f"reshape {list(src)} -> {list(dst)} splits the chunked dim {split.dim}"
    return "reshape does not cover the chunked dim"


def _perm(node: fx.Node, rank: int) -> list[int]:
    t = node.target
    if t is aten.permute.default:
        return [p % rank for p in node.args[1]]
    perm = list(range(rank))
    if t is aten.transpose.int:
        a, b = node.args[1] % rank, node.args[2] % rank
        perm[a], perm[b] = perm[b], perm[a]
    elif t is aten.t.default and rank == 2:
        perm = [1, 0]
    return perm


def _squeeze_guard(node: fx.Node, in_shape: tuple[int, ...], split: Split, k: int) -> Optional[str]:
    """squeeze removes size-1 dims: a chunk of size 1 along the split dim would vanish."""
    t = node.target
    if t not in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        return None
    if in_shape[split.dim] // k > 1 and split.blocks == 1:
        return None
    if t is aten.squeeze.default:
        return "squeeze would drop the chunked dim"
    sq = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    if split.dim in {d % len(in_shape) for d in sq}:
        return "squeeze would drop the chunked dim"
    return None


def _slice_keeps(node: fx.Node, src: tuple[int, ...], dim: int) -> Optional[str]:
    """A slice maps a split dim through when it slices another dim or is the identity on it
    (DTensor slices gathered parameters to their logical size, usually all of it)."""
    sdim = (node.args[1] if len(node.args) > 1 else 0) % len(src)
    if sdim != dim:
        return None
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    if start in (0, None) and (end is None or end >= src[dim]) and step == 1:
        return None
    return f"{node.name} slices the chunked dim"


def view_forward(node: fx.Node, split: Split, k: int) -> Split | str:
    t = node.target
    src, dst = static_shape(node.args[0]), static_shape(node)
    if t in _IDENTITY:
        return split
    if t is aten.slice.Tensor:
        return _slice_keeps(node, src, split.dim) or split
    if t in _PERMUTES:
        return Split(_perm(node, len(src)).index(split.dim), split.blocks)
    if t is aten.expand.default:
        return Split(split.dim + len(dst) - len(src), split.blocks)
    why = _squeeze_guard(node, src, split, k)
    return why if why else _map_reshape(src, dst, split, k)


def view_backward(node: fx.Node, split: Split, k: int) -> Optional[Split] | str:
    """The split of the view's input that gives ``split`` of its output (None: the input is used whole)."""
    t = node.target
    src, dst = static_shape(node.args[0]), static_shape(node)
    if t in _IDENTITY:
        return split
    if t is aten.slice.Tensor:
        return _slice_keeps(node, src, split.dim) or split
    if t in _PERMUTES:
        return Split(_perm(node, len(src))[split.dim], split.blocks)
    if t is aten.expand.default:
        d = split.dim - (len(dst) - len(src))
        return None if d < 0 or src[d] == 1 else Split(d, split.blocks)
    res = _map_reshape(dst, src, split, k)
    if isinstance(res, Split):
        why = _squeeze_guard(node, src, res, k)
        if why:
            return why
    return res


# ----------------------------------------------------------------------- one step
def forward_step(
    node: fx.Node, layouts: dict[fx.Node, ChunkLayout], dims: DimTypeAnalysis, k: int
) -> ChainStep | str:
    """``node`` computed per chunk from chained inputs (``layouts``) and side inputs."""
    why = _reject_node(node)
    if why:
        return why
    targs = _tensor_args(node)
    chained = {p: a for p, a in targs.items() if a in layouts}
    if any(isinstance(layouts[a], Partial) for a in chained.values()):
        return f"{node.name} reads a partial sum"
    if node.target in VIEWLIKE:
        if list(chained) != [0] or len(targs) != 1:
            return f"{node.name}: view of more than one tensor"
        out = view_forward(node, layouts[targs[0]], k)
        if isinstance(out, str):
            return out
        if not divisible(static_shape(node), out, k):
            return f"{node.name}: chunk dim not divisible"
        return ChainStep(node, out, {0: layouts[targs[0]]})
    lm = loop_map(node, dims)
    if isinstance(lm, str):
        return lm
    label = blocks = None
    for pos, a in chained.items():
        sp = layouts[a]
        lab = lm.ins[pos][sp.dim]
        if lab is None:
            return f"{node.name} broadcasts the chunked dim"
        if label is None:
            label, blocks = lab, sp.blocks
        elif (lab, sp.blocks) != (label, blocks):
            return f"{node.name} reads its chained inputs chunked along different dims"
    if label is None:
        return f"{node.name} reads no chained input"
    name = getattr(node.target, "__name__", str(node.target))
    if label in lm.nd or lm.reduced.get(label) == "nd":
        return f"{name} treats the chunked dim as non-splittable (ND)"
    if label in lm.reduced:
        out: ChunkLayout = Partial(lm.reduced[label])
    else:
        out = Split(lm.out.index(label), blocks)
    args: dict[int, Optional[Split]] = {}
    for pos, a in targs.items():
        if pos in chained:
            args[pos] = layouts[a]
        else:
            labels = lm.ins[pos]
            args[pos] = Split(labels.index(label), blocks) if label in labels else None
    return ChainStep(node, out, args)


def backward_step(
    node: fx.Node, out: Split, dims: DimTypeAnalysis, k: int, mutated: Optional[set[fx.Node]] = None
) -> ChainStep | str:
    """``node`` computed per chunk of its output ``out``: how each input's chunk is taken."""
    why = _reject_node(node)
    if why:
        return why
    if mutated is not None:
        hit = next((a for a in node.all_input_nodes if a in mutated), None)
        if hit is not None:  # the chain moves down to the collective: past a write to its input
            return f"{node.name} reads {hit.name}, which is written in place"
    targs = _tensor_args(node)
    if not divisible(static_shape(node), out, k):
        return f"{node.name}: chunk dim not divisible"
    if node.target in VIEWLIKE:
        if len(targs) != 1 or 0 not in targs:
            return f"{node.name}: view of more than one tensor"
        src = view_backward(node, out, k)
        return src if isinstance(src, str) else ChainStep(node, out, {0: src})
    name = getattr(node.target, "__name__", str(node.target))
    lm = loop_map(node, dims)
    if isinstance(lm, str):
        return lm
    types = dims.out(node)
    if out.dim < len(types) and types[out.dim] is not DimType.OD:
        return f"{name} treats dim {out.dim} as non-splittable (ND)"
    label = lm.out[out.dim]
    if label is None or label in lm.nd:
        return f"{name} treats dim {out.dim} as non-splittable (ND)"
    args = {
        pos: (Split(lm.ins[pos].index(label), out.blocks) if label in lm.ins[pos] else None) for pos in targs
    }
    return ChainStep(node, out, args)


# ----------------------------------------------------------------------- chains
def consumer_chain(
    c: Collective,
    dim: int,
    k: int,
    dims: DimTypeAnalysis,
    facts: GraphFacts,
    backward_nodes: set[fx.Node],
    splits: Optional[tuple[Split, Split]] = None,
) -> Chain | str:
    """``splits``: the (input, output) chunk layouts of ``c`` when the caller derived them
    (an all_to_all's, see ``expert_exchange_partition``); default :func:`transfer`'s."""
    splits = transfer(c, dim, k) if splits is None else splits
    if isinstance(splits, str):
        return splits
    split_in, split_out = splits
    root = c.logical_output
    phase = root in backward_nodes
    start_pos = facts.order[c.start]
    layouts: dict[fx.Node, ChunkLayout] = {root: split_out}
    steps: list[ChainStep] = []
    tainted: set[fx.Node] = set()
    first_refusal: Optional[str] = None
    # Nothing after the last user of a chain value can join: stop the walk there.
    horizon = max((facts.order[u] for u in root.users), default=-1)
    node = root.next
    while node.op != "output" and facts.order[node] <= horizon and len(steps) < MAX_CHAIN_OPS:
        ins = node.all_input_nodes
        if any(a in layouts or a in tainted for a in ins):
            why: Optional[str] = None
            if any(a in tainted for a in ins):
                why = "reads a value computed outside the chain"
            elif (node in backward_nodes) != phase:
                why = "in the other phase (forward/backward)"
            elif node in facts.mutated:
                why = f"{node.name} is written in place"
            else:
                for a in ins:
                    if a in layouts:
                        continue
                    if facts.last_collective[a] > start_pos:
                        why = f"{node.name} needs {a.name}, which waits for a collective issued later"
                    elif a in facts.mutated:
                        why = f"{node.name} reads {a.name}, which is written in place"
                    if why:
                        break
            step = why or forward_step(node, layouts, dims, k)
            if isinstance(step, ChainStep):
                layouts[node] = step.out
                steps.append(step)
                horizon = max([horizon, *(facts.order[u] for u in node.users)])
            else:
                tainted.add(node)
                if first_refusal is None and any(a in layouts for a in ins):
                    first_refusal = step
        node = node.next
    chain = Chain(CONSUMER, c, k, dim, split_in, split_out, root, steps)
    if not _settle_consumer(chain, facts):
        detail = f" ({first_refusal})" if first_refusal else ""
        return f"chain has no compute op{detail}"
    return chain


def _dense(node: fx.Node) -> bool:
    """Whether the value's memory is a permutation of a contiguous tensor's (size-1 dims aside)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    dims = sorted((d for d in range(val.dim()) if val.shape[d] > 1), key=lambda d: -val.stride()[d])
    expected = 1
    for d in reversed(dims):
        if val.stride()[d] != expected:
            return False
        expected *= val.shape[d]
    return True


def _outside_users(node: fx.Node, inside: set[fx.Node]) -> list[fx.Node]:
    return [u for u in node.users if u not in inside]


def _settle_consumer(chain: Chain, facts: GraphFacts) -> bool:
    """Prune trailing views and dead nodes; cut the chain back until every outside user of a
    reassembled value comes after the emission point. False: no compute op is left."""
    steps = chain.steps
    while True:
        inside = {chain.root, *(s.node for s in steps)}
        pruned = [
            s
            for s in steps
            if s.node.users and not (s.is_view and not any(u in inside for u in s.node.users))
        ]
        if len(pruned) != len(steps):
            steps = pruned
            continue
        if not any(not s.is_view for s in steps):
            chain.steps = []
            return False
        side = {a for s in steps for a in s.node.all_input_nodes if a not in inside}
        anchor = max([chain.root, *side], key=facts.order.__getitem__)
        outputs = [v for v in [chain.root, *(s.node for s in steps)] if _outside_users(v, inside)]
        # A reassembled value gets the original's strides back (a permuted dense layout);
        # an expanded or overlapping one cannot be rebuilt: cut the chain back instead.
        dense = all(_dense(v) for v in outputs)
        first_use = min(
            (facts.order[u] for v in outputs for u in _outside_users(v, inside)), default=len(facts.order)
        )
        if dense and first_use > facts.order[anchor]:
            chain.steps, chain.outputs, chain.anchor = steps, outputs, anchor
            return True
        steps = steps[:-1]


def producer_precheck(c: Collective, facts: GraphFacts) -> Optional[str]:
    """Why ``c`` has no producer chain along any dim (None: look per dim)."""
    x = c.logical_input
    if x is None or x.op != "call_function":
        return "its input is not computed in this graph"
    allowed = {c.start, *c.layout_nodes}
    if any(u not in allowed for u in x.users):
        return f"its input {x.name} is also used elsewhere"
    if x in facts.mutated:
        return f"its input {x.name} is written in place"
    return None


def producer_chain(
    c: Collective, dim: int, k: int, dims: DimTypeAnalysis, facts: GraphFacts, backward_nodes: set[fx.Node]
) -> Chain | str:
    splits = transfer(c, dim, k)
    if isinstance(splits, str):
        return splits
    split_in, split_out = splits
    why = producer_precheck(c, facts)
    if why:
        return why
    x = c.logical_input
    phase = x in backward_nodes
    first = backward_step(x, split_in, dims, k, facts.mutated)
    if isinstance(first, str):
        return f"chain is empty ({first})"
    steps = {x: first}
    # needs[a]: the splits chain nodes need of input a (None: whole)
    needs: dict[fx.Node, list[Optional[Split]]] = {}
    heap: list[tuple[int, int, fx.Node]] = []

    def visit(step: ChainStep) -> None:
        for pos, a in _tensor_args(step.node).items():
            if a not in needs:
                heapq.heappush(heap, (-facts.order[a], a.name, a))
                needs[a] = []
            needs[a].append(step.args.get(pos))

    visit(first)
    while heap:
        _, _, a = heapq.heappop(heap)
        req = needs[a]
        if len(steps) >= MAX_CHAIN_OPS or a.op != "call_function" or (a in backward_nodes) != phase:
            continue
        if a in facts.mutated or any(u not in steps for u in a.users) or any(r is None for r in req):
            continue
        if len(set(req)) != 1:
            continue
        step = backward_step(a, req[0], dims, k, facts.mutated)
        if isinstance(step, ChainStep):
            steps[a] = step
            visit(step)
    ordered = sorted(steps.values(), key=lambda s: facts.order[s.node])
    # Views that only reshape a side input stay outside: the side input is sliced as the chain reads it.
    changed = True
    while changed:
        changed = False
        inside = {s.node for s in ordered}
        for s in ordered:
            if s.is_view and s.node is not x and s.node.args[0] not in inside:
                ordered.remove(s)
                changed = True
                break
    chain = Chain(PRODUCER, c, k, dim, split_in, split_out, x, ordered)
    if not chain.compute_nodes:
        return "chain has no compute op (only views of its inputs)"
    return chain


def build_chain(
    c: Collective,
    direction: str,
    dim: int,
    k: int,
    dims: DimTypeAnalysis,
    facts: GraphFacts,
    backward_nodes: set[fx.Node],
) -> Chain | str:
    fn = consumer_chain if direction == CONSUMER else producer_chain
    return fn(c, dim, k, dims, facts, backward_nodes)
