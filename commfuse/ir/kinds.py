"""Collective kinds and the table that maps graph ops to them.

The table is open: commfuse's own collective ops (e.g. the many-to-many scatter
of Chimera) register themselves with :func:`register_collective_op`, and the IR,
verifier, reports and interpreter then treat them like the built-in kinds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from commfuse.core.torch_private import c10d_functional, c10d_functional_autograd, functional_overload


class CollectiveKind(str, enum.Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND = "send"
    RECV = "recv"
    BATCH_P2P = "batch_p2p"
    # commfuse's own kinds (registered by later passes; listed so reports have a stable vocabulary)
    M2MS = "many_to_many_scatter"
    # rooted reduce (commfuse::reduce_to_root, commfuse/ops/reduce_to_root/op.py): Centauri's
    # "reduces of distinct roots" substitute of reduce_scatter
    REDUCE = "reduce"
    # point-to-point stage transfer (commfuse::stage_transfer, commfuse/ops): pairs src[i] -> dst[i]
    # of one group, Chimera Table 1's "P2P" (a pipeline boundary); M2MS above is commfuse::m2ms.
    # Both are registered by commfuse/ops/boundary/ir_view.py.
    P2P = "p2p"


@dataclass(frozen=True)
class CollectiveArgs:
    """Arguments of one collective call, normalised across op schemas."""

    inputs: tuple[Any, ...]  # fx nodes (or lists of them for coalesced ops)
    group_name: str
    group_size: int | None = None
    reduce_op: str | None = None
    src_or_dst: int | None = None  # broadcast root / p2p peer (group rank)
    output_split_sizes: Any = None
    input_split_sizes: Any = None


@dataclass(frozen=True)
class CollectiveOpSpec:
    """How to read one collective op overload."""

    kind: CollectiveKind
    parse: Callable[[tuple, dict], CollectiveArgs]
    coalesced: bool = False  # returns a list of tensors, each waited separately
    inplace: bool = False  # mutates its input (all_reduce_, broadcast_)
    # Op-specific completion of the IR record after the generic builder (rank-dependent shapes
    # and bytes, logical dims, the hashed signature): commfuse's boundary ops (ops/boundary/ir_view.py).
    refine: Optional[Callable[[Any], None]] = None
    # Completes inside its kernel (issues and waits): no wait_tensor follows; the op's value is
    # the result (autograd variants of commfuse's boundary ops, like moe_layer's exchanges).
    synchronous: bool = False


def _kw(args: tuple, kwargs: dict, idx: int, name: str) -> Any:
    return args[idx] if len(args) > idx else kwargs[name]


def _group_name(g: Any) -> str:
    # 2.13 schemas type group_name as Any: it is normally a str, but a ProcessGroup
    # object can reach the graph through custom ops.
    if isinstance(g, str):
        return g
    name = getattr(g, "group_name", None)
    return str(name) if name is not None else str(g)


def _p_all_reduce(a: tuple, k: dict) -> CollectiveArgs:
    return CollectiveArgs(
        (a[0],), _group_name(_kw(a, k, 2, "group_name")), reduce_op=_kw(a, k, 1, "reduce_op")
    )


def _p_all_gather(a: tuple, k: dict) -> CollectiveArgs:
    return CollectiveArgs(
        (a[0],), _group_name(_kw(a, k, 2, "group_name")), group_size=_kw(a, k, 1, "group_size")
    )


def _p_reduce_scatter(a: tuple, k: dict) -> CollectiveArgs:
    return CollectiveArgs(
        (a[0],),
        _group_name(_kw(a, k, 3, "group_name")),
        group_size=_kw(a, k, 2, "group_size"),
        reduce_op=_kw(a, k, 1, "reduce_op"),
    )


def _p_all_to_all(a: tuple, k: dict) -> CollectiveArgs:
    return CollectiveArgs(
        (a[0],),
        _group_name(_kw(a, k, 3, "group_name")),
        output_split_sizes=_kw(a, k, 1, "output_split_sizes"),
        input_split_sizes=_kw(a, k, 2, "input_split_sizes"),
    )


def _p_broadcast(a: tuple, k: dict) -> CollectiveArgs:
    return CollectiveArgs((a[0],), _group_name(_kw(a, k, 2, "group_name")), src_or_dst=_kw(a, k, 1, "src"))


def _p_p2p(a: tuple, k: dict) -> CollectiveArgs:
    return CollectiveArgs(
        (a[0],), _group_name(_kw(a, k, 3, "group_name")), src_or_dst=a[1] if len(a) > 1 else None
    )


def _p_batch_p2p(a: tuple, k: dict) -> CollectiveArgs:
    return CollectiveArgs((tuple(_kw(a, k, 3, "tensors")),), _group_name(_kw(a, k, 4, "group_name")))


def _coalesced(parse: Callable[[tuple, dict], CollectiveArgs]) -> Callable[[tuple, dict], CollectiveArgs]:
    def _parse(a: tuple, k: dict) -> CollectiveArgs:
        args = parse(a, k)
        return CollectiveArgs(
            (tuple(args.inputs[0]),),
            args.group_name,
            args.group_size,
            args.reduce_op,
            args.src_or_dst,
        )

    return _parse


_REGISTRY: dict[Any, CollectiveOpSpec] = {}
WAIT_OPS: set[Any] = {c10d_functional.wait_tensor.default}


def register_collective_op(op: Any, spec: CollectiveOpSpec) -> None:
    """Register an op overload (or packet: all overloads) as a collective."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        for name in op.overloads():
            _REGISTRY[getattr(op, name)] = spec
    else:
        _REGISTRY[op] = spec


