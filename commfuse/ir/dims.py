"""Dimension types of compute nodes (Centauri Table 3).

For every tensor-valued node the analysis gives one :class:`DimType` per output
dim, saying how the op that *produces* the value treats that dim:

* ``OD`` (other): splitting the op along this dim gives independent pieces;
* ``CD`` (contraction): the dim is summed over (matmul K, sum/mean reductions);
  splitting needs an extra reduce of the partial results;
* ``ND`` (non-splittable): normalised dims (softmax, layer/RMS norm), or anything
  commfuse does not understand.

For matmul-like ops the contraction dim does not appear in the output, so the
node also records per-input dim types (``inputs``): ``mm([A,B],[B,C])`` has
inputs ``(OD, CD)`` and ``(CD, OD)`` and output ``(OD, OD)``.

Views (view/reshape/permute/transpose/t/expand/squeeze/unsqueeze/clone/...) do not
compute: their output dims *inherit* the types of the input dims they come from,
so a normalised dim stays ``ND`` after ``view([B*S, H])``. When a view merges dims,
the merged dim takes the most restrictive type of its parts.

Anything not in the tables (attention, cumsum/sort/topk/index/scatter, embedding,
losses, random ops, custom ops) is ``ND`` in every dim: a pass can never split or
move a collective through it by mistake.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from commfuse.ir.kinds import collective_spec, is_wait
from commfuse.ir.shapes import shape_of

aten = torch.ops.aten


class DimType(str, enum.Enum):
    OD = "other"
    CD = "contraction"
    ND = "non_splittable"


_SEVERITY = {DimType.OD: 0, DimType.CD: 1, DimType.ND: 2}


def worst(types) -> DimType:
    return max(types, key=lambda t: _SEVERITY[t], default=DimType.OD)


class OpCategory(str, enum.Enum):
    MATMUL = "matmul"
    ELEMENTWISE = "elementwise"
    NORM = "norm"
    SOFTMAX = "softmax"
    REDUCTION = "reduction"
    VIEW = "view"
    LAYOUT = "layout"  # split/cat/getitem: move data, never compute
    OPAQUE = "opaque"


@dataclass
class NodeDims:
    category: OpCategory
    out: tuple[DimType, ...]  # for multi-output ops: the first tensor output
    inputs: dict[int, tuple[DimType, ...]] = field(default_factory=dict)  # tensor arg position -> dims
    outs: list[tuple[DimType, ...]] | None = None  # all outputs of a tuple-returning op


_MATMUL = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.matmul.default}
_VIEWS = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.expand.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.unsqueeze.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.detach.default,
    aten._to_copy.default,
    aten.view.dtype,
}
_NORMS = {aten.native_layer_norm.default, aten.native_layer_norm_backward.default}
_SOFTMAX = {
    aten._softmax.default,
    aten._log_softmax.default,
    aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default,
}
_LINEAR_REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default}
_OTHER_REDUCTIONS = {
    aten.amax.default,
    aten.amin.default,
    aten.var.correction,
    aten.var_mean.correction,
    aten.std.correction,
    aten.max.dim,
    aten.min.dim,
    aten.logsumexp.default,
}
_LAYOUT = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.cat.default}


def _rank(node) -> int:
    s = shape_of(node)
    return 0 if s is None else len(s)


def _is_pointwise(target) -> bool:
    tags = getattr(target, "tags", ())
    return torch.Tag.pointwise in tags


class DimTypeAnalysis:
    """Dimension types of every node of a graph, computed once in graph order."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.types: dict[fx.Node, NodeDims] = {}
        for node in gm.graph.nodes:
            self.types[node] = self._visit(node)

    def __getitem__(self, node: fx.Node) -> NodeDims:
        return self.types[node]

    def out(self, node: fx.Node) -> tuple[DimType, ...]:
        return self.types[node].out

    # -- per category -------------------------------------------------------
    def _opaque(self, node: fx.Node) -> NodeDims:
        nd = tuple(DimType.ND for _ in range(_rank(node)))
        return NodeDims(
            OpCategory.OPAQUE,
            nd,
            {
                i: tuple(DimType.ND for _ in range(_rank(a)))
                for i, a in enumerate(node.args)
                if isinstance(a, fx.Node)
            },
        )

    def _src(self, a) -> tuple[DimType, ...]:
        if isinstance(a, fx.Node) and a in self.types:
            return self.types[a].out
        return ()

    def _visit(self, node: fx.Node) -> NodeDims:
        r = _rank(node)
        od = tuple(DimType.OD for _ in range(r))
        if node.op in ("placeholder", "get_attr"):
            return NodeDims(OpCategory.LAYOUT, od)
        if node.op != "call_function":
            return NodeDims(OpCategory.LAYOUT, od)
        t = node.target
        if t is operator.getitem:
            return self._getitem(node)
        if t in _MATMUL:
            return self._matmul(node)
        if t in _VIEWS:
            return self._view(node)
        if t in _NORMS:
            return self._norm(node)
        if t in _SOFTMAX:
            return self._softmax(node)
        if t in _LINEAR_REDUCTIONS or t in _OTHER_REDUCTIONS:
            return self._reduction(node)
        if t in _LAYOUT:
            return self._layout(node)
        if is_wait(t) or collective_spec(t) is not None:
            return self._collective(node)
        if _is_pointwise(t):
            return self._elementwise(node)
        return self._opaque(node)

    def _getitem(self, node: fx.Node) -> NodeDims:
        parent = node.args[0]
        pd = self.types.get(parent) if isinstance(parent, fx.Node) else None
        if pd is None:
            return self._opaque(node)
        if pd.outs is not None and isinstance(node.args[1], int) and node.args[1] < len(pd.outs):
            return NodeDims(pd.category, pd.outs[node.args[1]])
        if pd.category is OpCategory.OPAQUE:
            return self._opaque(node)
        return NodeDims(
            OpCategory.LAYOUT,
            pd.out if len(pd.out) == _rank(node) else tuple(DimType.ND for _ in range(_rank(node))),
        )

    def _matmul(self, node: fx.Node) -> NodeDims:
        OD, CD = DimType.OD, DimType.CD
        t = node.target
        if t is aten.mm.default:
            ins = {0: (OD, CD), 1: (CD, OD)}
        elif t is aten.addmm.default:
            ins = {0: tuple(OD for _ in range(_rank(node.args[0]))), 1: (OD, CD), 2: (CD, OD)}
        elif t is aten.bmm.default:
            ins = {0: (OD, OD, CD), 1: (OD, CD, OD)}
        elif t is aten.baddbmm.default:
            ins = {0: tuple(OD for _ in range(_rank(node.args[0]))), 1: (OD, OD, CD), 2: (OD, CD, OD)}
        else:  # matmul: batch dims OD, last of a / second-to-last of b contracted
            ra, rb = _rank(node.args[0]), _rank(node.args[1])
            a = tuple(OD for _ in range(ra - 1)) + (CD,)
            b = (CD,) if rb == 1 else tuple(OD for _ in range(rb - 2)) + (CD, OD)
            ins = {0: a, 1: b}
        return NodeDims(OpCategory.MATMUL, tuple(OD for _ in range(_rank(node))), ins)

    def _elementwise(self, node: fx.Node) -> NodeDims:
        # Element-wise ops split along any dim (Table 3: OD everywhere), broadcast dims included.
        ins = {
            i: tuple(DimType.OD for _ in range(_rank(a)))
            for i, a in enumerate(node.args)
            if isinstance(a, fx.Node)
        }
        return NodeDims(OpCategory.ELEMENTWISE, tuple(DimType.OD for _ in range(_rank(node))), ins)

    def _norm(self, node: fx.Node) -> NodeDims:
        x = node.args[0] if node.target is aten.native_layer_norm.default else node.args[1]
        normalized = node.args[1] if node.target is aten.native_layer_norm.default else node.args[2]
        rx = _rank(x)
        k = len(normalized)
        main = tuple(DimType.OD if d < rx - k else DimType.ND for d in range(rx))
        stats = tuple(DimType.OD if d < rx - k else DimType.ND for d in range(rx))
        outs = [main, stats, stats]
        return NodeDims(OpCategory.NORM, main, {0: main}, outs=outs)

    def _softmax(self, node: fx.Node) -> NodeDims:
        r = _rank(node)
        dim_arg = (
            node.args[1]
            if node.target in (aten._softmax.default, aten._log_softmax.default)
            else node.args[2]
        )
        dim = dim_arg % r if r else 0
        out = tuple(DimType.ND if d == dim else DimType.OD for d in range(r))
        return NodeDims(OpCategory.SOFTMAX, out, {0: out})

    def _reduction(self, node: fx.Node) -> NodeDims:
        x = node.args[0]
        rx = _rank(x)
        dims = (
            node.args[1]
            if len(node.args) > 1 and isinstance(node.args[1], (list, tuple))
            else node.kwargs.get("dim")
        )
        if isinstance(dims, int):
            dims = [dims]
        reduced = set(range(rx)) if not dims else {d % rx for d in dims}
        red_type = DimType.CD if node.target in _LINEAR_REDUCTIONS else DimType.ND
        ins = {0: tuple(red_type if d in reduced else DimType.OD for d in range(rx))}
        r = _rank(node)
        if r == rx:  # keepdim: reduced dims become size 1 and stay non-splittable
            out = tuple(DimType.ND if d in reduced else DimType.OD for d in range(r))
        else:
            out = tuple(DimType.OD for _ in range(r))
        outs = [out, out] if node.target in (aten.var_mean.correction, aten.max.dim, aten.min.dim) else None
        return NodeDims(OpCategory.REDUCTION, out, ins, outs=outs)

    def _layout(self, node: fx.Node) -> NodeDims:
        t = node.target
        if t is aten.cat.default:
            srcs = [self._src(a) for a in node.args[0] if isinstance(a, fx.Node)]
            r = _rank(node)
            out = tuple(worst(s[d] for s in srcs if d < len(s)) for d in range(r))
            return NodeDims(OpCategory.LAYOUT, out)
        src = self._src(node.args[0])
        return NodeDims(OpCategory.LAYOUT, src, outs=None)

    def _collective(self, node: fx.Node) -> NodeDims:
        # Collectives move data without computing on it: dims keep their producer's types
        # (the gathered/scattered dim changes size, not meaning).
        src = self._src(node.args[0]) if node.args else ()
        r = _rank(node)
        out = src if len(src) == r else tuple(DimType.ND for _ in range(r))
        return NodeDims(OpCategory.LAYOUT, out)

    def _view(self, node: fx.Node) -> NodeDims:
        src_node = node.args[0]
        src = self._src(src_node)
        t = node.target
        r = _rank(node)
        if t is aten.permute.default:
            perm = [p % len(src) for p in node.args[1]] if src else []
            out = tuple(src[p] for p in perm) if len(perm) == r else None
        elif t is aten.transpose.int and src:
            d0, d1 = node.args[1] % len(src), node.args[2] % len(src)
            lst = list(src)
            lst[d0], lst[d1] = lst[d1], lst[d0]
            out = tuple(lst)
        elif t is aten.t.default:
            out = tuple(reversed(src))
        elif t is aten.expand.default:
            out = tuple(DimType.OD for _ in range(r - len(src))) + tuple(src)
        elif t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            out = _reshape_types(shape_of(src_node), shape_of(node), src)
        elif t is aten.unsqueeze.default and src:
            d = node.args[1] % r
            out = src[:d] + (DimType.OD,) + src[d:]
        elif t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            out = _reshape_types(shape_of(src_node), shape_of(node), src)
        else:  # clone/contiguous/alias/detach/_to_copy/view.dtype keep dims
            out = src if len(src) == r else None
        if out is None or len(out) != r:
            out = tuple(DimType.ND for _ in range(r))
        return NodeDims(OpCategory.VIEW, out)


def _reshape_types(src_shape, dst_shape, src_types) -> tuple[DimType, ...] | None:
    """Map dim types through a reshape by grouping dims whose products match."""
    if src_shape is None or dst_shape is None or len(src_types) != len(src_shape):
        return None
    out: list[DimType] = []
    i = j = 0
    while i < len(src_shape) or j < len(dst_shape):
        gi, gj = [i] if i < len(src_shape) else [], [j] if j < len(dst_shape) else []
        ps = src_shape[i] if i < len(src_shape) else 1
        pd = dst_shape[j] if j < len(dst_shape) else 1
        i, j = i + (1 if gi else 0), j + (1 if gj else 0)
        guard = 0
        while ps != pd:
            guard += 1
            if guard > 64:
                return None
            try:
                grow_src = bool(ps < pd)
            except TypeError:  # symbolic sizes we cannot order: give up conservatively
                return None
            if grow_src and i < len(src_shape):
                ps = ps * src_shape[i]
                gi.append(i)
                i += 1
            elif j < len(dst_shape):
                pd = pd * dst_shape[j]
                gj.append(j)
                j += 1
            else:
                return None
        t = worst(src_types[k] for k in gi)
        out.extend(t for _ in gj)
    return tuple(out)
