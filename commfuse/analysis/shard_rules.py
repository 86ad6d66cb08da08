"""How one compute op runs on shards: the rules collective motion propagates with.

A value in a *region* is held in local form instead of full form:

* ``Sharded(d)``: the rank holds chunk ``rank`` of the full value along dim ``d``
  (``d`` is a dim of the full value; equal chunks over the group);
* ``Partial()``: the full value is the sum over the group of the local values
  (what a sum over the sharded dim leaves);
* ``Complete()``: the local value *is* the full value (this rank's own chunk taken
  from a sharded value, an expert-weight gradient that already sums every
  rank's tokens). Nothing consumes it inside a region; its users outside take the
  local value as it is, with no collective.

:func:`local_rule` decides whether a node can be computed from the local forms of
its inputs and, if so, what the local node's arguments are and which layout each of
its outputs has. It only admits ops whose value along the sharded dim is computed
independently (Centauri Table 3 "other" dims; the IR's :mod:`~commfuse.ir.dims`
names the same categories): element-wise ops, row-wise norms and softmax whose
normalised dims exclude the sharded one, reductions (over the sharded dim only
``sum``, giving ``Partial``), and views that keep the sharded dim contiguous. Everything
else — matmuls (the boundary where the full value is gathered back), attention,
indexing, random ops, in-place ops, ops with symbolic shapes — is refused, so motion
stops there.

Rules are exact about shapes: a view's size arguments are rewritten to the local
sizes, so the local graph never computes a shape from a full size.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from commfuse.analysis.moe_rules import MOE_RULES
from commfuse.analysis.shard_layouts import Complete, LocalOp, Partial, Replicated, RuleEnv, Sharded, StateOf
from commfuse.ir.rewrite import mutates
from commfuse.ir.shapes import shape_of

aten = torch.ops.aten


_SAME = {
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.contiguous.default,
    aten._to_copy.default,
}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_SUM = {aten.sum.dim_IntList}
_ROW_REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default}
_PARTIAL_VIEWS = _RESHAPES | {
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.expand.default,
}


def _static(shape) -> bool:
    return shape is not None and all(isinstance(s, int) for s in shape)


def _pointwise(target) -> bool:
    schema = getattr(target, "_schema", None)
    return (
        torch.Tag.pointwise in getattr(target, "tags", ())
        and schema is not None
        and not schema.is_mutable
        and torch.Tag.nondeterministic_seeded not in target.tags
    )


def local_rule(node: fx.Node, state: StateOf, env: RuleEnv) -> LocalOp | None:
    """The local form of ``node`` given its inputs' layouts, or None (stay full).

    Inputs without a local form are used as they are on every rank, so they must be
    ``replicated`` over the group (else rank j's shard would be computed with rank j's
    copy instead of each rank's own) and broadcast along the sharded dim."""
    if node.op != "call_function" or mutates(node):
        return None
    if any(not _static(shape_of(a)) for a in node.all_input_nodes if shape_of(a) is not None):
        return None
    t = node.target
    n, replicated = env.n, env.replicated
    ins = [a for a in node.all_input_nodes if state(a) is not None]
    if not ins or any(isinstance(state(a), Complete) for a in ins):
        return None
    moe_rule = MOE_RULES.get(t)
    if moe_rule is not None:
        return moe_rule(node, state, env)
    if t is aten.split.Tensor:
        return _own_chunk(node, state, env)
    if any(isinstance(state(a), Partial) for a in ins):
        return _partial_rule(node, state)
    if t is operator.getitem:
        return None  # handled by the caller from the parent's tuple layout
    if t in _SAME:
        return LocalOp(node.args, dict(node.kwargs), state(node.args[0]))
    if t in _RESHAPES:
        return _reshape(node, state, n)
    if t is aten.expand.default:
        return _expand(node, state, n)
    if t in (
        aten.permute.default,
        aten.transpose.int,
        aten.t.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
    ):
        return _dim_map(node, state)
    if t in _ROW_REDUCTIONS:
        return _reduction(node, state)
    if t is aten.native_layer_norm.default:
        return _layer_norm(node, state, replicated)
    if t is aten.native_layer_norm_backward.default:
        return _layer_norm_backward(node, state, replicated)
    if t in (aten._softmax.default, aten._log_softmax.default):
        return _softmax(node, state, node.args[0], node.args[1])
    if t in (aten._softmax_backward_data.default, aten._log_softmax_backward_data.default):
        return _softmax(node, state, node.args[0], node.args[2], also=(node.args[1],))
    if _pointwise(t):
        return _elementwise(node, state, replicated)
    return None


# ----------------------------------------------------------------- rules
def _own_chunk(node: fx.Node, state: StateOf, env: RuleEnv) -> LocalOp | None:
    """``split(x, size, d)`` of a value sharded along ``d`` into the group's chunks, whose
    only use is this rank's piece (DTensor's Replicate -> Shard): the local chunk itself."""
    x = node.args[0]
    size = node.args[1]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    s, shape = state(x), shape_of(x)
    if env.rank is None or not isinstance(s, Sharded) or not isinstance(size, int):
        return None
    if dim % len(shape) != s.dim or size * env.n != shape[s.dim]:
        return None
    if not node.users or any(u.target is not operator.getitem or u.args[1] != env.rank for u in node.users):
        return None
    # The local chunk is `size` long: splitting it gives one piece, the one this rank keeps.
    return LocalOp(
        node.args,
        dict(node.kwargs),
        tuple(Complete() if i == env.rank else None for i in range(env.n)),
        index_map={env.rank: 0},
    )


def _elementwise(node: fx.Node, state: StateOf, replicated: Replicated) -> LocalOp | None:
    out_shape = shape_of(node)
    if out_shape is None:
        return None
    r_out = len(out_shape)
    d_out = None
    tensors = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
    for a in tensors:
        s = state(a)
        if isinstance(s, Sharded):
            cand = s.dim + r_out - len(shape_of(a))
            if d_out is not None and cand != d_out:
                return None
            d_out = cand
    if d_out is None:
        return None
    for a in tensors:
        if state(a) is None:
            sh = shape_of(a)
            if sh is None or not replicated(a):
                return None
            aligned = d_out - (r_out - len(sh))
            if aligned >= 0 and sh[aligned] != 1:
                return None  # a full operand that varies along the sharded dim: would need slicing
    return LocalOp(node.args, dict(node.kwargs), Sharded(d_out))


def _reshape_groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]] | None:
    """Pair up runs of src/dst dims whose products match (the reshape's dim groups)."""
    if 0 in src or 0 in dst:
        return None
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj = [i], [j]
        ps, pd = src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd and i < len(src):
                ps, i = ps * src[i], i + 1
                gi.append(i - 1)
            elif ps > pd and j < len(dst):
                pd, j = pd * dst[j], j + 1
                gj.append(j - 1)
            else:
                return None
        groups.append((gi, gj))
    rest_i, rest_j = list(range(i, len(src))), list(range(j, len(dst)))
    if any(src[k] != 1 for k in rest_i) or any(dst[k] != 1 for k in rest_j):
        return None
    if rest_i or rest_j:
        if groups:
            groups[-1] = (groups[-1][0] + rest_i, groups[-1][1] + rest_j)
        else:
            groups.append((rest_i, rest_j))
    return groups


