"""Rank-pool jobs for tests/test_boundary_ops.py (module level so the pool can pickle them).

Every rank builds every rank's input deterministically, computes its own expected output
with :func:`ref_m2ms` (a direct transcription of the spec, independent of the op's code)
and returns what differs; the test asserts on the returned records.
"""

from __future__ import annotations

import zlib
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from commfuse.core.torch_private import c10d_functional
from commfuse.ops import M2MS, STAGE_TRANSFER, m2ms, stage_transfer

# name, src, dst, splits matrix (rows: src, columns: dst)
M2MS_CASES: list[tuple[str, list[int], list[int], list[list[int]]]] = [
    ("even_all_to_all", [0, 1, 2, 3], [0, 1, 2, 3], [[2] * 4] * 4),
    ("uneven", [0, 1, 2, 3], [0, 1, 2, 3], [[1, 3, 0, 2], [2, 0, 1, 1], [0, 4, 2, 1], [3, 1, 1, 0]]),
    (
        "empty_row_and_column",
        [0, 1, 2, 3],
        [0, 1, 2, 3],
        [[1, 2, 0, 1], [0, 0, 0, 0], [2, 1, 0, 3], [1, 1, 0, 2]],
    ),
    ("all_empty", [0, 1], [2, 3], [[0, 0], [0, 0]]),
    ("disjoint", [0, 1], [2, 3], [[1, 2], [3, 1]]),
    ("overlapping", [0, 1, 2], [1, 2, 3], [[1, 2, 1], [2, 1, 0], [1, 3, 2]]),
    ("rank_in_neither", [0, 1], [1, 2], [[2, 1], [1, 3]]),
    ("unsorted_lists", [3, 1, 0], [2, 0], [[1, 2], [3, 0], [1, 1]]),
    ("one_to_many", [2], [0, 1, 2, 3], [[1, 0, 2, 3]]),
    ("many_to_one", [0, 1, 2, 3], [1], [[1], [0], [2], [1]]),
]

# (shape of x with the split dimension's size replaced by -1, dim)
LAYOUTS: list[tuple[tuple[int, ...], int]] = [
    ((-1, 3), 0),
    ((2, -1), 1),
    ((2, 3, -1), -1),
    ((2, -1, 3), 1),  # staging path: pieces are not dense in the output
    ((1, 1, -1, 2), 2),  # direct path although dim != 0 (only size-1 dims before it)
    ((0, -1), 1),  # other dims hold no elements: nothing is sent although splits are not 0
]


def _shape(layout: Sequence[int], size: int) -> list[int]:
    return [size if s == -1 else s for s in layout]


def _input(case: str, rank: int, layout, dim: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    # crc32, not hash(): str hashes differ between processes, and every rank builds every input
    g = torch.Generator().manual_seed(zlib.crc32(repr((case, rank, tuple(layout), dim)).encode()))
    shape = _shape(layout, size)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)


def ref_m2ms(
    xs: dict[int, torch.Tensor],
    dim: int,
    mat: Sequence[Sequence[int]],
    src: Sequence[int],
    dst: Sequence[int],
    rank: int,
    like: torch.Tensor,
) -> torch.Tensor:
    """The spec, literally: dst[j] gets, in src order, piece j of every src[i]'s x (split by row i)."""
    if rank not in dst:
        shape = list(like.shape)
        shape[dim] = 0
        return like.new_empty(shape)
    j = list(dst).index(rank)
    pieces = [torch.split(xs[s], list(mat[i]), dim=dim)[j] for i, s in enumerate(src)]
    return torch.cat(pieces, dim=dim)


def _all_inputs(case, src, mat, layout, dim, dtype, n) -> dict[int, torch.Tensor]:
    return {
        r: _input(case, r, layout, dim, sum(mat[src.index(r)]) if r in src else 0, dtype) for r in range(n)
    }


