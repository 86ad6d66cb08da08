"""``commfuse::m2ms``: many-to-many scatter (Chimera §3, Table 1 "M2MS").

Every rank of group A (``src``) sends a possibly different-sized piece of its input to
every rank of group B (``dst``); both are lists of *group* ranks of one process group G
(``group_name``, resolved at run time, never created) and may overlap, coincide or be
disjoint. ::

    torch.ops.commfuse.m2ms(Tensor x, int dim, int[] splits, int[] src, int[] dst,
                            int group_size, str group_name) -> Tensor   # then wait_tensor

Contract
- ``splits`` is the piece matrix flattened row-major (``splits[i*len(dst)+j]`` = size along
  ``dim`` of the piece ``src[i]`` sends to ``dst[j]``; 0 allowed), identical on every rank.
- Input on ``src[i]``: ``x.size(dim) == sum_j splits[i, j]``, cut along ``dim`` into
  consecutive pieces in dst order; on a rank not in A, ``x.size(dim) == 0``.
- Output on ``dst[j]``: the received pieces concatenated along ``dim`` in src order (size
  ``sum_i splits[i, j]``); on a rank not in B, size 0 along ``dim``. Other dims are x's;
  the output is contiguous. A rank in both groups copies its own piece locally.
- Every rank of G calls the op (ranks in neither group with zero-size input and output);
  values are moved bit for bit (no arithmetic).
- Asynchronous like ``_c10d_functional``: the op issues the transfers and ties them to
  its output with ``register_work``; ``_c10d_functional.wait_tensor`` waits for all of
  them. The input is copied into send buffers first, so it may be freed or reused as
  soon as the op returns.
- Fake kernel: x with ``dim`` resized to the column sum of the current rank's position
  in B (:func:`commfuse.ops.trace_position` can name another member; not in B: 0).

Implementation: batched ``isend``/``irecv`` (:mod:`commfuse.ops.boundary.p2p`), never a collective,
so a pipeline may issue boundary transfers in different orders on the two sides (1F1B).
Sender ``src[i]`` posts its pieces in Chimera's destination order ``dst[i]``,
``dst[(i+1)%N]``, ... (no receiver is everyone's first target); receiver ``dst[j]`` posts
``src[j]``, ``src[j-1]``, ... (mod M), the matching order. Empty pieces are not sent.

Autograd: ``commfuse::m2ms_autograd`` (same arguments, issues and waits inside, like
``_c10d_functional_autograd``) has ``register_autograd``: its backward is the reverse
scatter of the gradient (``src``/``dst`` swapped, matrix transposed), itself an
``m2ms_autograd``, so make_fx / AOTAutograd traces forward and backward as that op.
:func:`m2ms` (the wrapper) uses it when ``x`` needs a gradient, else the async op + wait.

Source: Chimera (§3, Table 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from commfuse.core.torch_private import c10d_functional, register_work
from commfuse.ops.boundary.common import (
    as_rank_list,
    check_group_size,
    check_ranks,
    group_name_and_size,
    norm_dim,
    own_group_rank,
    resolve_group,
    want_autograd,
)
from commfuse.ops.boundary.p2p import BatchedWork, Transfer, issue_batched
from commfuse.ops.boundary.trace import active_entry, reenter, traced_sides, tracing_as_other

_OP = "commfuse::m2ms"


# ---------------------------------------------------------------------------------------- arguments


def _check_splits(splits: Sequence[int], n_src: int, n_dst: int, op: str) -> tuple[tuple[int, ...], ...]:
    """The flat piece list as a matrix (rows = src, columns = dst), checked."""
    if not isinstance(splits, (list, tuple)):
        raise ValueError(f"{op}: splits must be a list of ints, got {type(splits).__name__}")
    if len(splits) != n_src * n_dst:
        raise ValueError(
            f"{op}: splits has {len(splits)} entries, expected len(src) * len(dst) = "
            f"{n_src} * {n_dst} = {n_src * n_dst} (the piece matrix, row-major)"
        )
    for k, s in enumerate(splits):
        if isinstance(s, bool) or not isinstance(s, int):
            raise ValueError(f"{op}: splits[{k}] must be an int, got {s!r}")
        if s < 0:
            raise ValueError(
                f"{op}: splits[{k}] = {s} is negative (piece src[{k // n_dst}] -> dst[{k % n_dst}])"
            )
    return tuple(tuple(int(s) for s in splits[i * n_dst : (i + 1) * n_dst]) for i in range(n_src))


def _check_args(dim: int, ndim: int, splits, src, dst, group_size: int, op: str):
    check_group_size(group_size, op)
    src, dst = as_rank_list(src, "src", op), as_rank_list(dst, "dst", op)
    check_ranks(src, "src", group_size, op)
    check_ranks(dst, "dst", group_size, op)
    d = norm_dim(dim, ndim, op)
    return d, _check_splits(splits, len(src), len(dst), op), src, dst


def _row(mat, src, rank: Optional[int]) -> tuple[int, ...]:
    n = len(mat[0]) if mat else 0
    return mat[src.index(rank)] if rank is not None and rank in src else (0,) * n


def _col(mat, dst, rank: Optional[int]) -> tuple[int, ...]:
    if rank is None or rank not in dst:
        return (0,) * len(mat)
    j = dst.index(rank)
    return tuple(r[j] for r in mat)


def _check_input_size(x_size: Any, d: int, mat, src, rank: int, op: str) -> None:
    want = sum(_row(mat, src, rank))
    if x_size != want:
        who = "the traced rank (in no group)" if rank is None else f"group rank {rank}"
        where = (
            f"{who} is src[{src.index(rank)}] and sends sum(splits row) = {want}"
            if rank in src
            else f"{who} is not in src, so it sends nothing (size 0)"
        )
        raise ValueError(f"{op}: x has size {x_size} along dim {d}, but {where}")


@dataclass(frozen=True)
class M2MSArgs:
    """The arguments of one m2ms call (either op variant), normalised.

    ``splits`` is the piece matrix (rows: ``src`` order, columns: ``dst`` order). Sizes are
    counted in *units* (slices along ``dim``); multiply by :meth:`unit_numel` and the
    element size for bytes."""

    x: Any
    dim: int
    splits: tuple[tuple[int, ...], ...]
    src: tuple[int, ...]
    dst: tuple[int, ...]
    group_size: int
    group_name: str

    def row(self, rank: int) -> tuple[int, ...]:
        """Pieces group rank ``rank`` sends, in dst order (zeros when not in src)."""
        return _row(self.splits, list(self.src), rank)

    def column(self, rank: int) -> tuple[int, ...]:
        """Pieces group rank ``rank`` receives, in src order (zeros when not in dst)."""
        return _col(self.splits, list(self.dst), rank)

    def sent_units(self, rank: int) -> int:
        """Units ``rank`` puts on the wire (its own piece to itself excluded)."""
        return sum(s for s, d in zip(self.row(rank), self.dst, strict=True) if d != rank)

    def received_units(self, rank: int) -> int:
        """Units ``rank`` takes off the wire (its own piece excluded)."""
        return sum(s for s, a in zip(self.column(rank), self.src, strict=True) if a != rank)

    def send_peers(self, rank: int) -> tuple[int, ...]:
        """Group ranks ``rank`` sends a non-empty piece to (self excluded), in dst order."""
        return tuple(d for s, d in zip(self.row(rank), self.dst, strict=True) if s and d != rank)

    def recv_peers(self, rank: int) -> tuple[int, ...]:
        """Group ranks ``rank`` receives a non-empty piece from (self excluded), in src order."""
        return tuple(a for s, a in zip(self.column(rank), self.src, strict=True) if s and a != rank)

    def unit_numel(self, x_shape: Sequence[int]) -> int:
        """Elements per unit along ``dim`` for an input of shape ``x_shape``."""
        n = 1
        for k, s in enumerate(x_shape):
            if k != self.dim:
                n *= int(s)
        return n


def _arg(args: Sequence[Any], kwargs: dict, idx: int, name: str) -> Any:
    return args[idx] if len(args) > idx else kwargs[name]


def _ndim_of(x: Any) -> Optional[int]:
    val = x.meta.get("val") if hasattr(x, "meta") else x
    return val.dim() if isinstance(val, Tensor) else None


def parse_m2ms(node_or_args: Any, kwargs: Optional[dict] = None) -> M2MSArgs:
    """Read an m2ms call: an fx Node of ``M2MS`` / ``M2MS_AUTOGRAD``, or its ``args`` (+ ``kwargs``).

    ``dim`` is normalised when x's rank is known (a tensor, or a node with ``meta['val']``).
    Raises ValueError on arguments the op itself would reject."""
    import torch.fx as fx

    if isinstance(node_or_args, fx.Node):
        if node_or_args.target not in (M2MS, M2MS_AUTOGRAD):
            raise ValueError(
                f"parse_m2ms: node {node_or_args.name} calls {node_or_args.target}, not commfuse::m2ms"
            )
        args, kwargs = node_or_args.args, dict(node_or_args.kwargs)
    else:
        args, kwargs = tuple(node_or_args), dict(kwargs or {})
    names = ("x", "dim", "splits", "src", "dst", "group_size", "group_name")
    x, dim, splits, src, dst, gsize, gname = (_arg(args, kwargs, k, n) for k, n in enumerate(names))
    ndim = _ndim_of(x)
    if ndim is None:  # x's rank unknown: check everything but the range of dim, keep dim as given
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ValueError(f"parse_m2ms: dim must be an int, got {dim!r}")
        _, mat, src, dst = _check_args(0, 1, splits, src, dst, gsize, "parse_m2ms")
        d = int(dim)
    else:
        d, mat, src, dst = _check_args(dim, ndim, splits, src, dst, gsize, "parse_m2ms")
    return M2MSArgs(x, d, mat, tuple(src), tuple(dst), int(gsize), str(gname))


# ------------------------------------------------------------------------------------------- kernel


def _unit_is_empty(shape: Sequence[int], d: int) -> bool:
    return any(int(s) == 0 for k, s in enumerate(shape) if k != d)


def _issue(
    x: Tensor, dim: int, splits: list[int], src: list[int], dst: list[int], group_size: int, group_name: str
) -> tuple[Tensor, BatchedWork]:
    """Start the scatter on this rank; returns the output (filled once the work is waited) and the work."""
    d, mat, src, dst = _check_args(dim, x.dim(), splits, src, dst, group_size, _OP)
    pg = resolve_group(group_name, group_size, _OP)
    import torch.distributed as dist

    me = dist.get_rank(pg)
    _check_input_size(x.size(d), d, mat, src, me, _OP)
    row, col = _row(mat, src, me), _col(mat, dst, me)
    shape = list(x.shape)
    shape[d] = sum(col)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if _unit_is_empty(x.shape, d):
        # Other dims hold no elements (the same on every rank): every piece is empty.
        return out, issue_batched(pg, [], [])
    # Pieces travel with `dim` first, where every piece is one dense block. When `out` seen
    # that way is dense too (dim 0, or only size-1 dims before it), receive straight into it;
    # otherwise into a staging buffer copied into `out` when the work is waited.
    out_t = out.movedim(d, 0)
    direct = out_t.is_contiguous()
    stage = out_t if direct else torch.empty(out_t.shape, dtype=x.dtype, device=x.device)
    x_t = x.movedim(d, 0)
    send_off = [sum(row[:k]) for k in range(len(row))]
    recv_off = [sum(col[:k]) for k in range(len(col))]

    sends: list[Transfer] = []
    if me in src:
        i = src.index(me)
        for k in range(len(dst)):  # Chimera's order: dst[i], dst[i+1], ... (mod N)
            jj = (i + k) % len(dst)
            n, peer = row[jj], dst[jj]
            if n == 0:
                continue
            piece = x_t.narrow(0, send_off[jj], n)
            if peer == me:  # own piece: a local copy, straight into its place in the output
                stage.narrow(0, recv_off[src.index(me)], n).copy_(piece)
            else:  # a fresh dense copy, so `x` may be reused once the op returns
                sends.append(Transfer(peer, piece.clone(memory_format=torch.contiguous_format)))
    recvs: list[Transfer] = []
    if me in dst:
        j = dst.index(me)
        for k in range(len(src)):  # the receiving side of that order: src[j], src[j-1], ... (mod M)
            ii = (j - k) % len(src)
            n, peer = col[ii], src[ii]
            if n and peer != me:
                recvs.append(Transfer(peer, stage.narrow(0, recv_off[ii], n)))
    finish = None
    if not direct:
        if recvs:

            def finish() -> None:
                out.copy_(stage.movedim(0, d))
        else:
            out.copy_(stage.movedim(0, d))
    return out, issue_batched(pg, sends, recvs, finish, keep_alive=(stage,))


_M2MS_SCHEMA = (
    "(Tensor x, int dim, int[] splits, int[] src, int[] dst, int group_size, str group_name) -> Tensor"
)


@torch.library.custom_op("commfuse::m2ms", mutates_args=(), schema=_M2MS_SCHEMA)
def m2ms_op(
    x: Tensor, dim: int, splits: list[int], src: list[int], dst: list[int], group_size: int, group_name: str
) -> Tensor:
    out, work = _issue(x, dim, splits, src, dst, group_size, group_name)
    register_work(out, work)
    return out


@torch.library.custom_op("commfuse::m2ms_autograd", mutates_args=(), schema=_M2MS_SCHEMA)
def m2ms_autograd_op(
    x: Tensor, dim: int, splits: list[int], src: list[int], dst: list[int], group_size: int, group_name: str
) -> Tensor:
    out, work = _issue(x, dim, splits, src, dst, group_size, group_name)
    work.wait()
    return out


def _fake(x, dim, splits, src, dst, group_size, group_name):
    d, mat, src, dst = _check_args(dim, x.dim(), splits, src, dst, group_size, _OP)
    own = own_group_rank(group_name)
    sender, receiver = traced_sides(group_name, src, dst, own)
    if sender is not None or tracing_as_other(group_name):
        # The traced rank is known (this process's, or the one a trace context names): its
        # input must have its row's size, as the real kernel will check.
        _check_input_size(x.size(d), d, mat, src, sender, _OP)
    shape = list(x.shape)
    shape[d] = sum(_col(mat, dst, receiver))
    return x.new_empty(shape)


m2ms_op.register_fake(_fake)
m2ms_autograd_op.register_fake(_fake)


def _transpose(splits: Sequence[int], n_src: int, n_dst: int) -> list[int]:
    return [int(splits[i * n_dst + j]) for j in range(n_dst) for i in range(n_src)]


def _setup_context(ctx, inputs, output) -> None:
    _, dim, splits, src, dst, group_size, group_name = inputs
    ctx.m2ms = (dim, list(splits), list(src), list(dst), group_size, group_name)
    # Traced under trace_position / trace_as_rank: trace the backward in the same context
    # (both are symmetric under the reverse scatter), even if autograd runs it outside.
    ctx.trace_entry = active_entry(group_name)


def _backward(ctx, grad: Tensor):
    dim, splits, src, dst, group_size, group_name = ctx.m2ms
    with reenter(ctx.trace_entry):
        g = M2MS_AUTOGRAD(grad, dim, _transpose(splits, len(src), len(dst)), dst, src, group_size, group_name)
    return g, None, None, None, None, None, None


m2ms_autograd_op.register_autograd(_backward, setup_context=_setup_context)

M2MS = torch.ops.commfuse.m2ms.default
M2MS_AUTOGRAD = torch.ops.commfuse.m2ms_autograd.default


# ------------------------------------------------------------------------------------------ wrapper


def _flat_splits(splits: Any, n_src: int, n_dst: int) -> list[int]:
    if not isinstance(splits, (list, tuple)):
        raise ValueError(
            f"m2ms: splits must be a matrix (list of len(src) rows of len(dst) ints) or its "
            f"row-major flattening, got {type(splits).__name__}"
        )
    if splits and all(isinstance(r, (list, tuple)) for r in splits):
        if len(splits) != n_src:
            raise ValueError(f"m2ms: splits has {len(splits)} rows, expected one per src rank ({n_src})")
        for i, r in enumerate(splits):
            if len(r) != n_dst:
                raise ValueError(
                    f"m2ms: splits row {i} has {len(r)} entries, expected one per dst rank ({n_dst})"
                )
        return [s for r in splits for s in r]
    if any(isinstance(r, (list, tuple)) for r in splits):
        raise ValueError("m2ms: splits mixes rows (lists) and numbers; give a matrix or a flat list")
    return list(splits)


def m2ms(x: Tensor, dim: int, splits: Any, src: Any, dst: Any, group: Any) -> Tensor:
    """Many-to-many scatter of ``x`` along ``dim`` from ``src`` to ``dst`` (group ranks of ``group``).

    ``splits``: the piece matrix (``splits[i][j]``: size sent by ``src[i]`` to ``dst[j]``) or its
    row-major flattening, the same on every rank. ``group``: a ProcessGroup or its name.
    Returns the received pieces concatenated in src order (waited). Differentiable: the
    gradient goes back by the reverse scatter."""
    if not isinstance(x, Tensor):
        raise ValueError(f"m2ms: x must be a Tensor, got {type(x).__name__}")
    name, size = group_name_and_size(group, "m2ms")
    src_l, dst_l = as_rank_list(src, "src", "m2ms"), as_rank_list(dst, "dst", "m2ms")
    flat = _flat_splits(splits, len(src_l), len(dst_l))
    d, _, src_l, dst_l = _check_args(dim, x.dim(), flat, src_l, dst_l, size, "m2ms")
    if want_autograd(x):
        return M2MS_AUTOGRAD(x, d, flat, src_l, dst_l, size, name)
    return c10d_functional.wait_tensor.default(M2MS(x, d, flat, src_l, dst_l, size, name))


__all__ = ["M2MS", "M2MSArgs", "M2MS_AUTOGRAD", "m2ms", "parse_m2ms"]