def _reshape(node: fx.Node, state: StateOf, n: int) -> LocalOp | None:
    src, dst = shape_of(node.args[0]), shape_of(node)
    s = state(node.args[0])
    if not isinstance(s, Sharded) or src is None or dst is None:
        return None
    groups = _reshape_groups(tuple(src), tuple(dst))
    if groups is None:
        return None
    for gi, gj in groups:
        if s.dim not in gi:
            continue
        if any(src[k] != 1 for k in gi if k < s.dim):
            return None  # the shard is not a contiguous run of the merged dim
        outer = [k for k in gj if dst[k] != 1]
        if not outer or dst[outer[0]] % n:
            return None
        d = outer[0]
        local = list(dst)
        local[d] //= n
        return LocalOp((node.args[0], local), {}, Sharded(d))
    return None


def _expand(node: fx.Node, state: StateOf, n: int) -> LocalOp | None:
    src, dst = shape_of(node.args[0]), shape_of(node)
    s = state(node.args[0])
    if not isinstance(s, Sharded):
        return None
    d = s.dim + len(dst) - len(src)
    sizes = list(node.args[1])
    if sizes[d] not in (-1, src[s.dim]):
        return None
    sizes = [dst[k] if k != d else dst[k] // n for k in range(len(dst))]
    return LocalOp((node.args[0], sizes), dict(node.kwargs), Sharded(d))


def _dim_map(node: fx.Node, state: StateOf) -> LocalOp | None:
    s = state(node.args[0])
    if not isinstance(s, Sharded):
        return None
    rank = len(shape_of(node.args[0]))
    t, d = node.target, s.dim
    if t is aten.permute.default:
        perm = [p % rank for p in node.args[1]]
        out = perm.index(d)
    elif t is aten.transpose.int:
        a, b = node.args[1] % rank, node.args[2] % rank
        out = b if d == a else a if d == b else d
    elif t is aten.t.default:
        out = (rank - 1 - d) if rank == 2 else d
    elif t is aten.unsqueeze.default:
        u = node.args[1] % (rank + 1)
        out = d + 1 if u <= d else d
    else:  # squeeze.dim / squeeze.dims; the sharded dim has size >= N > 1, so it never squeezes
        src = shape_of(node.args[0])
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        squeezed = {x % rank for x in dims if src[x % rank] == 1}
        out = d - sum(1 for x in squeezed if x < d)
    return LocalOp(node.args, dict(node.kwargs), Sharded(out))


def _reduction(node: fx.Node, state: StateOf) -> LocalOp | None:
    s = state(node.args[0])
    if not isinstance(s, Sharded):
        return None
    rank = len(shape_of(node.args[0]))
    dims_arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims_arg is None or (isinstance(dims_arg, (list, tuple)) and not dims_arg):
        reduced = set(range(rank))
    else:
        dims_arg = dims_arg if isinstance(dims_arg, (list, tuple)) else [dims_arg]
        reduced = {x % rank for x in dims_arg}
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if s.dim in reduced:
        if node.target in _SUM and node.kwargs.get("dtype") is None:
            return LocalOp(node.args, dict(node.kwargs), Partial())
        return None
    out = s.dim if keepdim else s.dim - sum(1 for x in reduced if x < s.dim)
    return LocalOp(node.args, dict(node.kwargs), Sharded(out))


def _layer_norm(node: fx.Node, state: StateOf, replicated: Replicated) -> LocalOp | None:
    x, normalized = node.args[0], node.args[1]
    s = state(x)
    rank = len(shape_of(x))
    if not isinstance(s, Sharded) or s.dim >= rank - len(normalized):
        return None
    if any(state(a) is not None or not replicated(a) for a in node.args[2:4] if isinstance(a, fx.Node)):
        return None
    return LocalOp(node.args, dict(node.kwargs), (Sharded(s.dim), Sharded(s.dim), Sharded(s.dim)))


def _layer_norm_backward(node: fx.Node, state: StateOf, replicated: Replicated) -> LocalOp | None:
    grad, x, normalized, mean, rstd, w, b = node.args[:7]
    rank = len(shape_of(x))
    layouts = {state(a) for a in (grad, x, mean, rstd)}
    if len(layouts) != 1:
        return None
    (s,) = layouts
    if not isinstance(s, Sharded) or s.dim >= rank - len(normalized):
        return None
    if any(isinstance(a, fx.Node) and (state(a) is not None or not replicated(a)) for a in (w, b)):
        return None
    return LocalOp(node.args, dict(node.kwargs), (Sharded(s.dim), Partial(), Partial()))


def _softmax(node: fx.Node, state: StateOf, x: fx.Node, dim: int, also: tuple = ()) -> LocalOp | None:
    s = state(x)
    rank = len(shape_of(x))
    if not isinstance(s, Sharded) or s.dim == dim % rank or any(state(a) != s for a in also):
        return None
    return LocalOp(node.args, dict(node.kwargs), Sharded(s.dim))


def _partial_rule(node: fx.Node, state: StateOf) -> LocalOp | None:
    """Partial values only flow through shape ops, sums, and scaling by a constant:
    the maps that commute with the sum over ranks (bit-for-bit up to summation order)."""
    t = node.target
    tensors = [a for a in node.all_input_nodes]
    if any(not isinstance(state(a), Partial) for a in tensors):
        return None
    if t in _PARTIAL_VIEWS or t in _SUM or t is aten.sum.default:
        if t in _SUM and node.kwargs.get("dtype") is not None:
            return None
        return LocalOp(node.args, dict(node.kwargs), Partial())
    if t in (aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar, aten.neg.default):
        if len(tensors) == 1 and node.args[0] is tensors[0]:
            return LocalOp(node.args, dict(node.kwargs), Partial())
    return None


def value_bytes(node: fx.Node) -> int:
    """Bytes of ``node``'s value as its ``meta["val"]`` has it (0 without one)."""
    v = node.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return 0
    return math.prod(v.shape) * v.element_size()