def collective_spec(target: Any) -> CollectiveOpSpec | None:
    return _REGISTRY.get(target)


def is_wait(target: Any) -> bool:
    return target in WAIT_OPS


def _register_builtin() -> None:
    f, fa = c10d_functional, c10d_functional_autograd
    K = CollectiveKind
    table = [
        (f, "all_reduce", CollectiveOpSpec(K.ALL_REDUCE, _p_all_reduce)),
        (f, "all_reduce_", CollectiveOpSpec(K.ALL_REDUCE, _p_all_reduce, inplace=True)),
        (
            f,
            "all_reduce_coalesced",
            CollectiveOpSpec(K.ALL_REDUCE, _coalesced(_p_all_reduce), coalesced=True),
        ),
        (
            f,
            "all_reduce_coalesced_",
            CollectiveOpSpec(K.ALL_REDUCE, _coalesced(_p_all_reduce), coalesced=True, inplace=True),
        ),
        (f, "all_gather_into_tensor", CollectiveOpSpec(K.ALL_GATHER, _p_all_gather)),
        (fa, "all_gather_into_tensor", CollectiveOpSpec(K.ALL_GATHER, _p_all_gather)),
        (
            f,
            "all_gather_into_tensor_coalesced",
            CollectiveOpSpec(K.ALL_GATHER, _coalesced(_p_all_gather), coalesced=True),
        ),
        # `_out` variants (Inductor's bucketing emits them) write into a given buffer: in-place semantics.
        (f, "all_gather_into_tensor_out", CollectiveOpSpec(K.ALL_GATHER, _p_all_gather, inplace=True)),
        (f, "reduce_scatter_tensor_out", CollectiveOpSpec(K.REDUCE_SCATTER, _p_reduce_scatter, inplace=True)),
        (f, "reduce_scatter_tensor", CollectiveOpSpec(K.REDUCE_SCATTER, _p_reduce_scatter)),
        (fa, "reduce_scatter_tensor", CollectiveOpSpec(K.REDUCE_SCATTER, _p_reduce_scatter)),
        (
            f,
            "reduce_scatter_tensor_coalesced",
            CollectiveOpSpec(K.REDUCE_SCATTER, _coalesced(_p_reduce_scatter), coalesced=True),
        ),
        (f, "all_to_all_single", CollectiveOpSpec(K.ALL_TO_ALL, _p_all_to_all)),
        (fa, "all_to_all_single", CollectiveOpSpec(K.ALL_TO_ALL, _p_all_to_all)),
        (f, "broadcast", CollectiveOpSpec(K.BROADCAST, _p_broadcast)),
        (f, "broadcast_", CollectiveOpSpec(K.BROADCAST, _p_broadcast, inplace=True)),
        (f, "isend", CollectiveOpSpec(K.SEND, _p_p2p)),
        (f, "irecv", CollectiveOpSpec(K.RECV, _p_p2p)),
        (f, "batch_p2p_ops", CollectiveOpSpec(K.BATCH_P2P, _p_batch_p2p, coalesced=True)),
    ]
    for namespace, name, spec in table:
        op = functional_overload(namespace, name)
        if op is not None:  # an op this torch release lacks never appears in its graphs
            register_collective_op(op, spec)


_register_builtin()
