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
  issued on the *first* collective's group) -- or two groups that cross as the dims of a
  mesh (below, "Across groups"); neither coalesced nor in place; exactly
  one wait each; static shapes; all_to_all with equal splits; every dim the fused
  form chunks divisible by what it chunks into (non-empty); a reduce op the row
  allows. Every adjacent pair that is not fused (including pairs whose kinds are
  not in the table below) is reported in ``refusals`` as
  ``"<A>+<B>: not fused: <reason>"``.
- Does: inserts the fused form (one collective or none, plus local ATen work)
  right before A (where A read its input, so a later in-place update of that input
  cannot leak in), replaces every use of B's logical output by its result and
  erases A and B. Pairs are fused greedily in graph order -- except RS + AG, which moves
  as many bytes as the all_reduce it becomes and goes after every pair that moves fewer,
  so a split all_reduce's gather fuses with the exchange after it --, the IR rebuilt after
  each fusion, until no adjacent pair fuses: a fused result that is again a bare
  collective may fuse with its neighbour (Chimera: fusion can be applied
  repeatedly). Every fusion removes at least one collective, so this terminates.
- Guarantees: the same values as the unfused pair up to floating-point reduction
  order (``N·x`` replaces the sum of ``N`` equal copies; an all_reduce reduces what
  the reduce_scatter reduced); never more bytes per rank on the wire than the pair
  (ring conventions, see docs/fusion-table.md); the same group (the first collective's;
  no process group is created); decisions depend only on the graph, the groups'
  membership, which every member of a group sees alike, and the declared partitions, which
  every rank sees alike, so the ranks that communicate on a group agree.

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

Across groups (Chimera's TP+EP and SP+EP transitions, Table 2, N1 != N2 included). Group A
(N1 ranks) and group B (N2 ranks) cross as the two dims of a mesh: rank (k, i) is at position k
of its A-block and i of its B-block, every rank's blocks known from partitions all ranks share
(:mod:`commfuse.analysis.mesh_grid`: a DeviceMesh through DTensor or ``commfuse.setup``, or
``setup(groups=)``), and an existing process group spans their plane (the world on a 2-D mesh;
none is created while compiling). The fused form is one ``commfuse::m2ms`` on that group, every
rank sending one equal piece to every rank:

  AG_d on A + A2A_s->c on B   (s != d)   z_(k,l) = cat_i^c cat_k'^d chunk_l(x_(k',i), s)
  A2A_s->c on B + RS_op,d on A (d != c)  z_(k,l) = cat_i^c op_k' chunk_k(chunk_l(w_(k',i), s), d)

and two pairs become one collective on that group (the same bytes, one launch instead of two):

  AG_d1 on A + AG_d2 on B               all_gather, then z = cat_i^d2 cat_k'^d1 x_(k',i)
  RS_op,d1 on A + RS_op,d2 on B         reduce_scatter of the pieces chunk_l(chunk_k(w, d1), d2)
                                        laid out in the group's rank order (one reduce op)