def m2ms_numerics(dtypes: Sequence[str]) -> list[dict[str, Any]]:
    """Every case x layout x dtype through the async op (issue, clobber the input, wait)
    and the wrapper; records each result against the reference (bitwise)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    name = dist.group.WORLD.group_name
    records = []
    for case, src, dst, mat in M2MS_CASES:
        flat = [s for row in mat for s in row]
        for layout, dim in LAYOUTS:
            for dt in dtypes:
                dtype = getattr(torch, dt)
                xs = _all_inputs(case, src, mat, layout, dim, dtype, n)
                x = xs[rank].clone()
                want = ref_m2ms(xs, dim, mat, src, dst, rank, x)
                out = M2MS(x, dim, flat, src, dst, n, name)
                x.fill_(7)  # the op copied what it sends: reusing x before the wait is safe
                out = c10d_functional.wait_tensor(out)
                via_wrapper = m2ms(xs[rank], dim, mat, src, dst, dist.group.WORLD)
                records.append(
                    {
                        "case": case,
                        "layout": layout,
                        "dim": dim,
                        "dtype": dt,
                        "shape": tuple(out.shape),
                        "want_shape": tuple(want.shape),
                        "equal": bool(out.shape == want.shape and torch.equal(out, want)),
                        "wrapper_equal": bool(
                            via_wrapper.shape == want.shape and torch.equal(via_wrapper, want)
                        ),
                        "contiguous": out.is_contiguous(),
                        "dtype_ok": out.dtype == dtype,
                    }
                )
    return records


def m2ms_matches_all_to_all() -> bool:
    """With A = B = every rank, m2ms is all_to_all_single with the matrix's splits."""
    rank, n = dist.get_rank(), dist.get_world_size()
    mat = [[(i + 2 * j) % 3 for j in range(n)] for i in range(n)]
    x = torch.randn(sum(mat[rank]), 5, generator=torch.Generator().manual_seed(rank))
    got = m2ms(x, 0, mat, list(range(n)), list(range(n)), dist.group.WORLD)
    want = torch.empty(sum(mat[i][rank] for i in range(n)), 5)
    dist.all_to_all_single(want, x, [mat[i][rank] for i in range(n)], mat[rank])
    return torch.equal(got, want)


def m2ms_on_subgroup() -> Optional[dict[str, Any]]:
    """G = ranks {1, 2, 3}: src/dst are *group* ranks (global rank 1 is group rank 0)."""
    rank = dist.get_rank()
    g = dist.new_group([1, 2, 3])
    if rank == 0:
        return None
    me = dist.get_rank(g)
    src, dst, mat = [2, 0], [0, 1, 2], [[1, 2, 0], [2, 1, 3]]
    xs = _all_inputs("subgroup", src, mat, (-1, 2), 0, torch.float32, 3)
    out = m2ms(xs[me], 0, mat, src, dst, g.group_name)  # by name this time
    want = ref_m2ms(xs, 0, mat, src, dst, me, xs[me])
    return {"group_rank": me, "equal": bool(out.shape == want.shape and torch.equal(out, want))}


