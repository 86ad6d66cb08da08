"""Reference semantics of commfuse's boundary ops: ``commfuse::m2ms`` and ``commfuse::stage_transfer``.

Both ops (:mod:`commfuse.ops`) are implemented with point-to-point messages (batched
``isend``/``irecv``, one tag, matched per (sender, receiver) pair in posting order), not as
a collective: ranks of the group that neither send nor receive need not call them, and the
two sides of a pipeline boundary may interleave their transfers in different orders (1F1B).
So their meaning here is *p2p* semantics (:class:`~commfuse.reference.semantics.P2PPlan`):
each call says what it sends to and receives from which group rank; the interpreter matches
messages by (group, source, destination, tag 0), in order -- what the backends do.

For a call on group rank ``g`` (the values are moved bit for bit, no arithmetic):

* ``m2ms(x, dim, splits, src, dst, group_size, group_name)``: ``x`` (size along ``dim`` =
  ``g``'s row sum when ``g`` is ``src[i]``, else 0) is cut along ``dim`` into its row's
  pieces in dst order; ``g`` sends every non-empty piece to its ``dst[j]`` (with ``dim``
  moved first, the layout the op sends) and keeps its piece to itself; it receives one
  piece from every ``src[i]`` with a non-empty piece in its column. Result: the pieces
  concatenated along ``dim`` in src order (size = ``g``'s column sum; 0 when ``g`` is not a
  destination), contiguous.
* ``stage_transfer(x, src, dst, group_size, group_name)``: ``src[i]`` sends ``x`` to
  ``dst[i]`` (``src[i] == dst[i]``: a local copy; an empty ``x`` is not sent). Result on
  ``dst[i]``: the data received, on any other rank zeros of ``x``'s shape and dtype.

The ``*_autograd`` variants have the same values (they wait inside; their backward is another
call of the same op, in the traced graph). Both ops copy what they send when they are issued,
so a program may change ``x`` before the wait (``P2PPlan.copies_input``). Arguments the op
itself rejects (bad ranks, splits not ``len(src) * len(dst)`` long, an input of the wrong size
along ``dim``) raise :class:`~commfuse.reference.errors.CollectiveMismatchError` naming the
rank and node; a receiver whose expected piece differs in shape from what its sender sent
(ranks disagreeing on ``splits`` or shapes) is reported by the interpreter.

Checked against real gloo ranks by tests/test_boundary_ir.py (cases in
:data:`commfuse.testing.crosscheck.BOUNDARY_CASES`).

Source: Chimera §3 / Table 1 (M2MS, P2P).
"""

from __future__ import annotations

import torch

from commfuse.ops.boundary.ir_view import M2MS_OP, STAGE_TRANSFER_OP, boundary_op_names
from commfuse.ops.boundary.m2ms import parse_m2ms
from commfuse.ops.boundary.stage_transfer import parse_stage_transfer
from commfuse.reference.errors import CollectiveMismatchError
from commfuse.reference.semantics import P2PPlan, RankCall, register_semantics

_TAG = 0  # the ops post every message with c10d's default tag


def _reject(call: RankCall, e: Exception) -> CollectiveMismatchError:
    return CollectiveMismatchError(f"{call.where()}: {e}")


def _parsed(call: RankCall, parse):
    """The op's arguments, checked against the group the interpreter resolved."""
    try:
        p = parse(call.raw_args, call.raw_kwargs)
    except (ValueError, KeyError, IndexError) as e:
        raise _reject(call, e) from e
    if p.group_size != len(call.group):
        raise CollectiveMismatchError(
            f"{call.where()}: the op says group_size {p.group_size} but group "
            f"{call.group_name!r} has {len(call.group)} ranks {list(call.group)}"
        )
    return p


def m2ms(call: RankCall) -> P2PPlan:
    p = _parsed(call, parse_m2ms)
    x: torch.Tensor = p.x
    g, d = call.group_rank, p.dim
    row, col = p.row(g), p.column(g)
    if x.size(d) != sum(row):
        where = f"is src[{p.src.index(g)}] and sends {sum(row)}" if g in p.src else "is not in src (size 0)"
        raise CollectiveMismatchError(
            f"{call.where()}: x has size {x.size(d)} along dim {d}, but group rank {g} {where}"
        )
    xt = x.movedim(d, 0)
    rest = tuple(xt.shape[1:])
    pieces = list(xt.split(list(row), dim=0)) if row else []
    plan = P2PPlan(copies_input=True)
    own = None
    for j, peer in enumerate(p.dst):
        if not row[j]:
            continue
        if peer == g:
            own = pieces[j].clone(memory_format=torch.contiguous_format)
        else:
            plan.sends.append((peer, _TAG, pieces[j].clone(memory_format=torch.contiguous_format)))
    order: list[int] = []  # src index of every received piece, in recvs order
    for i, peer in enumerate(p.src):
        if col[i] and peer != g:
            plan.recvs.append((peer, _TAG, torch.empty((col[i], *rest), dtype=x.dtype, device=x.device)))
            order.append(i)

    def finish(got: list[torch.Tensor]) -> torch.Tensor:
        by_src = dict(zip(order, got, strict=True))
        parts = []
        for i, peer in enumerate(p.src):
            if not col[i]:
                continue
            parts.append(own if peer == g else by_src[i])
        out_t = torch.cat(parts, dim=0) if parts else torch.empty((0, *rest), dtype=x.dtype, device=x.device)
        return out_t.movedim(0, d).contiguous()

    plan.finish = finish
    return plan


def stage_transfer(call: RankCall) -> P2PPlan:
    p = _parsed(call, parse_stage_transfer)
    x: torch.Tensor = p.x
    g = call.group_rank
    plan = P2PPlan(copies_input=True)
    to, frm = p.sends_to(g), p.receives_from(g)
    if to is not None and to != g and x.numel():
        plan.sends.append((to, _TAG, x.clone(memory_format=torch.contiguous_format)))
    receiving = frm is not None and frm != g and x.numel() > 0
    if receiving:
        plan.recvs.append((frm, _TAG, torch.empty(x.shape, dtype=x.dtype, device=x.device)))

    def finish(got: list[torch.Tensor]) -> torch.Tensor:
        if receiving:
            return got[0]
        if frm is not None:  # its own pair (a local copy), or an empty x
            return x.clone(memory_format=torch.contiguous_format)
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)

    plan.finish = finish
    return plan


def register() -> None:
    """Both ops' semantics with the reference interpreter (called by :func:`commfuse.ops.install`)."""
    for op, which in boundary_op_names().items():
        fn = m2ms if which == M2MS_OP else stage_transfer if which == STAGE_TRANSFER_OP else None
        if fn is not None:
            register_semantics(op, fn, p2p=True, replace=True)


__all__ = ["m2ms", "register", "stage_transfer"]