Bytes per rank of the scatters: (N1·N2 - 1)|x|/N2 instead of (N1 - 1)|x| + N1|x|(N2 - 1)/N2 for the first;
(1 - 1/(N1·N2))|w| instead of (2 - 1/N1 - 1/N2)|w| for the second (75% at [2, 2], 70% at
[4, 2] and [2, 4], inside Table 2's 66.7-100%). The second is the first's transpose: a joint
graph fuses both directions.

Left alone (reported): every other pair of kinds (all_reduce, broadcast, p2p and
RS + RS on one group, which Chimera lists as not fusible), pairs on different groups (a different name
and different or unknown ranks; the same ranks in another order are a different group) that
are not the two rows above on crossing groups, and the Table 3 rows that need P2P or
many-to-many scatter at pipeline boundaries (``boundary_fusion``).

Source: Chimera §3.3, Table 3 (fused operator for every adjacent pair) and Table 2 (the
transitions between parallel patterns on different groups). The paper
gives only the table; the data-layout semantics above are derived here and proven
numerically by tests/test_fuse_collectives.py (docs/fusion-table.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx as fx

from commfuse.analysis.mesh_grid import Grid, find_grid
from commfuse.core.torch_private import c10d_functional
from commfuse.ir import rewrite
from commfuse.ir.collective import Collective
from commfuse.ir.kinds import CollectiveKind, collective_spec
from commfuse.ir.shapes import shape_of
from commfuse.ops.boundary import M2MS
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
    y = x.reshape(shape[:d] + [n, n, k] + shape[d + 1 :]).transpose(d, d + 1)
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


# ------------------------------------------------------- fused forms across groups
# The pair runs on two groups that cross as the dims of a mesh (commfuse.analysis.mesh_grid):
# rank_at[k][i] is the rank at position k of its A-block and i of its B-block; `order` lists
# the plane's ranks in the group-rank order of the existing group spanning it, which the
# many-to-many scatter runs on (every rank sends one equal piece to every rank, its own
# piece included as a local copy, and receives the pieces in that order).
def _scatter_everywhere(send: torch.Tensor, dim: int, order: tuple, group: str) -> list[torch.Tensor]:
    size = len(order)
    everyone = list(range(size))
    unit = send.shape[dim] // size
    got = c10d_functional.wait_tensor(
        M2MS(send, dim, [unit] * (size * size), everyone, everyone, size, group)
    )
    return _chunks(got, size, dim)


def _across_ag_a2a(x, d, s, c, rank_at, order, group):
    """AG_d on A, then A2A_s->c on B. Rank (k, l) ends with cat_i^c chunk_l(Y_i, s), where
    Y_i = cat_k'^d x_(k',i); for s != d that is cat_i^c cat_k'^d chunk_l(x_(k',i), s): each rank
    sends chunk_l of its input to every rank at B-position l (the gather's redundant copies
    never travel twice)."""
    n1, n2 = len(rank_at), len(rank_at[0])
    b_pos = {r: i for row in rank_at for i, r in enumerate(row)}
    pieces = _chunks(x, n2, s)
    got = _scatter_everywhere(torch.cat([pieces[b_pos[r]] for r in order], s), s, order, group)
    at = {r: j for j, r in enumerate(order)}
    return torch.cat([torch.cat([got[at[rank_at[k][i]]] for k in range(n1)], d) for i in range(n2)], c)


def _reduce_parts(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    return _local_reduce(torch.cat(parts, 0), op, len(parts), 0)


def _across_a2a_rs(w, s, c, op, d, rank_at, order, group):
    """A2A_s->c on B, then RS_op,d on A. Rank (k, l) ends with op_k' chunk_k(v_(k',l), d), where
    v_(k',l) = cat_i^c chunk_l(w_(k',i), s); for d != c that is
    cat_i^c op_k' chunk_k(chunk_l(w_(k',i), s), d): each rank sends every rank (k, l) that piece
    of its input, and the receiver reduces the pieces of one B-position locally."""
    n1, n2 = len(rank_at), len(rank_at[0])
    pos = {r: (k, i) for k, row in enumerate(rank_at) for i, r in enumerate(row)}
    by_l = _chunks(w, n2, s)
    send = torch.cat([_chunks(by_l[pos[r][1]], n1, d)[pos[r][0]] for r in order], s)
    got = _scatter_everywhere(send, s, order, group)
    at = {r: j for j, r in enumerate(order)}
    flat = [g.unsqueeze(0) for g in got]  # reduce over a new leading dim, whatever d is
    return torch.cat(
        [_reduce_parts([flat[at[rank_at[k][i]]] for k in range(n1)], op).squeeze(0) for i in range(n2)], c
    )


def _across_ag_ag(x, d1, d2, rank_at, order, group):
    """AG_d1 on A, then AG_d2 on B: every rank ends with cat_i^d2 cat_k'^d1 x_(k',i), one
    all_gather on the plane's group (the same bytes in one collective instead of two)."""
    n1, n2 = len(rank_at), len(rank_at[0])
    at = {r: j for j, r in enumerate(order)}
    got = _chunks(rewrite.all_gather(x, 0, len(order), group), len(order), 0)
    return torch.cat([torch.cat([got[at[rank_at[k][i]]] for k in range(n1)], d1) for i in range(n2)], d2)


def _across_rs_rs(w, op, d1, d2, rank_at, order, group):
    """RS_op,d1 on A, then RS_op,d2 on B: rank (k, l) ends with op over every rank (k', i) of
    chunk_l(chunk_k(w_(k',i), d1), d2), one reduce_scatter on the plane's group of each rank's
    pieces laid out in that group's order."""
    pos = {r: (k, i) for k, row in enumerate(rank_at) for i, r in enumerate(row)}
    n1, n2 = len(rank_at), len(rank_at[0])

    def piece(r):
        k, i = pos[r]
        return _chunks(_chunks(w, n1, d1)[k], n2, d2)[i]

    return rewrite.reduce_scatter(torch.cat([piece(r) for r in order], d1), op, d1, len(order), group)


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


def _check_pair(p: Pair, ctx: Optional[PassContext] = None) -> tuple[Optional[str], Optional[Across]]:
    """Why ``p`` is not fused (None: it is), and where a pair on two crossing groups is fused."""
    a, b = p.first, p.second
    across: Optional[Across] = None
    if a.group.same_members(b.group):
        if (a.kind, b.kind) not in _FUSIONS:
            return "not in the fusion table", None
    else:
        if a.group.ranks is None or b.group.ranks is None:
            unknown = " and ".join(repr(g.name) for g in (a.group, b.group) if g.ranks is None)
            return (
                f"groups differ (names {a.group.name!r} vs {b.group.name!r}; ranks of {unknown} unknown)",
                None,
            )
        if (a.kind, b.kind) not in _ACROSS:
            return (
                f"groups differ in members ({a.group.describe()} vs {b.group.describe()}) and the pair has no "
                "fused form across groups"
            ), None
        found = _across(p, ctx)
        if isinstance(found, str):
            return f"groups differ in members ({a.group.describe()} vs {b.group.describe()}): {found}", None
        across = found
    for c in (a, b):
        if c.coalesced:
            return f"{c.name} is coalesced", None
        if c.inplace:
            return f"{c.name} is in place", None
        if len(c.waits) != 1:
            return f"{c.name} does not have exactly one wait", None
        if c.logical_input is None or c.logical_output is None:
            return f"{c.name} has no single logical input/output", None
        if c.kind is K.ALL_TO_ALL and not _a2a_splits_equal(c):
            return f"{c.name} is an all_to_all with unequal (or dynamic) splits", None
        if c.kind is not K.ALL_REDUCE and c.logical_dim is None:
            return f"{c.name} has no logical dim", None
        if not all(_static(shape_of(v)) for v in (c.logical_input, c.logical_output)):
            return f"{c.name} has dynamic shapes", None
    n = a.group.size
    if n is None or n < 1:
        return "group size unknown", None
    # The intermediate value: each node of the chain feeds only the next one, and the
    # second collective's input feeds only it (and its layout shuffle).
    for node, nxt in zip(p.chain, p.chain[1:], strict=False):
        if set(node.users) != {nxt}:
            return "intermediate value has other users", None
    allowed = set(b.layout_nodes) | {b.start}
    if not p.chain[-1].users or not set(p.chain[-1].users) <= allowed:
        return "intermediate value has other users", None
    if across is not None:
        why = _ACROSS[(a.kind, b.kind)].check(a, b, across.grid)
        if why is not None:
            return f"groups differ in members ({a.group.describe()} vs {b.group.describe()}): {why}", None
        return None, across
    return _FUSIONS[(a.kind, b.kind)].check(a, b, n), None


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


def _local_reduce_refusal(b) -> Optional[str]:
    """Why the reduce_scatter ``b``'s reduction cannot be done locally on received pieces."""
    if b.reduce_op not in _LOCAL_REDUCE_OPS:
        return f"reduce op {b.reduce_op!r} has no local form"
    if b.reduce_op == "avg" and (b.dtype is None or not b.dtype.is_floating_point):
        return f"reduce op 'avg' on {b.dtype}"
    return None


def _check_a2a_rs(a, b, n):
    if a.logical_concat_dim is None:
        return "all_to_all concat dim unknown"
    why = _local_reduce_refusal(b)
    if why:
        return why
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
        "fused_rs_ag",
        _check_rs_ag,
        lambda a, b, n: (_fused_rs_ag, (a.reduce_op, a.logical_dim, b.logical_dim, n, a.group.name)),
    ),
    (K.ALL_GATHER, K.REDUCE_SCATTER): Fusion(
        "fused_ag_rs",
        _check_ag_rs,
        lambda a, b, n: (_fused_ag_rs, (b.reduce_op, a.logical_dim, b.logical_dim, n, a.group.name)),
    ),
    (K.ALL_GATHER, K.ALL_GATHER): Fusion(
        "fused_ag_ag",
        _check_ag_ag,
        lambda a, b, n: (_fused_ag_ag, (a.logical_dim, b.logical_dim, n, a.group.name)),
    ),
    (K.ALL_GATHER, K.ALL_TO_ALL): Fusion(
        "fused_ag_a2a",
        _check_ag_a2a,
        lambda a, b, n: (
            _fused_ag_a2a,
            (a.logical_dim, b.logical_dim, b.logical_concat_dim, n, a.group.name),
        ),
    ),
    (K.ALL_TO_ALL, K.ALL_TO_ALL): Fusion(
        "fused_a2a_a2a",
        _check_a2a_a2a,
        lambda a, b, n: (
            _fused_a2a_a2a,
            (a.logical_dim, a.logical_concat_dim, b.logical_dim, b.logical_concat_dim, n, a.group.name),
        ),
    ),
    (K.REDUCE_SCATTER, K.ALL_TO_ALL): Fusion(
        "fused_rs_a2a",
        _check_rs_a2a,
        lambda a, b, n: (
            _fused_rs_a2a,
            (a.reduce_op, a.logical_dim, b.logical_dim, b.logical_concat_dim, n, a.group.name),
        ),
    ),
    (K.ALL_TO_ALL, K.ALL_GATHER): Fusion(
        "fused_a2a_ag",
        _check_a2a_ag,
        lambda a, b, n: (
            _fused_a2a_ag,
            (a.logical_dim, a.logical_concat_dim, b.logical_dim, n, a.group.name),
        ),
    ),
    (K.ALL_TO_ALL, K.REDUCE_SCATTER): Fusion(
        "fused_a2a_rs",
        _check_a2a_rs,
        lambda a, b, n: (
            _fused_a2a_rs,
            (a.logical_dim, a.logical_concat_dim, b.reduce_op, b.logical_dim, n, a.group.name),
        ),
    ),
}
FUSION_KEYS = tuple(f.key for f in _FUSIONS.values())


@dataclass(frozen=True)
class Across:
    """Where a pair on two crossing groups is fused: their plane and the group that spans it."""

    grid: Grid
    group_name: str
    order: tuple[int, ...]  # the plane's global ranks in that group's rank order


@dataclass(frozen=True)
class AcrossFusion:
    key: str
    axes: Callable[[Collective, Collective], tuple[Collective, Collective]]  # -> (A's collective, B's)
    check: Callable[[Collective, Collective, Grid], Optional[str]]
    plan: Callable[[Collective, Collective, Across], tuple[Callable, tuple]]


def _check_across_ag_a2a(a, b, grid):
    d, s = a.logical_dim, b.logical_dim
    if b.logical_concat_dim is None:
        return "all_to_all concat dim unknown"
    if s == d:
        return "the all_to_all splits the gathered dim: each rank would send different pieces (not one graph)"
    return _need(_xshape(a), s, grid.n2, "split dim")


def _check_across_a2a_rs(a, b, grid):
    s, c, d = a.logical_dim, a.logical_concat_dim, b.logical_dim
    if c is None:
        return "all_to_all concat dim unknown"
    if d == c:
        return "the reduce_scatter scatters the all_to_all's concat dim"
    why = _local_reduce_refusal(b)
    if why:
        return why
    x = _xshape(a)
    if d == s:
        return _need(x, s, grid.n1 * grid.n2, "split and scatter dim, n1·n2 pieces")
    return _need(x, s, grid.n2, "split dim") or _need(x, d, grid.n1, "scatter dim")


def _check_across_ag_ag(a, b, grid):
    return None


def _check_across_rs_rs(a, b, grid):
    if a.reduce_op != b.reduce_op or a.reduce_op not in ("sum", "avg", "max", "min"):
        return f"reduce ops {a.reduce_op!r} then {b.reduce_op!r} are not one reduction"
    x = _xshape(a)
    d1, d2 = a.logical_dim, b.logical_dim
    if d1 == d2:
        return _need(x, d1, grid.n1 * grid.n2, "both scatter dims, n1·n2 pieces")
    return _need(x, d1, grid.n1, "first scatter dim") or _need(x, d2, grid.n2, "second scatter dim")


# Chimera's rows for adjacent collectives on two groups of a mesh (the A-G + A2A row of Table 3
# at the TP+EP and SP+EP transitions of Table 2, and its transpose, which the backward runs).
_ACROSS: dict[tuple[CollectiveKind, CollectiveKind], AcrossFusion] = {
    (K.ALL_GATHER, K.ALL_TO_ALL): AcrossFusion(
        "m2ms_ag_a2a",
        lambda a, b: (a, b),
        _check_across_ag_a2a,
        lambda a, b, w: (
            _across_ag_a2a,
            (a.logical_dim, b.logical_dim, b.logical_concat_dim, w.grid.rank_at, w.order, w.group_name),
        ),
    ),
    (K.ALL_TO_ALL, K.REDUCE_SCATTER): AcrossFusion(
        "m2ms_a2a_rs",
        lambda a, b: (b, a),
        _check_across_a2a_rs,
        lambda a, b, w: (
            _across_a2a_rs,
            (
                a.logical_dim,
                a.logical_concat_dim,
                b.reduce_op,
                b.logical_dim,
                w.grid.rank_at,
                w.order,
                w.group_name,
            ),
        ),
    ),
    # the same bytes in one collective on the plane instead of one per dim
    (K.ALL_GATHER, K.ALL_GATHER): AcrossFusion(
        "plane_ag_ag",
        lambda a, b: (a, b),
        _check_across_ag_ag,
        lambda a, b, w: (
            _across_ag_ag,
            (a.logical_dim, b.logical_dim, w.grid.rank_at, w.order, w.group_name),
        ),
    ),
    (K.REDUCE_SCATTER, K.REDUCE_SCATTER): AcrossFusion(
        "plane_rs_rs",
        lambda a, b: (a, b),
        _check_across_rs_rs,
        lambda a, b, w: (
            _across_rs_rs,
            (a.reduce_op, a.logical_dim, b.logical_dim, w.grid.rank_at, w.order, w.group_name),
        ),
    ),
}
ACROSS_KEYS = tuple(f.key for f in _ACROSS.values())


def _across(p: Pair, ctx: Optional[PassContext]) -> "Across | str":
    """The plane of the pair's two groups and the existing group spanning it, or why not."""
    if ctx is None:
        return "no pass context to read the mesh from"
    ga, gb = (c.group for c in _ACROSS[(p.first.kind, p.second.kind)].axes(p.first, p.second))
    grid = find_grid(ga.ranks, gb.ranks, ctx.partitions)
    if isinstance(grid, str):
        return grid
    found = ctx.group_with_members(grid.ranks)
    if found is None:
        return (
            f"no process group spans their plane (ranks {','.join(map(str, grid.ranks))}); "
            "commfuse creates none while compiling"
        )
    name, order = found
    return Across(grid, name, tuple(order))


def fuse_pair(gm: fx.GraphModule, p: Pair, across: Optional[Across] = None) -> str:
    """Rewrite one pair in place (the caller checked :func:`_check_pair`); returns the fusion's key."""
    a, b = p.first, p.second
    if across is not None:
        fusion = _ACROSS[(a.kind, b.kind)]
        fn, consts = fusion.plan(a, b, across)
    else:
        fusion = _FUSIONS[(a.kind, b.kind)]
        fn, consts = fusion.plan(a, b, a.group.size)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    # Where the first collective reads its input: its start, or the scatter-side shuffle before it.
    before = min([a.start, *a.layout_nodes], key=order.__getitem__)
    out = rewrite.splice(gm, fn, [a.logical_input], consts=consts, before=before, meta_from=a.start)
    old = b.logical_output
    old.replace_all_uses_with(out)
    rewrite.erase_dead(gm, [old])
    return fusion.key


def _rejoins_a_split(p: Pair) -> bool:
    return (p.first.kind, p.second.kind) == (K.REDUCE_SCATTER, K.ALL_GATHER)


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
        counts = {k: 0 for k in FUSION_KEYS + ACROSS_KEYS}
        refusals: list[str] = []
        # Each fusion removes at least one collective: the bound is never the reason to stop.
        for _ in range(len(ctx.ir.collectives) + 1):
            refusals = []
            fused = False
            # Pairs that move fewer bytes first: RS + AG -> AR moves as many (Table 3: "equal") and
            # would otherwise take the gather a following exchange could fuse with (TP+EP).
            for p in sorted(find_pairs(ctx.ir.collectives), key=_rejoins_a_split):
                why, across = _check_pair(p, ctx)
                if why is not None:
                    refusals.append(f"{p.label}: not fused: {why} ({p.kinds})")
                    continue
                counts[fuse_pair(ctx.gm, p, across)] += 1
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
