"""fuse_collectives: replace an adjacent pair of collectives on one group by one collective.

Contract
- Matches: *adjacent pairs* ``(A, B)`` of functional collectives: B's logical input
  is A's logical output, directly or through same-shape, value-preserving views
  (``view``/``reshape``/``_unsafe_view``/``expand`` to the same shape, ``alias``,
  ``detach``, ``clone``), and that value has no other user (each node of the chain
  feeds only the next; B's input feeds only B and its layout shuffle). Logical
  inputs/outputs and dims are the IR's (DTensor's split/cat shuffles seen through).
- Fuses a pair only if: the same group (:meth:`GroupInfo.same_members`: equal names, or
  both groups' global ranks known and equal in group-rank order; the fused collective is
  issued on the *first* collective's group); neither coalesced nor in place; exactly
  one wait each; static shapes; all_to_all with equal splits; every dim the fused
  form chunks divisible by what it chunks into (non-empty); a reduce op the row
  allows. Every adjacent pair that is not fused (including pairs whose kinds are
  not in the table below) is reported in ``refusals`` as
  ``"<A>+<B>: not fused: <reason>"``.
- Does: inserts the fused form (one collective or none, plus local ATen work)
  right before A (where A read its input, so a later in-place update of that input
  cannot leak in), replaces every use of B's logical output by its result and
  erases A and B. Pairs are fused greedily in graph order, the IR rebuilt after
  each fusion, until no adjacent pair fuses: a fused result that is again a bare
  collective may fuse with its neighbour (Chimera: fusion can be applied
  repeatedly). Every fusion removes at least one collective, so this terminates.
- Guarantees: the same values as the unfused pair up to floating-point reduction
  order (``N·x`` replaces the sum of ``N`` equal copies; an all_reduce reduces what
  the reduce_scatter reduced); never more bytes per rank on the wire than the pair
  (ring conventions, see docs/fusion-table.md); the same group (the first collective's;
  no process group is created); decisions depend only on the graph and the groups'
  membership, which every member of a group sees alike, so the ranks that communicate
  on a group agree.

Semantics (group of N ranks; x_i is rank i's input; chunk_r(v, d) is the r-th of N
equal chunks of v along d; piece_k(v, d) the k-th of N·N equal pieces; cat^d
concatenates along d; op is the reduce op; every rank r ends with z_r):

  AG_d(x)_r          = cat_i^d x_i                      (same on every rank)
  RS_op,d(x)_r       = op_i chunk_r(x_i, d)
  A2A_s->c(x)_r      = cat_i^c chunk_r(x_i, s)          (equal splits)
  AR_op(x)_r         = op_i x_i

  pair (first+second)      fused form  (z_r on rank r)
  RS_op,d1 + AG_d2         v = AR_op(x);  z = cat_r^d2 chunk_r(v, d1)     (z = v if d1 == d2)
  AG_dg + RS_op,ds         ds == dg: z_r = x_r·N (sum) or x_r (avg/max/min): no communication
                           ds != dg: z_r = A2A_ds->dg(x)_r·N (sum) or A2A_ds->dg(x)_r (avg/max/min)
  AG_d1 + AG_d2            v = AG_d1(x);  z = cat^d2 of N copies of v
  AG_dg + A2A_s->c         v_r = x_r (s == dg) or A2A_s->dg(x)_r (s != dg); z_r = cat^c of N copies of v_r
  A2A_s1->c1 + A2A_s2->c2  s2 == c1: z_r = cat_j^c2 chunk_j(x_r, s1): no communication
                           s2 != c1: w_{i,r} = chunk_r(p_i, s2) sent by i to r (one A2A), with
                             p = x if s1 != s2, else x pre-permuted along s1 so that
                             chunk_r(p, s1) = cat_j^s1 piece_{jN+r}(x, s1);
                           z_r = cat_j^c2 cat_i^c1 chunk_j(w_{i,r}, s1)
  RS_op,dr + A2A_s->c      p = x if s != dr, else x pre-permuted along dr as above;
                           v = RS_op,s(p);  z_r = cat_j^c chunk_j(v_r, dr)
  A2A_s->c + AG_d          u = AG_0(x) = (x_0, ..., x_{N-1});  z = cat_r^d cat_i^c chunk_r(x_i, s)
  A2A_s->c + RS_op,d       L(v) = op_j chunk_j(v, s) (local; avg: mean over the N chunks)
                           d == c: z_r = L(x_r): no communication
                           d != c: z_r = A2A_d->c(L(x))_r

Left alone (reported): every other pair of kinds (all_reduce, broadcast, p2p and
RS + RS, which Chimera lists as not fusible), pairs on different groups (a different name
and different or unknown ranks; the same ranks in another order are a different group), and the
Table 3 rows that need P2P or many-to-many scatter (pipeline boundaries: ``boundary_fusion``).

Source: Chimera §3.3, Table 3 (fused operator for every adjacent pair). The paper
gives only the table; the data-layout semantics above are derived here and proven
numerically by tests/test_fuse_collectives.py (docs/fusion-table.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx as fx

from commfuse.ir import rewrite
from commfuse.ir.collective import Collective
from commfuse.ir.kinds import CollectiveKind, collective_spec
from commfuse.ir.shapes import shape_of
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext

aten = torch.ops.aten
K = CollectiveKind

# Ops that return their first argument's value unchanged (same shape, same elements).
_ALIASES = {aten.alias.default, aten.detach.default, aten.clone.default}
_SAME_SHAPE_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}

# Reduce ops for which reducing N identical copies is a local function of one copy.
_REPLICA_OPS = ("sum", "avg", "max", "min")
# Reduce ops a local reduction over chunks can express (A2A + RS).
_LOCAL_REDUCE_OPS = ("sum", "avg", "max", "min")


# ----------------------------------------------------------------- local pieces
def _chunks(v: torch.Tensor, n: int, d: int) -> list[torch.Tensor]:
    return list(torch.chunk(v, n, d))


def _rechunk(v: torch.Tensor, n: int, src: int, dst: int) -> torch.Tensor:
    """cat_j^dst chunk_j(v, src) (a fresh tensor)."""
    if src == dst:
        return v.clone()
    return torch.cat(_chunks(v, n, src), dst)


def _repeat(v: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """cat^d of n copies of v."""
    return torch.cat([v] * n, d)


def _interleave(x: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """Permute the N·N equal pieces of x along d so that chunk_r of the result is
    cat_j piece_{j·N+r}(x): piece index j·N+r moves to r·N+j."""
    shape = list(x.shape)
    k = shape[d] // (n * n)
    y = x.reshape(shape[:d] + [n, n, k] + shape[d + 1:]).transpose(d, d + 1)
    return y.reshape(shape)


def _local_reduce(x: torch.Tensor, op: str, n: int, d: int) -> torch.Tensor:
    """op_j chunk_j(x, d), elementwise over the N chunks (avg: their mean)."""
    pieces = _chunks(x, n, d)
    acc = pieces[0]
    for p in pieces[1:]:
        if op in ("sum", "avg"):
            acc = acc + p
        elif op == "max":
            acc = torch.maximum(acc, p)
        else:
            acc = torch.minimum(acc, p)
    if op == "avg":
        acc = acc / n
    elif n == 1:
        acc = acc.clone()
    return acc


# ----------------------------------------------------------------- fused forms
def _fused_rs_ag(x, op, d1, d2, n, g):
    v = rewrite.all_reduce(x, op, g)
    return v if d1 == d2 else _rechunk(v, n, d1, d2)


def _fused_ag_rs(x, op, dg, ds, n, g):
    v = x if ds == dg else rewrite.all_to_all(x, ds, dg, n, g)
    if op == "sum":
        return v * n
    return v.clone() if ds == dg else v


def _fused_ag_ag(x, d1, d2, n, g):
    return _repeat(rewrite.all_gather(x, d1, n, g), n, d2)


def _fused_ag_a2a(x, dg, s, c, n, g):
    v = x if s == dg else rewrite.all_to_all(x, s, dg, n, g)
    return _repeat(v, n, c)


def _fused_a2a_a2a(x, s1, c1, s2, c2, n, g):
    if s2 == c1:
        return _rechunk(x, n, s1, c2)
    p = _interleave(x, n, s1) if s1 == s2 else x
    received = _chunks(rewrite.all_to_all(p, s2, 0, n, g), n, 0)  # w_{i,r}, i = sender
    return torch.cat([torch.cat([_chunks(w, n, s1)[j] for w in received], c1) for j in range(n)], c2)


def _fused_rs_a2a(x, op, dr, s, c, n, g):
    p = _interleave(x, n, dr) if s == dr else x
    v = rewrite.reduce_scatter(p, op, s, n, g)
    return v if dr == c else _rechunk(v, n, dr, c)


def _fused_a2a_ag(x, s, c, d, n, g):
    xs = _chunks(rewrite.all_gather(x, 0, n, g), n, 0)  # x_i, i = rank
    return torch.cat([torch.cat([_chunks(xi, n, s)[r] for xi in xs], c) for r in range(n)], d)


def _fused_a2a_rs(x, s, c, op, d, n, g):
    v = _local_reduce(x, op, n, s)
    return v if d == c else rewrite.all_to_all(v, d, c, n, g)


# ----------------------------------------------------------------- matching
@dataclass
class Pair:
    first: Collective
    second: Collective
    chain: list[fx.Node]  # first's logical output ... second's logical input, in data-flow order

    @property
    def label(self) -> str:
        return f"{self.first.name}+{self.second.name}"

    @property
    def kinds(self) -> str:
        return f"{self.first.kind.value} + {self.second.kind.value}"


def _is_value_alias(node: fx.Node) -> bool:
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.target in _ALIASES:
        return True
    if node.target in _SAME_SHAPE_VIEWS:
        a, b = shape_of(node), shape_of(node.args[0])
        return a is not None and a == b
    return False


def find_pairs(collectives: list[Collective]) -> list[Pair]:
    """Every adjacent pair, ordered by the first collective then the second (graph order)."""
    producer: dict[fx.Node, Collective] = {}
    for c in collectives:
        outs = [c.logical_output] if c.logical_output is not None else list(c.waits)
        for o in outs:
            producer.setdefault(o, c)
    pairs: dict[tuple[int, int], Pair] = {}
    for c2 in collectives:
        starts = [c2.logical_input] if c2.logical_input is not None else list(c2.inputs)
        for s in starts:
            chain, node = [s], s
            while node not in producer and _is_value_alias(node):
                node = node.args[0]
                chain.append(node)
            c1 = producer.get(node)
            if c1 is not None and c1 is not c2 and (c1.index, c2.index) not in pairs:
                pairs[(c1.index, c2.index)] = Pair(c1, c2, list(reversed(chain)))
    return [pairs[k] for k in sorted(pairs)]


def _static(shape) -> bool:
    return shape is not None and all(isinstance(s, int) for s in shape)


def _a2a_splits_equal(c: Collective) -> bool:
    if not c.extra.get("equal_splits", False):
        return False
    spec = collective_spec(c.start.target)
    args = spec.parse(tuple(c.start.args), dict(c.start.kwargs))
    shape = shape_of(c.inputs[0])
    n = c.group.size
    for sizes in (args.input_split_sizes, args.output_split_sizes):
        if sizes is None:
            continue
        if not all(isinstance(s, int) for s in sizes) or len(sizes) != n:
            return False
        if shape is None or not shape or any(s * n != shape[0] for s in sizes):
            return False
    return True


def _divides(shape, d: int, k: int) -> bool:
    return 0 <= d < len(shape) and shape[d] > 0 and shape[d] % k == 0


def _check_pair(p: Pair) -> Optional[str]:
    a, b = p.first, p.second
    if not a.group.same_members(b.group):
        if a.group.ranks is None or b.group.ranks is None:
            unknown = " and ".join(repr(g.name) for g in (a.group, b.group) if g.ranks is None)
            return f"groups differ (names {a.group.name!r} vs {b.group.name!r}; ranks of {unknown} unknown)"
        return f"groups differ in members ({a.group.describe()} vs {b.group.describe()})"
    if (a.kind, b.kind) not in _FUSIONS:
        return "not in the fusion table"
    for c in (a, b):
        if c.coalesced:
            return f"{c.name} is coalesced"
        if c.inplace:
            return f"{c.name} is in place"
        if len(c.waits) != 1:
            return f"{c.name} does not have exactly one wait"
        if c.logical_input is None or c.logical_output is None:
            return f"{c.name} has no single logical input/output"
        if c.kind is K.ALL_TO_ALL and not _a2a_splits_equal(c):
            return f"{c.name} is an all_to_all with unequal (or dynamic) splits"
        if c.kind is not K.ALL_REDUCE and c.logical_dim is None:
            return f"{c.name} has no logical dim"
        if not all(_static(shape_of(v)) for v in (c.logical_input, c.logical_output)):
            return f"{c.name} has dynamic shapes"
    n = a.group.size
    if n is None or n < 1:
        return "group size unknown"
    # The intermediate value: each node of the chain feeds only the next one, and the
    # second collective's input feeds only it (and its layout shuffle).
    for node, nxt in zip(p.chain, p.chain[1:]):
        if set(node.users) != {nxt}:
            return "intermediate value has other users"
    allowed = set(b.layout_nodes) | {b.start}
    if not p.chain[-1].users or not set(p.chain[-1].users) <= allowed:
        return "intermediate value has other users"
    return _FUSIONS[(a.kind, b.kind)].check(a, b, n)


# ----------------------------------------------------------------- the table
@dataclass(frozen=True)
class Fusion:
    key: str
    check: Callable[[Collective, Collective, int], Optional[str]]  # -> refusal reason
    plan: Callable[[Collective, Collective, int], tuple[Callable, tuple]]  # -> (fn, consts after x)


def _xshape(a: Collective):
    return tuple(shape_of(a.logical_input))


def _need(shape, d: int, k: int, what: str) -> Optional[str]:
    if not _divides(shape, d, k):
        size = shape[d] if 0 <= d < len(shape) else "?"
        return f"dim {d} of the input (size {size}) is not divisible by {k} ({what})"
    return None


def _check_rs_ag(a, b, n):
    return _need(_xshape(a), a.logical_dim, n, "scatter dim")


def _check_ag_rs(a, b, n):
    if b.reduce_op not in _REPLICA_OPS:
        return f"reduce op {b.reduce_op!r} of a replicated value has no local form"
    if b.logical_dim != a.logical_dim:
        return _need(_xshape(a), b.logical_dim, n, "scatter dim")
    return None


def _check_ag_ag(a, b, n):
    return None


def _check_ag_a2a(a, b, n):
    if b.logical_dim != a.logical_dim:
        return _need(_xshape(a), b.logical_dim, n, "split dim")
    return None


def _check_a2a_a2a(a, b, n):
    x = _xshape(a)
    s1, c1, s2 = a.logical_dim, a.logical_concat_dim, b.logical_dim
    if c1 is None or b.logical_concat_dim is None:
        return "all_to_all concat dim unknown"
    if s2 == c1:
        return _need(x, s1, n, "split dim")
    if s1 == s2:
        return _need(x, s1, n * n, "split dim, N·N pieces")
    return _need(x, s1, n, "first split dim") or _need(x, s2, n, "second split dim")


def _check_rs_a2a(a, b, n):
    x = _xshape(a)
    dr, s = a.logical_dim, b.logical_dim
    if b.logical_concat_dim is None:
        return "all_to_all concat dim unknown"
    if s == dr:
        return _need(x, dr, n * n, "scatter dim, N·N pieces")
    return _need(x, dr, n, "scatter dim") or _need(x, s, n, "split dim")


def _check_a2a_ag(a, b, n):
    if a.logical_concat_dim is None:
        return "all_to_all concat dim unknown"
    x = _xshape(a)
    if not x:
        return "0-d input"
    return _need(x, a.logical_dim, n, "split dim")


def _check_a2a_rs(a, b, n):
    if a.logical_concat_dim is None:
        return "all_to_all concat dim unknown"
    if b.reduce_op not in _LOCAL_REDUCE_OPS:
        return f"reduce op {b.reduce_op!r} has no local form"
    if b.reduce_op == "avg" and (b.dtype is None or not b.dtype.is_floating_point):
        return f"reduce op 'avg' on {b.dtype}"
    x = _xshape(a)
    s, c, d = a.logical_dim, a.logical_concat_dim, b.logical_dim
    why = _need(x, s, n, "split dim")
    if why or d == c:
        return why
    local = list(x)
    local[s] //= n
    return _need(local, d, n, "scatter dim of the locally reduced value")


# Every plan issues on the first collective's group (``a.group.name``, size ``n`` from it):
# :func:`_check_pair` admitted the pair only if the second's group has the same members in
# the same group-rank order, so which chunk each rank sends and receives is unchanged.
_FUSIONS: dict[tuple[CollectiveKind, CollectiveKind], Fusion] = {
    (K.REDUCE_SCATTER, K.ALL_GATHER): Fusion(
        "fused_rs_ag", _check_rs_ag,
        lambda a, b, n: (_fused_rs_ag, (a.reduce_op, a.logical_dim, b.logical_dim, n, a.group.name))),
    (K.ALL_GATHER, K.REDUCE_SCATTER): Fusion(
        "fused_ag_rs", _check_ag_rs,
        lambda a, b, n: (_fused_ag_rs, (b.reduce_op, a.logical_dim, b.logical_dim, n, a.group.name))),
    (K.ALL_GATHER, K.ALL_GATHER): Fusion(
        "fused_ag_ag", _check_ag_ag,
        lambda a, b, n: (_fused_ag_ag, (a.logical_dim, b.logical_dim, n, a.group.name))),
    (K.ALL_GATHER, K.ALL_TO_ALL): Fusion(
        "fused_ag_a2a", _check_ag_a2a,
        lambda a, b, n: (_fused_ag_a2a, (a.logical_dim, b.logical_dim, b.logical_concat_dim, n, a.group.name))),
    (K.ALL_TO_ALL, K.ALL_TO_ALL): Fusion(
        "fused_a2a_a2a", _check_a2a_a2a,
        lambda a, b, n: (_fused_a2a_a2a, (a.logical_dim, a.logical_concat_dim, b.logical_dim,
                                          b.logical_concat_dim, n, a.group.name))),
    (K.REDUCE_SCATTER, K.ALL_TO_ALL): Fusion(
        "fused_rs_a2a", _check_rs_a2a,
        lambda a, b, n: (_fused_rs_a2a, (a.reduce_op, a.logical_dim, b.logical_dim, b.logical_concat_dim, n,
                                         a.group.name))),
    (K.ALL_TO_ALL, K.ALL_GATHER): Fusion(
        "fused_a2a_ag", _check_a2a_ag,
        lambda a, b, n: (_fused_a2a_ag, (a.logical_dim, a.logical_concat_dim, b.logical_dim, n, a.group.name))),
    (K.ALL_TO_ALL, K.REDUCE_SCATTER): Fusion(
        "fused_a2a_rs", _check_a2a_rs,
        lambda a, b, n: (_fused_a2a_rs, (a.logical_dim, a.logical_concat_dim, b.reduce_op, b.logical_dim, n,
                                         a.group.name))),
}
FUSION_KEYS = tuple(f.key for f in _FUSIONS.values())


def fuse_pair(gm: fx.GraphModule, p: Pair) -> None:
    """Rewrite one pair in place (the caller checked :func:`_check_pair`)."""
    a, b = p.first, p.second
    n = a.group.size
    fn, consts = _FUSIONS[(a.kind, b.kind)].plan(a, b, n)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    # Where the first collective reads its input: its start, or the scatter-side shuffle before it.
    before = min([a.start, *a.layout_nodes], key=order.__getitem__)
    out = rewrite.splice(gm, fn, [a.logical_input], consts=consts, before=before, meta_from=a.start)
    old = b.logical_output
    old.replace_all_uses_with(out)
    rewrite.erase_dead(gm, [old])


class FuseCollectives(GraphPass):
    __doc__ = __doc__
    name = "fuse_collectives"
    stage = Stage.JOINT
    # Fusion changes where and in which order sums happen (an all_reduce for a reduce_scatter,
    # N·x for the sum of N equal copies): tolerance compare. The families that place
    # gathers, scatters and all_to_alls next to each other on one group, and group_pairs: next
    # to each other on two groups of the same ranks (other names: fused), of the same ranks in
    # another order or on two mesh dims (refused).
    fuzz = FuzzSpec(generators=("sp", "moe", "mixed", "group_pairs"))

    def run(self, ctx: PassContext) -> PassResult:
        counts = {k: 0 for k in FUSION_KEYS}
        refusals: list[str] = []
        # Each fusion removes at least one collective: the bound is never the reason to stop.
        for _ in range(len(ctx.ir.collectives) + 1):
            refusals = []
            fused = False
            for p in find_pairs(ctx.ir.collectives):
                why = _check_pair(p)
                if why is not None:
                    refusals.append(f"{p.label}: not fused: {why} ({p.kinds})")
                    continue
                fuse_pair(ctx.gm, p)
                counts[_FUSIONS[(p.first.kind, p.second.kind)].key] += 1
                fused = True
                break
            if not fused:
                break
            ctx.gm.graph.lint()
            ctx.invalidate()
        changed = any(counts.values())
        if changed:
            ctx.gm.graph.lint()
            ctx.gm.recompile()
        return PassResult(changed=changed, counts=counts, refusals=refusals)
