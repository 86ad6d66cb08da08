"""What every collective computes, from all ranks' values: the registry and the built-in kinds.

Two styles of semantics:

* **group** semantics (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast,
  commfuse's own kinds, e.g. the rooted reduce): a function ``fn(calls) -> results`` that receives one
  :class:`RankCall` per member of the group, in group-rank order, once every member
  has reached the collective, and returns one result per member (same order). A
  result is what the op returns on that rank: a tensor, or a list of tensors for a
  coalesced op.
* **group-synchronous ops** (:func:`register_sync_op`): compute ops that communicate inside
  their kernel, synchronously, on the group their arguments name (``commfuse::moe_layer``
  and its backward, :mod:`commfuse.ops.moe_layer.semantics`): group semantics like a collective's, but the
  results are the op's return value (no wait).
* **p2p** semantics (isend, irecv, batch_p2p_ops): a function ``fn(call) -> P2PPlan``
  saying what one rank sends (peer, tag, tensor) and receives (peer, tag, buffer),
  and how the op's result is made from the received tensors. The interpreter
  matches sends and receives by (group, source, destination, tag), in order.

Coalesced ops are handled by the built-in functions (one independent collective per
list element); in-place ops (``all_reduce_``, ``broadcast_``, ``all_reduce_coalesced_``)
by the interpreter: it copies the result into the input buffer(s) and returns them,
so later readers of the buffer see the result. A semantic function must return
fresh tensors (never one rank's input, never a tensor shared between ranks).

Reductions are computed in the tensor's dtype, in group-rank order
(``((x0 + x1) + x2) + ...``), one rounding per step like a chain of hops; ``avg`` is
that sum divided by the group size; ``max``/``min`` of ``+0.0`` and ``-0.0`` follow IEEE
754-2019 (``+0 > -0``), not the kernel path torch happens to take. The order is canonical, so rewrites that only
regroup a reduction (all_reduce → reduce_scatter + all_gather, bucketing) give
bitwise-identical results on the reference.

Peers (``isend`` dst, ``irecv`` src, ``batch_p2p_ops`` peers) and the broadcast root
are *group* ranks, as the ``_c10d_functional`` ops interpret them (checked against
gloo in tests/test_reference.py).

Register semantics for a new collective kind with :func:`register_semantics` (by
kind, or by op overload for an op-specific override) after registering the op with
:func:`commfuse.ir.register_collective_op`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch
import torch.fx as fx

from commfuse.ir.kinds import CollectiveArgs, CollectiveKind, CollectiveOpSpec
from commfuse.reference.errors import CollectiveMismatchError, UnknownCollectiveError


@dataclass
class RankCall:
    """One rank's call of a collective, with its argument values (tensors in place of nodes)."""

    rank: int  # global rank
    group_rank: int  # position in the group
    group: tuple[int, ...]  # the group's global ranks, in group-rank order
    group_name: str
    args: CollectiveArgs  # parsed by the op's CollectiveOpSpec; `inputs` hold tensors
    raw_args: tuple  # the op's positional argument values
    raw_kwargs: dict
    spec: CollectiveOpSpec | None  # None for group-synchronous ops (register_sync_op)
    node: fx.Node  # this rank's node
    target: Any = None  # the op (as compiled; the node may have been rewritten since)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The input tensors, flattened (one for plain ops, the list for coalesced ones)."""
        out: list[torch.Tensor] = []
        for x in self.args.inputs:
            if isinstance(x, (list, tuple)):
                out.extend(x)
            else:
                out.append(x)
        return out

    def where(self) -> str:
        return f"rank {self.rank} node {self.node.name} ({_op_name(self.target)})"


@dataclass
class P2PPlan:
    """What one rank's point-to-point op sends and receives. Peers are group ranks."""

    sends: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # (peer, tag, tensor)
    recvs: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # (peer, tag, buffer)
    # received tensors (in `recvs` order, already copied into their buffers) -> the op's result
    finish: Callable[[list[torch.Tensor]], Any] = lambda got: None
    # The op copies what it sends when it is issued (commfuse's boundary ops), so changing its
    # input before the wait is no race: the interpreter does not watch it.
    copies_input: bool = False


