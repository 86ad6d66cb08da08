"""Recognise DTensor's layout shuffles around dim-0 collectives.

DTensor (and most hand-written SP code) implements a collective along dim d by a
dim-0 collective plus a shuffle:

* all_gather along d:   ``w = wait(all_gather(x)); cat(split(w, n0/N, 0)[0..N-1], dim=d)``
* reduce_scatter along d: ``reduce_scatter(cat(split(x, xd/N, d)[0..N-1], 0))``
* all_to_all from split dim s to concat dim c: the same shuffles on both sides.

Two other forms PyTorch 2.13 emits are recognised too: the pieces may be N equal,
in-order ``aten.slice`` calls instead of a split (the autograd collectives'
backward), and when every dim before d has local size 1 a gather along d is a
single ``view`` (``torch._utils._maybe_view_chunk_cat``: ``[N, s, h] -> [1, N*s, h]``).

Matching is exact: the split must produce exactly N equal pieces consumed in
order by one cat and by nothing else; otherwise the collective is reported as
the dim-0 collective it literally is.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from commfuse.ir.shapes import shape_of

aten = torch.ops.aten
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
_CATS = {aten.cat.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


@dataclass
class Shuffle:
    dim: int  # the logical dim (normalised, >= 0)
    outer: fx.Node  # the node on the far side of the shuffle (cat output or split input)
    nodes: list[fx.Node]  # split, getitems and cat


def _arg(node: fx.Node, idx: int, name: str, default=None):
    if len(node.args) > idx:
        return node.args[idx]
    return node.kwargs.get(name, default)


def _split_dim(node: fx.Node) -> int:
    dim = _arg(node, 2, "dim", 0)
    rank = len(shape_of(node.args[0]) or ())
    return dim % rank if rank else dim


def _cat_dim(node: fx.Node) -> int:
    dim = _arg(node, 1, "dim", 0)
    rank = len(shape_of(node) or ())
    return dim % rank if rank else dim


def _ordered_getitems(split: fx.Node, n: int) -> list[fx.Node] | None:
    """The split's getitem users, ordered by index, iff there are exactly n distinct ones."""
    by_idx: dict[int, fx.Node] = {}
    for u in split.users:
        if u.op != "call_function" or u.target is not operator.getitem:
            return None
        if u.args[1] in by_idx:
            return None
        by_idx[u.args[1]] = u
    if sorted(by_idx) != list(range(n)):
        return None
    return [by_idx[i] for i in range(n)]


def _equal_pieces(split: fx.Node, n: int) -> bool:
    shapes = [shape_of(u) for u in split.users]
    return len(shapes) == n and all(s is not None and s == shapes[0] for s in shapes)


def _slice_pieces(src: fx.Node, pieces: list, n: int) -> int | None:
    """The dim along which `pieces` are N equal, in-order, covering slices of `src`, else None."""
    shape = shape_of(src)
    if shape is None or len(pieces) != n:
        return None
    dim = None
    for i, p in enumerate(pieces):
        if not isinstance(p, fx.Node) or p.target is not aten.slice.Tensor or p.args[0] is not src:
            return None
        d = _arg(p, 1, "dim", 0) % len(shape)
        start, end = _arg(p, 2, "start", 0), _arg(p, 3, "end", None)
        size = shape[d]
        if not isinstance(size, int) or size % n or (dim is not None and d != dim):
            return None
        k = size // n
        if start != i * k or (end if end is not None else size) not in ((i + 1) * k,) + (
            (size,) if i == n - 1 else ()
        ):
            return None
        dim = d
    return dim


def _view_concat_dim(stacked: fx.Node, catted: fx.Node, n: int) -> int | None:
    """d if `catted` is `stacked` ([N*a0, ...], N pieces stacked on dim 0) seen as the cat of
    those pieces along d, which a view can express only when every local dim before d is 1."""
    ins, outs = shape_of(stacked), shape_of(catted)
    if ins is None or outs is None or len(ins) != len(outs) or not ins or not isinstance(ins[0], int):
        return None
    if ins[0] % n:
        return None
    local = (ins[0] // n, *ins[1:])
    diff = [d for d in range(len(outs)) if outs[d] != local[d]]
    if len(diff) != 1 or diff[0] == 0:
        return None
    d = diff[0]
    if outs[d] != local[d] * n or any(local[j] != 1 for j in range(d)):
        return None
    return d


def match_gather_shuffle(wait: fx.Node, group_size: int | None) -> Shuffle | None:
    """wait -> split(dim 0, N pieces) -> one cat(dim d) of all pieces in order (or the slice/view forms)."""
    if group_size is None or not wait.users:
        return None
    users = list(wait.users)
    if (
        len(users) == group_size
        and all(len(p.users) == 1 for p in users)
        and len({u for p in users for u in p.users}) == 1
    ):
        cat = next(iter(users[0].users))
        if cat.op == "call_function" and cat.target in _CATS:
            pieces = list(cat.args[0])
            if set(pieces) == set(users) and _slice_pieces(wait, pieces, group_size) == 0:
                return Shuffle(dim=_cat_dim(cat), outer=cat, nodes=[*pieces, cat])
    if len(users) != 1:
        return None
    (split,) = users
    if split.op == "call_function" and split.target in _VIEWS:
        d = _view_concat_dim(wait, split, group_size)
        return None if d is None else Shuffle(dim=d, outer=split, nodes=[split])
    if split.op != "call_function" or split.target not in _SPLITS or _split_dim(split) != 0:
        return None
    pieces = _ordered_getitems(split, group_size)
    if pieces is None or not _equal_pieces(split, group_size):
        return None
    cats = {u for p in pieces for u in p.users}
    if len(cats) != 1 or any(len(p.users) != 1 for p in pieces):
        return None
    (cat,) = cats
    if cat.op != "call_function" or cat.target not in _CATS or list(cat.args[0]) != pieces:
        return None
    return Shuffle(dim=_cat_dim(cat), outer=cat, nodes=[split, *pieces, cat])


def match_scatter_shuffle(inp: fx.Node, group_size: int | None) -> Shuffle | None:
    """x -> split(dim d, N pieces) -> cat(dim 0) of all pieces in order -> collective input
    (or the slice/view forms)."""
    if group_size is None or inp.op != "call_function":
        return None
    if inp.target in _VIEWS and len(inp.users) == 1 and isinstance(inp.args[0], fx.Node):
        d = _view_concat_dim(inp, inp.args[0], group_size)
        return None if d is None else Shuffle(dim=d, outer=inp.args[0], nodes=[inp])
    if inp.target not in _CATS or _cat_dim(inp) != 0:
        return None
    if len(inp.users) != 1:
        return None
    pieces = list(inp.args[0])
    srcs = {p.args[0] for p in pieces if isinstance(p, fx.Node) and p.target is aten.slice.Tensor}
    if len(srcs) == 1 and all(len(p.users) == 1 for p in pieces):
        (src,) = srcs
        d = _slice_pieces(src, pieces, group_size)
        if d is not None:
            return Shuffle(dim=d, outer=src, nodes=[*pieces, inp])
    if len(pieces) != group_size or any(
        not isinstance(p, fx.Node) or p.target is not operator.getitem or len(p.users) != 1 for p in pieces
    ):
        return None
    splits = {p.args[0] for p in pieces}
    if len(splits) != 1:
        return None
    (split,) = splits
    if split.op != "call_function" or split.target not in _SPLITS:
        return None
    if _ordered_getitems(split, group_size) != pieces or not _equal_pieces(split, group_size):
        return None
    return Shuffle(dim=_split_dim(split), outer=split.args[0], nodes=[split, *pieces, inp])
