"""Programs that exercise every collective kind (and the MoE layer op), for checking the reference
against real ranks.

Each case is a module-level function ``fn(ctx, rank, *inputs) -> outputs`` written with the
``_c10d_functional`` ops and ``torch.distributed._functional_collectives`` (what DTensor and
traced graphs use), over the world and two sub-group partitions of a 4-rank world:

* ``ctx["world"]``: ranks [0, 1, 2, 3];
* ``ctx["strided"]``: this rank's block of [[0, 2], [1, 3]];
* ``ctx["blocked"]``: this rank's block of [[0, 1], [2, 3]].

:data:`CASES` are the collectives; :data:`MOE_CASES` run ``commfuse::moe_layer`` and its
backward (group-synchronous ops: their all_to_alls run inside the op) on those groups;
:data:`BOUNDARY_CASES` run commfuse's boundary ops ``m2ms`` and ``stage_transfer``.

:func:`gloo_job` runs a case eagerly inside an initialised process group (one rank of a
gloo :class:`~commfuse.testing.RankPool`); :func:`trace_case` traces it with ``make_fx``
on every rank of a fake world and returns the graphs and the group mapping that
:class:`~commfuse.reference.ReferenceInterpreter` needs. tests/test_reference.py
compares the two per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from commfuse.moe import MOE_LAYER, MOE_LAYER_BACKWARD, moe_layer
from commfuse.ops import M2MS, STAGE_TRANSFER
from commfuse.ops.boundary import m2ms, stage_transfer
from commfuse.ops.reduce_to_root.op import REDUCE_TO_ROOT
from commfuse.testing.fake_pg import fake_process_group

c10d = torch.ops._c10d_functional
W = c10d.wait_tensor.default

WORLD_SIZE = 4
PARTITIONS: dict[str, list[list[int]]] = {
    "strided": [[0, 2], [1, 3]],
    "blocked": [[0, 1], [2, 3]],
}


def make_groups(rank: int) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """Create the sub-groups (every rank creates every group, in one fixed order, as c10d requires).

    Returns ``ctx`` (role -> this rank's ProcessGroup) and ``names`` (group name -> ranks) for the
    groups this rank belongs to.
    """
    ctx: dict[str, Any] = {"world": dist.group.WORLD}
    names: dict[str, list[int]] = {dist.group.WORLD.group_name: list(range(dist.get_world_size()))}
    for role, blocks in PARTITIONS.items():
        for block in blocks:
            pg = dist.new_group(block)
            if rank in block:
                ctx[role] = pg
                names[pg.group_name] = list(block)
    return ctx, names


def _name(pg) -> str:
    return pg.group_name


def _case(case: str) -> "Case":
    if case in CASES:
        return CASES[case]
    return MOE_CASES[case] if case in MOE_CASES else BOUNDARY_CASES[case]


def _inputs(case: str, rank: int, seed: int) -> list[torch.Tensor]:
    spec = _case(case)
    g = torch.Generator().manual_seed(seed * 1000 + rank * 17 + sum(map(ord, case)))
    out = []
    for idx, shape in enumerate(spec.shapes(rank) if callable(spec.shapes) else spec.shapes):
        if idx in spec.replicated:  # the same on every rank (e.g. a router weight)
            t = torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed * 1000 + 7 * idx + 5))
        else:
            t = torch.randn(tuple(shape), generator=g)
        out.append(1.0 + 0.1 * t if spec.near_one else t * spec.scale[idx] if spec.scale else t)
    return out


# --------------------------------------------------------------------------- cases
def _ar(op: str, role: str) -> Callable:
    def fn(ctx, rank, x):
        return W(c10d.all_reduce.default(x, op, _name(ctx[role])))

    fn.__name__ = f"all_reduce_{op}_{role}"
    return fn


def all_reduce_inplace(ctx, rank, x):
    buf = x.clone()
    r = W(c10d.all_reduce_.default(buf, "sum", _name(ctx["strided"])))
    return r * 1  # read the result through the wait


def all_reduce_coalesced(ctx, rank, x, y):
    a, b = c10d.all_reduce_coalesced.default([x, y], "avg", _name(ctx["world"]))
    return W(a), W(b)


def all_reduce_coalesced_inplace(ctx, rank, x, y):
    bufs = [x.clone(), y.clone()]
    a, b = c10d.all_reduce_coalesced_.default(bufs, "max", _name(ctx["blocked"]))
    return W(a) + 0, W(b) + 0


def all_gather_dim0(ctx, rank, x):
    return W(c10d.all_gather_into_tensor.default(x, 2, _name(ctx["strided"])))


def all_gather_out(ctx, rank, x):
    # The out= variant Inductor's bucketing emits.
    out = torch.empty(x.shape[0] * 2, *x.shape[1:], dtype=x.dtype)
    return W(c10d.all_gather_into_tensor_out.default(x, 2, _name(ctx["strided"]), out=out)) + 0


def reduce_scatter_out(ctx, rank, x):
    out = torch.empty(x.shape[0] // 4, *x.shape[1:], dtype=x.dtype)
    return W(c10d.reduce_scatter_tensor_out.default(x, "sum", 4, _name(ctx["world"]), out=out)) + 0


def all_gather_dim1(ctx, rank, x):
    # DTensor's shuffle: dim-0 gather + split/cat to gather along dim 1
    return funcol.all_gather_single(x, 1, ctx["world"]) * 1


def all_gather_coalesced(ctx, rank, x, y):
    a, b = c10d.all_gather_into_tensor_coalesced.default([x, y], 4, _name(ctx["world"]))
    return W(a), W(b)


def reduce_scatter_sum(ctx, rank, x):
    return W(c10d.reduce_scatter_tensor.default(x, "sum", 2, _name(ctx["blocked"])))


def reduce_scatter_avg_dim1(ctx, rank, x):
    return funcol.reduce_scatter_single(x, "avg", 1, ctx["world"]) * 1


def reduce_scatter_coalesced(ctx, rank, x, y):
    a, b = c10d.reduce_scatter_tensor_coalesced.default([x, y], "sum", 4, _name(ctx["world"]))
    return W(a), W(b)


def all_to_all_equal(ctx, rank, x):
    return W(c10d.all_to_all_single.default(x, [2, 2, 2, 2], [2, 2, 2, 2], _name(ctx["world"])))


# rank r sends SPLITS[r][j] rows to rank j of the world
SPLITS = [[1, 2, 0, 1], [0, 1, 1, 3], [2, 2, 2, 0], [1, 0, 1, 1]]


def _a2a_shapes(rank: int) -> list[tuple[int, ...]]:
    return [(sum(SPLITS[rank]), 3)]


def all_to_all_uneven(ctx, rank, x):
    out_splits = [SPLITS[j][rank] for j in range(WORLD_SIZE)]
    return W(c10d.all_to_all_single.default(x, out_splits, SPLITS[rank], _name(ctx["world"])))


def all_to_all_subgroup(ctx, rank, x):
    return W(c10d.all_to_all_single.default(x, [3, 3], [3, 3], _name(ctx["strided"])))


def broadcast(ctx, rank, x):
    return W(c10d.broadcast.default(x, 1, _name(ctx["strided"])))  # root: group rank 1


def broadcast_inplace(ctx, rank, x):
    buf = x.clone()
    return W(c10d.broadcast_.default(buf, 2, _name(ctx["world"]))) + 0


def reduce_to_root_world(ctx, rank, x):
    # commfuse's rooted reduce (commfuse/ops/reduce_to_root/op.py): root = group rank 2; -0.0 elsewhere

    return W(REDUCE_TO_ROOT(x, 2, "sum", 4, _name(ctx["world"]))) + 0


def reduces_of_distinct_roots(ctx, rank, x):
    # Centauri's reduce_scatter substitute on a sub-group: reduce r delivers slice r to group
    # rank r, and the -0.0 of the other reduces adds away exactly

    pieces = x.chunk(2, 0)
    outs = [W(REDUCE_TO_ROOT(pieces[r].contiguous(), r, "max", 2, _name(ctx["strided"]))) for r in range(2)]
    return outs[0] + outs[1]


def p2p_ring(ctx, rank, x):
    # world ring: send to the next rank, receive from the previous one (peers are group ranks)
    n = WORLD_SIZE
    s = c10d.isend.default(x, (rank + 1) % n, 0, _name(ctx["world"]))
    r = c10d.irecv.default(torch.empty_like(x), (rank - 1) % n, 0, _name(ctx["world"]))
    W(s)
    return W(r) * 1


def p2p_subgroup(ctx, rank, x):
    pg = ctx["strided"]
    me = dist.get_group_rank(pg, rank)
    if me == 0:  # the two members order their calls differently (a pipeline stage pair)
        s = c10d.isend.default(x * 2, 1, 5, _name(pg))
        r = c10d.irecv.default(torch.empty_like(x), 1, 5, _name(pg))
    else:
        r = c10d.irecv.default(torch.empty_like(x), 0, 5, _name(pg))
        s = c10d.isend.default(x * 2, 0, 5, _name(pg))
    W(s)
    return W(r) + 0


def batch_p2p(ctx, rank, x, y):
    n = WORLD_SIZE
    outs = c10d.batch_p2p_ops.default(
        ["isend", "irecv", "isend", "irecv"],
        [(rank + 1) % n, (rank - 1) % n, (rank + 2) % n, (rank + 2) % n],
        [0, 0, 1, 1],
        [x, torch.empty_like(x), y, torch.empty_like(y)],
        _name(ctx["world"]),
    )
    outs = [W(o) for o in outs]
    return outs[1] * 1, outs[3] * 1


def mixed_program(ctx, rank, x, w):
    # TP-style matmul + all_reduce on a sub-group, sequence gather on the world, scatter back
    h = torch.relu(x @ w)
    h = funcol.all_reduce(h, "sum", ctx["blocked"])
    g = funcol.all_gather_single(h, 1, ctx["world"])
    s = torch.softmax(g, dim=-1)
    return funcol.reduce_scatter_single(s, "sum", 1, ctx["strided"]) * 1


@dataclass
class Case:
    fn: Callable
    shapes: Any  # list of shapes, or rank -> list of shapes
    exact: bool  # pure data movement: bitwise equal to gloo
    per_rank: bool = False  # rank-dependent program: one graph per rank
    near_one: bool = False  # inputs near 1 (products)
    replicated: tuple[int, ...] = ()  # indices of inputs that are the same on every rank
    scale: tuple[float, ...] = ()  # per-input factor on the randn values (default 1)


CASES: dict[str, Case] = {}
for _op in ("sum", "avg", "max", "min", "product"):
    for _role in ("world", "strided"):
        _f = _ar(_op, _role)
        CASES[_f.__name__] = Case(_f, [(4, 3)], exact=_op in ("max", "min"), near_one=_op == "product")
CASES.update(
    {
        "all_reduce_inplace": Case(all_reduce_inplace, [(4, 3)], exact=True),  # 2 summands: exact
        "all_reduce_coalesced": Case(all_reduce_coalesced, [(4, 3), (2, 5)], exact=False),
        "all_reduce_coalesced_inplace": Case(all_reduce_coalesced_inplace, [(4, 3), (2, 5)], exact=True),
        "all_gather_dim0": Case(all_gather_dim0, [(2, 3)], exact=True),
        "all_gather_dim1": Case(all_gather_dim1, [(2, 3, 2)], exact=True),
        "all_gather_out": Case(all_gather_out, [(2, 3)], exact=True),
        "reduce_scatter_out": Case(reduce_scatter_out, [(4, 3)], exact=False),
        "all_gather_coalesced": Case(all_gather_coalesced, [(2, 3), (1, 4)], exact=True),
        "reduce_scatter_sum": Case(reduce_scatter_sum, [(4, 3)], exact=True),
        "reduce_scatter_avg_dim1": Case(reduce_scatter_avg_dim1, [(2, 8, 3)], exact=False),
        "reduce_scatter_coalesced": Case(reduce_scatter_coalesced, [(4, 3), (8, 2)], exact=False),
        "all_to_all_equal": Case(all_to_all_equal, [(8, 3)], exact=True),
        "all_to_all_uneven": Case(all_to_all_uneven, _a2a_shapes, exact=True, per_rank=True),
        "all_to_all_subgroup": Case(all_to_all_subgroup, [(6, 2)], exact=True),
        "broadcast": Case(broadcast, [(3, 3)], exact=True),
        "broadcast_inplace": Case(broadcast_inplace, [(3, 3)], exact=True),
        "reduce_to_root_world": Case(reduce_to_root_world, [(3, 3)], exact=False),
        "reduces_of_distinct_roots": Case(reduces_of_distinct_roots, [(4, 3)], exact=True),  # max: order-free
        "p2p_ring": Case(p2p_ring, [(2, 3)], exact=True, per_rank=True),
        "p2p_subgroup": Case(p2p_subgroup, [(2, 3)], exact=True, per_rank=True),
        "batch_p2p": Case(batch_p2p, [(2, 3), (3,)], exact=True, per_rank=True),
        "mixed_program": Case(mixed_program, [(2, 4, 8), (8, 8)], exact=False),
    }
)


# --------------------------------------------------------------------------- MoE layer
# commfuse::moe_layer (a whole expert-parallel MoE layer whose all_to_alls run inside the op) and
# its backward, on the world, the strided sub-groups and without a group (""): rank r of the group
# holds experts [r*E/N, (r+1)*E/N) and the router (input 1) is the same on every rank. Forward
# cases return (out, probs_sum, top1_count, z_sum); backward cases call moe_layer_backward with
# explicit gradients; joint cases differentiate a loss through the op with autograd.
MOE_H, MOE_F = 8, 8
_GROUP_SIZE = {"world": WORLD_SIZE, "strided": 2, "blocked": 2, "none": 1}


def _moe_group(ctx, role: str) -> str:
    return "" if role == "none" else _name(ctx[role])


def _moe_shapes(role: str, local: int, tokens, backward: bool = False, joint: bool = False) -> Callable:
    e = local * _GROUP_SIZE[role]

    def shapes(rank: int) -> list[tuple[int, ...]]:
        t = tokens(rank) if callable(tokens) else tokens
        s = [(t, MOE_H), (e, MOE_H), (local, MOE_H, MOE_F), (local, MOE_H, MOE_F), (local, MOE_F, MOE_H)]
        if backward:
            s = [(t, MOE_H), (e,), (), *s]
        if joint:
            s.append((t, MOE_H))  # the output's upstream gradient
        return s

    return shapes


def _moe_case(
    role: str,
    top_k: int,
    cf: float,
    tg: int,
    local: int,
    tokens,
    *,
    mode: str = "forward",
    scale: float = 1.0,
    chunks: int = 1,
) -> Case:

    if mode == "forward":

        def fn(ctx, rank, x, rw, w1, w3, w2):
            return list(MOE_LAYER(x, rw, w1, w3, w2, top_k, cf, tg, _moe_group(ctx, role), chunks))
    elif mode == "backward":

        def fn(ctx, rank, go, gps, gz, x, rw, w1, w3, w2):
            return list(
                MOE_LAYER_BACKWARD(
                    go, gps, gz, x, rw, w1, w3, w2, top_k, cf, tg, _moe_group(ctx, role), scale, chunks
                )
            )
    else:  # joint: autograd through the op (its registered backward)

        def fn(ctx, rank, x, rw, w1, w3, w2, up):
            params = [t.detach().requires_grad_() for t in (x, rw, w1, w3, w2)]
            out, ps, t1, z = moe_layer(*params, top_k, cf, tg, _moe_group(ctx, role), chunks)
            loss = (out * up).sum() + 0.1 * (ps * ps).sum() + 0.01 * z
            return [out, ps, t1, z, *torch.autograd.grad(loss, params)]

    n = len(_moe_shapes(role, local, tokens, mode == "backward", mode == "joint")(0))
    rw = 4 if mode == "backward" else 1
    # unit-variance activations; weights ~ 1/sqrt(fan-in)
    scales = [1.0] * n
    for i, f in ((rw, MOE_H**-0.5), (rw + 1, MOE_H**-0.5), (rw + 2, MOE_H**-0.5), (rw + 3, MOE_F**-0.5)):
        scales[i] = f
    return Case(
        fn,
        _moe_shapes(role, local, tokens, mode == "backward", mode == "joint"),
        exact=False,
        per_rank=callable(tokens),
        replicated=(rw,),
        scale=tuple(scales),
    )


MOE_CASES: dict[str, Case] = {
    "moe_fwd_dropless_top2_world": _moe_case("world", 2, 0.0, 1, 2, 8),
    "moe_fwd_capacity_top1_world": _moe_case("world", 1, 1.0, 2, 1, 8),
    "moe_fwd_capacity_top2_strided": _moe_case("strided", 2, 1.0, 1, 2, 6),
    "moe_fwd_dropless_top1_strided_uneven": _moe_case("strided", 1, 0.0, 1, 1, lambda r: 3 + 2 * r),
    "moe_fwd_capacity_top2_no_group": _moe_case("none", 2, 1.0, 2, 4, 8),
    "moe_bwd_dropless_top2_world": _moe_case("world", 2, 0.0, 1, 2, 8, mode="backward"),
    "moe_bwd_capacity_top1_strided": _moe_case("strided", 1, 1.0, 2, 1, 8, mode="backward", scale=0.5),
    "moe_bwd_dropless_top1_blocked_uneven": _moe_case(
        "blocked", 1, 0.0, 1, 2, lambda r: 2 + r, mode="backward", scale=2.0
    ),
    "moe_joint_capacity_top2_world": _moe_case("world", 2, 1.0, 4, 1, 8, mode="joint"),
    "moe_joint_dropless_top1_strided": _moe_case("strided", 1, 0.0, 1, 2, 6, mode="joint"),
    # the exchange cut into token chunks, pipelined (async all_to_alls); a rank with fewer tokens
    # than chunks exchanges empty chunks
    "moe_fwd_dropless_top2_world_3_chunks": _moe_case("world", 2, 0.0, 1, 2, 8, chunks=3),
    "moe_bwd_dropless_top1_blocked_uneven_3_chunks": _moe_case(
        "blocked", 1, 0.0, 1, 2, lambda r: 2 + r, mode="backward", scale=2.0, chunks=3
    ),
    "moe_joint_dropless_top2_strided_2_chunks": _moe_case("strided", 2, 0.0, 1, 2, 6, mode="joint", chunks=2),
}


# --------------------------------------------------------------------------- boundary ops
# commfuse's boundary ops (commfuse.ops; reference semantics in ops/boundary/semantics.py): m2ms with
# overlapping / disjoint / equal rank sets, zero pieces, negative and non-zero dims, on the world
# and on sub-groups; stage_transfer with chains (a rank that sends and receives), self pairs and
# sub-groups; the async ops (+ wait_tensor) and the differentiable wrappers (autograd variants,
# forward and gradients). m2ms inputs are their row of the piece matrix long: one graph per rank.
M2MS_OVERLAP = ([0, 2], [1, 2, 3], [[1, 2, 0], [3, 0, 1]])  # src, dst, splits: ranks 2 in both
M2MS_DISJOINT = ([0, 1], [2, 3], [[2, 1], [0, 3]])  # a stage boundary: stage {0,1} -> stage {2,3}
M2MS_EQUAL = ([0, 1, 2, 3], [3, 1, 0, 2], [[1, 0, 2, 1], [0, 0, 0, 3], [2, 1, 1, 0], [1, 2, 0, 0]])
M2MS_SUB = ([1], [0, 1], [[2, 3]])  # on the strided sub-groups: group rank 1 scatters to both


def _row_len(spec: tuple, group_rank: int) -> int:
    src, _dst, splits = spec
    return sum(splits[src.index(group_rank)]) if group_rank in src else 0


def _m2ms_shapes(spec: tuple, dim: int, other: tuple[int, ...], group_rank=lambda r: r) -> Callable:
    def shapes(rank: int) -> list[tuple[int, ...]]:
        s = list(other)
        s.insert(dim if dim >= 0 else len(s) + dim + 1, _row_len(spec, group_rank(rank)))
        return [tuple(s)]

    return shapes


def _flat(splits: list[list[int]]) -> list[int]:
    return [v for row in splits for v in row]


def m2ms_overlap_dim1(ctx, rank, x):
    src, dst, splits = M2MS_OVERLAP
    return W(M2MS(x, 1, _flat(splits), src, dst, WORLD_SIZE, _name(ctx["world"]))) + 0


def m2ms_disjoint_dim0(ctx, rank, x):
    src, dst, splits = M2MS_DISJOINT
    return W(M2MS(x, 0, _flat(splits), src, dst, WORLD_SIZE, _name(ctx["world"]))) * 1


def m2ms_equal_negdim(ctx, rank, x):
    src, dst, splits = M2MS_EQUAL
    return m2ms(x, -1, splits, src, dst, ctx["world"]) * 1


def m2ms_subgroup(ctx, rank, x):
    src, dst, splits = M2MS_SUB
    return m2ms(x, 0, splits, src, dst, ctx["strided"]) + 0


def m2ms_joint(ctx, rank, x, up):
    # differentiable wrapper (commfuse::m2ms_autograd): forward and the reverse-scatter gradient

    src, dst, splits = M2MS_OVERLAP
    xx = x.detach().requires_grad_()
    y = m2ms(xx, 1, splits, src, dst, ctx["world"])
    loss = (y * torch.tanh(y)).sum() + (up * xx).sum()
    return [y, *torch.autograd.grad(loss, [xx])]


def stage_transfer_chain(ctx, rank, x):
    # 0 -> 1 -> 2 (rank 1 sends and receives), 3 -> 3 (a local copy); nothing reaches 0

    return W(STAGE_TRANSFER(x, [0, 1, 3], [1, 2, 3], WORLD_SIZE, _name(ctx["world"]))) + 0


def stage_transfer_subgroup(ctx, rank, x):
    return stage_transfer(x * 2, [0], [1], ctx["blocked"]) + 0


def stage_transfer_joint(ctx, rank, x):
    xx = x.detach().requires_grad_()
    y = stage_transfer(xx, [0, 1], [2, 3], ctx["world"])
    return [y, *torch.autograd.grad((y * y).sum(), [xx])]


def boundary_mixed(ctx, rank, x, w):
    # a stage boundary inside a program: compute, m2ms to the next stage, compute, all_reduce

    src, dst, splits = M2MS_DISJOINT
    h = torch.relu(x @ w)
    y = W(M2MS(h, 0, _flat(splits), src, dst, WORLD_SIZE, _name(ctx["world"])))
    z = W(STAGE_TRANSFER(torch.tanh(w), [2, 3], [0, 1], WORLD_SIZE, _name(ctx["world"])))
    r = funcol.all_reduce(y.sum(0, keepdim=True), "max", ctx["world"])
    return [y * 1, z * 1, r * 1]


def _strided_rank(r: int) -> int:
    return PARTITIONS["strided"][r % 2].index(r)


BOUNDARY_CASES: dict[str, Case] = {
    "m2ms_overlap_dim1": Case(
        m2ms_overlap_dim1, _m2ms_shapes(M2MS_OVERLAP, 1, (2, 5)), exact=True, per_rank=True
    ),
    "m2ms_disjoint_dim0": Case(
        m2ms_disjoint_dim0, _m2ms_shapes(M2MS_DISJOINT, 0, (3,)), exact=True, per_rank=True
    ),
    "m2ms_equal_negdim": Case(
        m2ms_equal_negdim, _m2ms_shapes(M2MS_EQUAL, -1, (2, 3)), exact=True, per_rank=True
    ),
    "m2ms_subgroup": Case(
        m2ms_subgroup, _m2ms_shapes(M2MS_SUB, 0, (4,), _strided_rank), exact=True, per_rank=True
    ),
    "m2ms_joint": Case(
        m2ms_joint, lambda r: [*_m2ms_shapes(M2MS_OVERLAP, 1, (2, 5))(r)] * 2, exact=False, per_rank=True
    ),
    "stage_transfer_chain": Case(stage_transfer_chain, [(2, 3)], exact=True),
    "stage_transfer_subgroup": Case(stage_transfer_subgroup, [(3,)], exact=True),
    "stage_transfer_joint": Case(stage_transfer_joint, [(2, 3)], exact=True),
    "boundary_mixed": Case(
        boundary_mixed, lambda r: [(_row_len(M2MS_DISJOINT, r), 4), (4, 4)], exact=False, per_rank=True
    ),
}


def _plain(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, funcol.AsyncCollectiveTensor):
        x = x.wait()
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def gloo_job(cases: list[str] | None = None, seed: int = 0) -> dict[str, Any]:
    """Run cases eagerly on this rank of an initialised (gloo) world of 4 ranks.

    Returns case -> list of plain output tensors (or ``"error: ..."``)."""
    rank = dist.get_rank()
    ctx, _ = make_groups(rank)
    results: dict[str, Any] = {}
    for case in cases or list(CASES):
        out = _case(case).fn(ctx, rank, *_inputs(case, rank, seed))
        results[case] = _plain(out if isinstance(out, (list, tuple)) else [out])
    return results


def trace_case(case: str, seed: int = 0, *, per_rank: bool | None = None):
    """make_fx-trace a case on a fake world: returns (graphs, groups, inputs).

    ``graphs`` is one GraphModule traced on rank 0 (with ``groups`` mapping each name to
    its partition) or, for rank-dependent cases, one graph per rank (``groups`` maps each
    name to its block).
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    spec = _case(case)
    per_rank = spec.per_rank if per_rank is None else per_rank
    inputs = [_inputs(case, r, seed) for r in range(WORLD_SIZE)]
    graphs, names = [], {}
    for r in range(WORLD_SIZE if per_rank else 1):
        with fake_process_group(WORLD_SIZE, rank=r):
            ctx, nm = make_groups(r)
            names.update(nm)

            def f(*args, _ctx=ctx, _r=r):
                out = spec.fn(_ctx, _r, *args)
                return list(out) if isinstance(out, (list, tuple)) else [out]

            graphs.append(make_fx(f, tracing_mode="fake")(*inputs[r]))
    if per_rank:
        return graphs, names, inputs
    groups: dict[str, Any] = {}
    for name, ranks in names.items():
        part = next((p for p in PARTITIONS.values() if ranks in p), None)
        groups[name] = part if part is not None else ranks
    return graphs[0], groups, inputs
