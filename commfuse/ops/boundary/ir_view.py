"""The IR's view of commfuse's boundary ops: ``commfuse::m2ms`` and ``commfuse::stage_transfer``.

Both ops (:mod:`commfuse.ops`, the contract in docs/boundary-ops.md) move data between
two rank sets ``src`` and ``dst`` (group ranks of one process group G) at the boundary of
two parallel patterns (Chimera Table 1: "M2MS", "P2P"). This module registers them (the
asynchronous ops, waited with ``wait_tensor``, and their autograd variants) with the IR
table (:func:`~commfuse.ir.kinds.register_collective_op`) as kinds
``many_to_many_scatter`` and ``p2p``, and fills the fields of their
:class:`~commfuse.ir.collective.Collective` records that the generic builder cannot know:

* :class:`BoundaryTransfers` (``c.extra["boundary"]``): every message of the op on every
  group rank, ``(from, to, bytes)``, read from the op's arguments (the piece matrix
  ``splits`` of m2ms is the same on every rank), and the group rank this graph is for
  (``position``): this process's rank in G when the group resolves and the graph's shapes
  agree with it, else the first group rank whose row/column sums match the traced shapes
  (a graph traced "as" a peer with ``commfuse.ops.trace_position``), else unknown.
* Per-rank bytes of that rank, excluding its piece to itself (a local copy):
  ``logged_bytes`` = bytes it sends (what its sends log, NCCL count x dtype size: for
  m2ms the bytes of its row of the piece matrix, for stage_transfer the bytes of ``x``
  when it is a source of a pair with another rank); ``wire_bytes`` = bytes it sends too,
  the IR's convention for every kind (``wire`` is what one rank sends, so summing it over
  ranks counts every byte once; Chimera Table 1's "M2MS = BSH", "P2P = BSH" are these
  sent bytes). What it receives is ``c.extra["received_bytes"]``; the cost model prices
  ``max(sent, received)`` per rank (:mod:`commfuse.ops.boundary.cost`).
* ``logical_dim`` / ``logical_concat_dim`` = the m2ms ``dim`` (normalised): pieces are
  cut from and concatenated along it; stage_transfer has none.
* The signature the verifier hashes (``c.extra["signature_shapes"]``) leaves out the
  rank-dependent size along ``dim`` (an m2ms input is the rank's row sum long) and
  includes ``dim``, ``src``, ``dst`` and ``splits`` instead, so the per-group sequence
  hashes of ranks that run the same program agree.

Roles (:mod:`commfuse.ir.roles`): stage_transfer is a pipeline transfer (``pp``); an m2ms between
disjoint rank sets is a stage boundary (``pp``), one with ``src == dst`` is an uneven
all-to-all (``ep``).

Source: "Chimera: Communication Fusion for Hybrid Parallelism in Large Language Models"
(Qin et al., ISCA '25), §3.2, Tables 1-2.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch.fx as fx

from commfuse.core.torch_private import resolve_process_group
from commfuse.ir.collective import Collective
from commfuse.ir.kinds import CollectiveArgs, CollectiveKind, CollectiveOpSpec, register_collective_op
from commfuse.ir.shapes import is_concrete, shape_of, tensor_meta
from commfuse.ir.transfers import M2MS_OP, STAGE_TRANSFER_OP, BoundaryTransfers
from commfuse.ops.boundary.m2ms import M2MS, M2MS_AUTOGRAD, parse_m2ms
from commfuse.ops.boundary.stage_transfer import STAGE_TRANSFER, STAGE_TRANSFER_AUTOGRAD, parse_stage_transfer


# --------------------------------------------------------------------------- argument reading
# The IR table's parse only needs the group (it also runs on the reference interpreter's real
# tensors, where it must not raise on arguments the op would reject: the op's checks report those).
def _arg(a: tuple, k: dict, idx: int, name: str) -> Any:
    return a[idx] if len(a) > idx else k[name]


def _parse_m2ms(a: tuple, k: dict) -> CollectiveArgs:
    # m2ms(x, dim, splits, src, dst, group_size, group_name)
    return CollectiveArgs(
        (_arg(a, k, 0, "x"),), str(_arg(a, k, 6, "group_name")), group_size=int(_arg(a, k, 5, "group_size"))
    )


def _parse_stage_transfer(a: tuple, k: dict) -> CollectiveArgs:
    # stage_transfer(x, src, dst, group_size, group_name)
    return CollectiveArgs(
        (_arg(a, k, 0, "x"),), str(_arg(a, k, 4, "group_name")), group_size=int(_arg(a, k, 3, "group_size"))
    )


def _process_group_rank(group_name: str) -> Optional[int]:
    pg = resolve_process_group(group_name)
    if pg is None:
        return None
    import torch.distributed as dist

    try:
        r = dist.get_rank(pg)
    except (RuntimeError, ValueError):
        return None
    return r if r >= 0 else None


def _position(t: BoundaryTransfers, in_len: Any, out_len: Any) -> tuple[Optional[int], str]:
    """The group rank a graph with input/output sizes ``in_len``/``out_len`` along dim is for."""
    me = _process_group_rank(t.group_name)
    if t.op == STAGE_TRANSFER_OP:  # shapes are the same on every rank: only the process knows
        return (me, "process") if me is not None and me < t.group_size else (None, "unknown")

    def fits(g: int) -> bool:
        ok_in = not is_concrete(in_len) or in_len == t.row_sum(g)
        ok_out = not is_concrete(out_len) or out_len == t.column_sum(g)
        return ok_in and ok_out

    if me is not None and me < t.group_size and fits(me):
        return me, "process"
    cands = [g for g in range(t.group_size) if fits(g)]
    if cands and (is_concrete(in_len) or is_concrete(out_len)):
        return cands[0], "shapes"
    return None, "unknown"


def transfers_of(node: fx.Node) -> Optional[BoundaryTransfers]:
    """The :class:`BoundaryTransfers` of a boundary-op node (None for any other node, or when
    its arguments are ones the op itself rejects)."""
    if node.op != "call_function":
        return None
    which = _OPS.get(node.target)
    if which is None:
        return None

    a, k = tuple(node.args), dict(node.kwargs)
    x = a[0] if a else k.get("x")
    xs, outs = shape_of(x), shape_of(node)
    meta = tensor_meta(x) if tensor_meta(x) is not None else tensor_meta(node)
    itemsize = meta.dtype.itemsize if meta is not None else None
    shape = xs if xs is not None else outs
    try:
        p = parse_m2ms(a, k) if which == M2MS_OP else parse_stage_transfer(a, k)
    except (ValueError, KeyError, IndexError):
        return None
    if which == STAGE_TRANSFER_OP:
        unit = None
        if shape is not None and itemsize is not None:
            unit = itemsize
            for d in shape:
                unit = unit * d
        t = BoundaryTransfers(STAGE_TRANSFER_OP, p.group_name, p.group_size, p.src, p.dst, None, None, unit)
        pos, how = _position(t, None, None)
        return replace(t, position=pos, position_source=how)
    dim = p.dim if p.dim >= 0 or shape is None else p.dim + len(shape)
    unit = None
    if shape is not None and itemsize is not None and 0 <= dim < len(shape):
        unit = itemsize
        for i, d in enumerate(shape):
            if i != dim:
                unit = unit * d
    t = BoundaryTransfers(M2MS_OP, p.group_name, p.group_size, p.src, p.dst, dim, p.splits, unit)
    in_len = xs[dim] if xs is not None and 0 <= dim < len(xs) else None
    out_len = outs[dim] if outs is not None and 0 <= dim < len(outs) else None
    pos, how = _position(t, in_len, out_len)
    return replace(t, position=pos, position_source=how)


# --------------------------------------------------------------------------- the IR record
def refine(c: Collective) -> None:
    """Complete ``c`` (built by the generic IR builder) for a boundary op: see the module docstring."""
    t = transfers_of(c.start)
    if t is None:
        return
    c.extra["boundary"] = t
    c.extra["position"] = t.position
    c.extra["position_source"] = t.position_source
    if t.op == M2MS_OP:
        c.logical_dim = c.logical_concat_dim = t.dim
        other = None
        if c.input_shapes and c.input_shapes[0] is not None and t.dim is not None:
            other = tuple("*" if i == t.dim else str(s) for i, s in enumerate(c.input_shapes[0]))
        c.extra["signature_shapes"] = (M2MS_OP, t.dim, t.src, t.dst, t.splits, other)
    else:
        c.logical_dim = c.logical_concat_dim = None
        c.extra["signature_shapes"] = (STAGE_TRANSFER_OP, t.src, t.dst, tuple(str(s) for s in c.input_shapes))
    if t.position is None or t.unit_bytes is None:
        c.logged_bytes = c.wire_bytes = None
        c.extra["received_bytes"] = None
        return
    sent = t.sent(t.position)
    c.logged_bytes = c.wire_bytes = t.sent_bytes(t.position)
    c.extra["received_bytes"] = t.received_bytes(t.position)
    c.extra["self_bytes"] = t.self_bytes(t.position)
    c.extra["peers_sent"] = [p for p, _b in sent]
    c.extra["peers_received"] = [p for p, _b in t.received(t.position)]
    if t.op == M2MS_OP:  # the per-peer list the collective model's `m2ms_pieces` reads
        c.extra["m2ms_send_bytes"] = [b for _p, b in sent]


# --------------------------------------------------------------------------- registration
_OPS: dict[Any, str] = {}


def boundary_op_names() -> dict[Any, str]:
    """Registered op overload -> "m2ms" | "stage_transfer"."""
    return dict(_OPS)


def register_boundary_op(op: Any, which: str, *, synchronous: bool = False) -> None:
    """Register one overload of a boundary op (``which``: "m2ms" or "stage_transfer") with the IR."""
    if which == M2MS_OP:
        spec = CollectiveOpSpec(CollectiveKind.M2MS, _parse_m2ms, refine=refine, synchronous=synchronous)
    elif which == STAGE_TRANSFER_OP:
        spec = CollectiveOpSpec(
            CollectiveKind.P2P, _parse_stage_transfer, refine=refine, synchronous=synchronous
        )
    else:
        raise ValueError(f"register_boundary_op: which must be 'm2ms' or 'stage_transfer', got {which!r}")
    _OPS[op] = which
    register_collective_op(op, spec)


def register() -> None:
    """The IR's view of both ops, every overload (called by :func:`commfuse.ops.install`)."""
    register_boundary_op(M2MS, M2MS_OP)
    register_boundary_op(M2MS_AUTOGRAD, M2MS_OP, synchronous=True)
    register_boundary_op(STAGE_TRANSFER, STAGE_TRANSFER_OP)
    register_boundary_op(STAGE_TRANSFER_AUTOGRAD, STAGE_TRANSFER_OP, synchronous=True)


__all__ = [
    "M2MS_OP",
    "STAGE_TRANSFER_OP",
    "BoundaryTransfers",
    "boundary_op_names",
    "register",
    "register_boundary_op",
    "transfers_of",
]