GroupSemantics = Callable[[list[RankCall]], list[Any]]
P2PSemantics = Callable[[RankCall], P2PPlan]


@dataclass(frozen=True)
class Semantics:
    fn: Union[GroupSemantics, P2PSemantics]
    p2p: bool = False
    name: str = ""


_BY_KIND: dict[CollectiveKind, Semantics] = {}
_BY_OP: dict[Any, Semantics] = {}


@dataclass(frozen=True)
class SyncOpSpec:
    """A *group-synchronous op*: a compute op whose kernel communicates on the group its
    arguments name, synchronously (e.g. ``commfuse::moe_layer``, whose all_to_alls run inside
    the op). It returns its results directly (no wait). ``parse(args, kwargs)`` gives the
    group name (and the input tensors); ``fn`` is group semantics (``fn(calls) -> results``,
    one :class:`RankCall` per member, in group-rank order). A group name in ``local_names``
    means "no group": the op is computed on the calling rank alone (``fn`` with one call).
    ``replicated``: positional argument indices every member must pass equal (e.g. the MoE
    router weight); :func:`commfuse.testing.equivalence.random_inputs` makes the graph
    inputs they come from the same on every rank."""

    parse: Callable[[tuple, dict], CollectiveArgs]
    fn: GroupSemantics
    local_names: frozenset = frozenset({""})
    name: str = ""
    replicated: tuple[int, ...] = ()


_SYNC_OPS: dict[Any, SyncOpSpec] = {}


def register_sync_op(
    op: Any,
    parse: Callable[[tuple, dict], CollectiveArgs],
    fn: GroupSemantics,
    *,
    local_names: frozenset | set = frozenset({""}),
    replicated: tuple[int, ...] = (),
    replace: bool = False,
) -> None:
    """Register the reference semantics of a group-synchronous op (see :class:`SyncOpSpec`).

    The interpreter then runs ``op`` like a collective: every member of the group named by
    ``parse(args, kwargs).group_name`` must reach it (in the same order relative to the
    group's collectives), and ``fn`` computes every member's results from all members'
    arguments. This registration wins over a collective-table entry for the same op."""
    if op in _SYNC_OPS and not replace:
        raise ValueError(f"reference semantics for {_op_name(op)} are already registered; pass replace=True")
    _SYNC_OPS[op] = SyncOpSpec(
        parse, fn, frozenset(local_names), getattr(fn, "__name__", repr(fn)), tuple(replicated)
    )


def unregister_sync_op(op: Any) -> None:
    _SYNC_OPS.pop(op, None)


def sync_op_spec(target: Any) -> SyncOpSpec | None:
    return _SYNC_OPS.get(target) if _SYNC_OPS else None


def register_semantics(kind_or_op: Any, fn: Callable, *, p2p: bool = False, replace: bool = False) -> None:
    """Register the reference semantics of a collective kind (or of one op overload).

    ``fn`` is a group function ``fn(calls: list[RankCall]) -> list[result]`` or, with
    ``p2p=True``, ``fn(call: RankCall) -> P2PPlan``. An op-specific registration wins
    over the kind's. Re-registering raises unless ``replace=True``.
    """
    table: dict = _BY_KIND if isinstance(kind_or_op, CollectiveKind) else _BY_OP
    if kind_or_op in table and not replace:
        raise ValueError(
            f"reference semantics for {_op_name(kind_or_op)} are already registered "
            f"({table[kind_or_op].name}); pass replace=True to override"
        )
    table[kind_or_op] = Semantics(fn, p2p=p2p, name=getattr(fn, "__name__", repr(fn)))


def unregister_semantics(kind_or_op: Any) -> None:
    (_BY_KIND if isinstance(kind_or_op, CollectiveKind) else _BY_OP).pop(kind_or_op, None)


def semantics_for(target: Any, spec: CollectiveOpSpec) -> Semantics:
    sem = _BY_OP.get(target) or _BY_KIND.get(spec.kind)
    if sem is None:
        raise UnknownCollectiveError(
            f"collective op {_op_name(target)} (kind {spec.kind.value!r}) has no reference semantics; "
            f"register them with commfuse.reference.register_semantics({spec.kind}, fn)"
        )
    return sem


def registered_kinds() -> set[CollectiveKind]:
    return set(_BY_KIND)