def m2ms_gradients() -> list[dict[str, Any]]:
    """The wrapper's backward is the reverse scatter: grad_x = ref_m2ms of the upstream
    gradients with src/dst swapped and the matrix transposed; and the adjoint identity
    sum_r <m2ms(x)_r, w_r> == sum_r <x_r, grad_r> holds across ranks (float64)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    records = []
    for case, src, dst, mat in M2MS_CASES:
        for layout, dim in LAYOUTS[:4]:
            xs = _all_inputs(case, src, mat, layout, dim, torch.float64, n)
            x = xs[rank].clone().requires_grad_(True)
            out = m2ms(x, dim, mat, src, dst, dist.group.WORLD)
            ws = {
                r: _input(
                    case + "-w",
                    r,
                    layout,
                    dim,
                    sum(row[dst.index(r)] for row in mat) if r in dst else 0,
                    torch.float64,
                )
                for r in range(n)
            }
            (grad,) = torch.autograd.grad((out * ws[rank]).sum(), x, allow_unused=False)
            matT = [[mat[i][j] for i in range(len(src))] for j in range(len(dst))]
            want = ref_m2ms(ws, dim, matT, dst, src, rank, ws[rank])
            if rank not in src:  # the reference yields a size-0 dim there, as x has
                want = want.reshape(x.shape)
            sums = torch.tensor(
                [(out.detach() * ws[rank]).sum().item(), (xs[rank] * grad).sum().item()], dtype=torch.float64
            )
            dist.all_reduce(sums)
            records.append(
                {
                    "case": case,
                    "layout": layout,
                    "dim": dim,
                    "grad_equal": bool(grad.shape == want.shape and torch.equal(grad, want)),
                    "adjoint_gap": float((sums[0] - sums[1]).abs()),
                }
            )
    return records


def stage_transfer_cases() -> list[dict[str, Any]]:
    """Pairs through the async op and the wrapper; forward values and backward (dst -> src)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    name = dist.group.WORLD.group_name
    cases = [
        ("one_pair", [0], [1]),
        ("chain", [0, 1, 2], [1, 2, 3]),  # ranks 1, 2 send and receive
        ("ring", [0, 1, 2, 3], [1, 2, 3, 0]),
        ("swap_and_self", [0, 1, 3], [1, 0, 3]),  # 3 -> 3 is a local copy; rank 2 in no pair
    ]
    records = []
    for case, src, dst in cases:
        for dt in ("float32", "bfloat16", "int64"):
            dtype = getattr(torch, dt)
            xs = {r: _input(case, r, (3, -1), 1, 4, dtype) for r in range(n)}
            want = xs[src[dst.index(rank)]] if rank in dst else torch.zeros_like(xs[rank])
            x = xs[rank].clone()
            out = STAGE_TRANSFER(x, src, dst, n, name)
            x.fill_(5)
            out = c10d_functional.wait_tensor(out)
            rec = {
                "case": case,
                "dtype": dt,
                "equal": bool(torch.equal(out, want)),
                "wrapper_equal": bool(torch.equal(stage_transfer(xs[rank], src, dst, name), want)),
            }
            if dtype.is_floating_point:
                xg = xs[rank].double().requires_grad_(True)
                y = stage_transfer(xg, src, dst, dist.group.WORLD)
                w = {r: _input(case + "-w", r, (3, -1), 1, 4, torch.float64) for r in range(n)}
                (g,) = torch.autograd.grad((y * w[rank]).sum(), xg)
                gwant = w[dst[src.index(rank)]] if rank in src else torch.zeros_like(xg)
                rec["grad_equal"] = bool(torch.equal(g, gwant))
            records.append(rec)
    return records