def _op_name(target: Any) -> str:
    if isinstance(target, CollectiveKind):
        return f"kind {target.value!r}"
    name = getattr(target, "name", None)
    if callable(name):
        try:
            return str(name())
        except Exception:  # noqa: BLE001
            pass
    return str(getattr(target, "__name__", target))


# ---------------------------------------------------------------------------
# Helpers for the built-in semantics
# ---------------------------------------------------------------------------


def _mismatch(calls: list[RankCall], what: str) -> CollectiveMismatchError:
    c0 = calls[0]
    ops = "; ".join(c.where() for c in calls)
    return CollectiveMismatchError(
        f"{_op_name(c0.target)} on group {c0.group_name!r} (ranks {list(c0.group)}): {what} [{ops}]"
    )


def _check_group_size(calls: list[RankCall]) -> None:
    n = len(calls[0].group)
    for c in calls:
        gs = c.args.group_size
        if gs is not None and int(gs) != n:
            raise CollectiveMismatchError(
                f"{c.where()}: the op says group_size {gs} but group {c.group_name!r} has {n} ranks "
                f"{list(c.group)} (wrong group mapping passed to the reference interpreter?)"
            )


def _check_same(calls: list[RankCall], attr: str) -> Any:
    vals = [getattr(c.args, attr) for c in calls]
    if any(v != vals[0] for v in vals[1:]):
        raise _mismatch(calls, f"{attr} differs between ranks: {vals}")
    return vals[0]


def _per_tensor(calls: list[RankCall]) -> list[list[torch.Tensor]]:
    """[tensor index][group rank] -> tensor, checking every rank passes the same number."""
    lists = [c.tensors for c in calls]
    if any(len(lst) != len(lists[0]) for lst in lists):
        raise _mismatch(calls, f"ranks pass different numbers of tensors: {[len(x) for x in lists]}")
    return [[lst[i] for lst in lists] for i in range(len(lists[0]))]


def _check_meta(calls: list[RankCall], tensors: list[torch.Tensor], *, shapes: bool = True) -> None:
    t0 = tensors[0]
    for t in tensors[1:]:
        if t.dtype != t0.dtype or (shapes and t.shape != t0.shape):
            desc = [f"{tuple(x.shape)}/{x.dtype}" for x in tensors]
            raise _mismatch(calls, f"input shapes/dtypes differ between ranks: {desc}")


def _pack(calls: list[RankCall], per_tensor_results: list[list[torch.Tensor]]) -> list[Any]:
    """[tensor index][group rank] -> per rank: a tensor (plain op) or a list (coalesced op)."""
    n = len(calls)
    if calls[0].spec.coalesced:
        return [[res[g] for res in per_tensor_results] for g in range(n)]
    (only,) = per_tensor_results
    return list(only)


def reduce_tensors(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    """Reduce equally shaped tensors in list order, in their dtype: the canonical reference order."""
    op = str(op).lower()
    acc = tensors[0].clone(memory_format=torch.contiguous_format)
    rest = tensors[1:]
    if op in ("sum", "avg"):
        for t in rest:
            acc.add_(t)
        if op == "avg":
            if not (acc.is_floating_point() or acc.is_complex()):
                raise CollectiveMismatchError(f"reduce op 'avg' on integer dtype {acc.dtype}")
            acc.div_(len(tensors))
    elif op == "product":
        for t in rest:
            acc.mul_(t)
    elif op == "max":
        for t in rest:
            acc = _ieee_extremum(acc, t, largest=True)
    elif op == "min":
        for t in rest:
            acc = _ieee_extremum(acc, t, largest=False)
    elif op in ("band", "bor", "bxor"):
        f = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
        for t in rest:
            acc = f(acc, t)
    else:
        raise UnknownCollectiveError(
            f"reduce op {op!r} has no reference semantics "
            f"(known: sum, avg, product, max, min, band, bor, bxor)"
        )
    return acc


def _ieee_extremum(a: torch.Tensor, b: torch.Tensor, *, largest: bool) -> torch.Tensor:
    """``torch.maximum`` / ``torch.minimum`` with the sign of a zero result fixed.

    For ``+0.0`` against ``-0.0`` (equal values) torch returns either operand depending on the
    kernel path, i.e. on the memory layout and the element's position (vectorised body or
    scalar tail): a rewrite that only re-slices a max-reduction would change the sign of zeros.
    The reference takes IEEE 754-2019 ``maximum``/``minimum``: ``+0 > -0``. For two zeros
    ``a + b`` is exactly that maximum (``+0 + -0 = +0``), ``-((-a) + (-b))`` that minimum."""
    m = torch.maximum(a, b) if largest else torch.minimum(a, b)
    if not m.is_floating_point():
        return m
    zeros = (a == 0) & (b == 0)
    if not bool(zeros.any()):
        return m
    z = a + b if largest else -((-a) + (-b))
    return torch.where(zeros, z, m)


def _fresh(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """n independent copies (results of different ranks must not alias)."""
    return [t] + [t.clone() for _ in range(n - 1)]


# ---------------------------------------------------------------------------
# Built-in group semantics
# ---------------------------------------------------------------------------


def all_reduce(calls: list[RankCall]) -> list[Any]:
    op = _check_same(calls, "reduce_op")
    out = []
    for tensors in _per_tensor(calls):
        _check_meta(calls, tensors)
        out.append(_fresh(reduce_tensors(tensors, op), len(calls)))
    return _pack(calls, out)


def all_gather(calls: list[RankCall]) -> list[Any]:
    _check_group_size(calls)
    out = []
    for tensors in _per_tensor(calls):
        _check_meta(calls, tensors)
        parts = [t.reshape(1) if t.dim() == 0 else t for t in tensors]
        out.append(_fresh(torch.cat(parts, dim=0), len(calls)))
    return _pack(calls, out)


def reduce_scatter(calls: list[RankCall]) -> list[Any]:
    _check_group_size(calls)
    op = _check_same(calls, "reduce_op")
    n = len(calls)
    out = []
    for tensors in _per_tensor(calls):
        _check_meta(calls, tensors)
        t0 = tensors[0]
        if t0.dim() == 0 or t0.shape[0] % n:
            raise _mismatch(
                calls, f"dim 0 of input shape {tuple(t0.shape)} is not divisible by the group size {n}"
            )
        red = reduce_tensors(tensors, op)
        out.append([c.clone() for c in red.chunk(n, dim=0)])
    return _pack(calls, out)


def all_to_all(calls: list[RankCall]) -> list[Any]:
    n = len(calls)
    ins = [c.tensors[0] for c in calls]
    _check_meta(calls, ins, shapes=False)
    in_splits, out_splits = [], []
    for c, t in zip(calls, ins, strict=True):
        isz, osz = c.args.input_split_sizes, c.args.output_split_sizes
        if (isz is None) != (osz is None):
            raise _mismatch(calls, f"{c.where()} gives only one of input/output split sizes")
        if isz is None or len(isz) == 0:
            if t.shape[0] % n:
                raise _mismatch(calls, f"dim 0 of {tuple(t.shape)} on rank {c.rank} is not divisible by {n}")
            isz = osz = [t.shape[0] // n] * n
        isz, osz = [int(s) for s in isz], [int(s) for s in osz]
        if len(isz) != n or len(osz) != n:
            raise _mismatch(calls, f"{c.where()} gives {len(isz)}/{len(osz)} split sizes for a group of {n}")
        if sum(isz) != t.shape[0]:
            raise _mismatch(
                calls, f"{c.where()}: input split sizes {isz} do not sum to dim 0 of {tuple(t.shape)}"
            )
        in_splits.append(isz)
        out_splits.append(osz)
    for g in range(n):
        for j in range(n):
            if in_splits[j][g] != out_splits[g][j]:
                raise _mismatch(
                    calls,
                    f"rank {calls[j].rank} sends {in_splits[j][g]} rows to rank {calls[g].rank}, "
                    f"which expects {out_splits[g][j]} (input splits {in_splits}, output splits "
                    f"{out_splits})",
                )
    pieces = [list(t.split(s, dim=0)) for t, s in zip(ins, in_splits, strict=True)]
    return [torch.cat([pieces[j][g] for j in range(n)], dim=0) for g in range(n)]


def broadcast(calls: list[RankCall]) -> list[Any]:
    src = _check_same(calls, "src_or_dst")
    n = len(calls)
    if src is None or not 0 <= int(src) < n:
        raise _mismatch(calls, f"broadcast root {src} is not a group rank of a group of {n}")
    out = []
    for tensors in _per_tensor(calls):
        _check_meta(calls, tensors)
        out.append(_fresh(tensors[int(src)].clone(), n))
    return _pack(calls, out)


def reduce(calls: list[RankCall]) -> list[Any]:
    """Rooted reduce (``commfuse::reduce_to_root``): the root gets the reduction in canonical
    order; every other member gets ``-0.0`` (the exact additive identity, integers 0), as the
    op's kernel returns (commfuse/ops/reduce_to_root/op.py)."""
    _check_group_size(calls)
    op = _check_same(calls, "reduce_op")
    root = _check_same(calls, "src_or_dst")
    n = len(calls)
    if root is None or not 0 <= int(root) < n:
        raise _mismatch(calls, f"reduce root {root} is not a group rank of a group of {n}")
    out = []
    for tensors in _per_tensor(calls):
        _check_meta(calls, tensors)
        red = reduce_tensors(tensors, op)
        out.append([red if g == int(root) else torch.full_like(red, -0.0) for g in range(n)])
    return _pack(calls, out)


# ---------------------------------------------------------------------------
# Built-in p2p semantics (peers are group ranks)
# ---------------------------------------------------------------------------


def _empty_like_sent(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype, device=t.device)


def send(call: RankCall) -> P2PPlan:
    tensor, peer, tag = call.raw_args[0], call.raw_args[1], _tag(call, 2)
    return P2PPlan(sends=[(int(peer), tag, tensor.clone())], finish=lambda got: _empty_like_sent(tensor))


def recv(call: RankCall) -> P2PPlan:
    buf, peer, tag = call.raw_args[0], call.raw_args[1], _tag(call, 2)
    return P2PPlan(recvs=[(int(peer), tag, buf)], finish=lambda got: got[0])


def batch_p2p(call: RankCall) -> P2PPlan:
    a, k = call.raw_args, call.raw_kwargs
    ops = a[0] if len(a) > 0 else k["op_list"]
    peers = a[1] if len(a) > 1 else k["peer_list"]
    tags = a[2] if len(a) > 2 else k["tag_list"]
    tensors = a[3] if len(a) > 3 else k["tensors"]
    if not len(ops) == len(peers) == len(tags) == len(tensors):
        raise CollectiveMismatchError(f"{call.where()}: op/peer/tag/tensor lists have different lengths")
    plan = P2PPlan()
    kinds = []
    for op, peer, tag, t in zip(ops, peers, tags, tensors, strict=True):
        if op == "isend":
            plan.sends.append((int(peer), int(tag), t.clone()))
        elif op == "irecv":
            plan.recvs.append((int(peer), int(tag), t))
        else:
            raise UnknownCollectiveError(
                f"{call.where()}: batch_p2p_ops op {op!r} (expected 'isend' or 'irecv')"
            )
        kinds.append(op)

    def finish(got: list[torch.Tensor]) -> list[torch.Tensor]:
        it = iter(got)
        return [
            next(it) if op == "irecv" else _empty_like_sent(t) for op, t in zip(kinds, tensors, strict=True)
        ]

    plan.finish = finish
    return plan


def _tag(call: RankCall, idx: int) -> int:
    a, k = call.raw_args, call.raw_kwargs
    return int(a[idx]) if len(a) > idx else int(k.get("tag", 0))


def _register_builtin() -> None:
    K = CollectiveKind
    register_semantics(K.ALL_REDUCE, all_reduce, replace=True)
    register_semantics(K.ALL_GATHER, all_gather, replace=True)
    register_semantics(K.REDUCE_SCATTER, reduce_scatter, replace=True)
    register_semantics(K.ALL_TO_ALL, all_to_all, replace=True)
    register_semantics(K.BROADCAST, broadcast, replace=True)
    register_semantics(K.REDUCE, reduce, replace=True)
    register_semantics(K.SEND, send, p2p=True, replace=True)
    register_semantics(K.RECV, recv, p2p=True, replace=True)
    register_semantics(K.BATCH_P2P, batch_p2p, p2p=True, replace=True)


_register_builtin()