def opposite_issue_orders() -> dict[str, bool]:
    """1F1B: stage 0 (ranks 0, 1) issues its forward transfer of micro-batch m+1 before
    receiving the gradient of m; stage 1 (ranks 2, 3) issues the gradient first. Both
    are in flight together and waited in each side's own order; point-to-point matching
    keeps every value right (a collective would pair the wrong calls)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    name = dist.group.WORLD.group_name
    a, b = [0, 1], [2, 3]
    fmat, bmat = [[2, 1], [1, 3]], [[1, 2], [3, 1]]
    ffl, bfl = [s for r in fmat for s in r], [s for r in bmat for s in r]
    xs = _all_inputs("act", a, fmat, (-1, 4), 0, torch.float32, n)
    gs = _all_inputs("grad", b, bmat, (-1, 4), 0, torch.float32, n)
    acts = {r: _input("p2p", r, (2, 3), 0, 2, torch.float32) for r in range(n)}
    fwd = lambda: M2MS(xs[rank], 0, ffl, a, b, n, name)  # noqa: E731
    bwd = lambda: M2MS(gs[rank], 0, bfl, b, a, n, name)  # noqa: E731
    p_fwd = lambda: STAGE_TRANSFER(acts[rank], [0, 1], [2, 3], n, name)  # noqa: E731
    p_bwd = lambda: STAGE_TRANSFER(acts[rank], [2, 3], [0, 1], n, name)  # noqa: E731
    if rank in a:
        f, bk, pf, pb = fwd(), bwd(), p_fwd(), p_bwd()
        outs = [c10d_functional.wait_tensor(t) for t in (bk, f, pb, pf)]
        bk, f, pb, pf = outs
    else:
        bk, f, pb, pf = bwd(), fwd(), p_bwd(), p_fwd()
        outs = [c10d_functional.wait_tensor(t) for t in (f, bk, pf, pb)]
        f, bk, pf, pb = outs
    ok_f = torch.equal(f, ref_m2ms(xs, 0, fmat, a, b, rank, xs[rank]))
    ok_b = torch.equal(bk, ref_m2ms(gs, 0, bmat, b, a, rank, gs[rank]))
    want_pf = acts[rank - 2] if rank in b else torch.zeros(2, 3)
    want_pb = acts[rank + 2] if rank in a else torch.zeros(2, 3)
    return {
        "m2ms_fwd": ok_f,
        "m2ms_bwd": ok_b,
        "p2p_fwd": torch.equal(pf, want_pf),
        "p2p_bwd": torch.equal(pb, want_pb),
    }


def _compiled_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n = dist.get_world_size()
    mat = [[1, 3], [2, 2]][:n]
    h = torch.tanh(x * w)
    y = m2ms(h, 0, mat, [0, 1], [0, 1], dist.group.WORLD)
    z = stage_transfer(y.sum(0, keepdim=True) * 2, [0], [1], dist.group.WORLD)
    return y.square().sum() + z.sum()


def compile_matches_eager() -> dict[str, Any]:
    """torch.compile(backend="aot_eager") of a function with both wrappers (forward and
    backward) gives eager's values bit for bit and traces the commfuse ops."""
    import torch._dynamo.testing as dt

    rank = dist.get_rank()
    mat = [[1, 3], [2, 2]]
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(sum(mat[rank]), 3, generator=gen)
    w = torch.randn(sum(mat[rank]), 3, generator=gen).requires_grad_(True)
    loss = _compiled_fn(x, w)
    (g,) = torch.autograd.grad(loss, w)
    counter = dt.CompileCounterWithBackend("aot_eager")
    fn = torch.compile(_compiled_fn, backend=counter, fullgraph=True)
    w2 = w.detach().clone().requires_grad_(True)
    loss2 = fn(x, w2)
    (g2,) = torch.autograd.grad(loss2, w2)
    graph = counter.graphs[0].code if counter.graphs else ""
    return {
        "loss_equal": bool(torch.equal(loss, loss2)),
        "grad_equal": bool(torch.equal(g, g2)),
        "frames": counter.frame_count,
        "has_m2ms": "m2ms_autograd" in graph,
        "has_stage_transfer": "stage_transfer_autograd" in graph,
    }


def fake_shapes_under_real_group() -> tuple:
    """Fake kernel on a live group: the output size is this rank's column sum."""
    rank = dist.get_rank()
    mat = [[1, 2], [3, 4]]
    with FakeTensorMode():
        x = torch.empty(sum(mat[rank]) if rank < 2 else 0, 5)
        y = M2MS(x, 0, [1, 2, 3, 4], [0, 1], [1, 0], dist.get_world_size(), dist.group.WORLD.group_name)
    return tuple(y.shape)


def size_mismatch_raises() -> str:
    """A rank whose x does not have its row's size gets a ValueError before anything is sent."""
    n = dist.get_world_size()
    try:
        M2MS(
            torch.zeros(5, 2), 0, [1] * n * n, list(range(n)), list(range(n)), n, dist.group.WORLD.group_name
        )
    except ValueError as e:
        return str(e)
    return "no error"
