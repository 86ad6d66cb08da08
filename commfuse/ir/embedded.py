"""Ops that communicate inside themselves: what they send, for reports and costs.

Some graph ops issue collectives from their kernel instead of through functional
collectives (commfuse's MoE layer exchanges tokens with all_to_alls; see
:mod:`commfuse.ops.moe_layer.op`). They have no wait node and the passes never split or
reorder their communication, so they are not :class:`~.collective.Collective` s;
but their bytes must show in ``analyze``, the volume derivations and the cost
model. An op registers a function that returns its transfers from the node's
arguments (shapes from ``meta["val"]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch.fx as fx

from commfuse.ir.kinds import CollectiveKind


@dataclass(frozen=True)
class EmbeddedTransfer:
    """One collective an op issues: per-rank bytes as for a functional collective."""

    kind: CollectiveKind
    group: str
    group_size: int
    logged_bytes: int  # NCCL count semantics: the bytes of the buffer handed to the call
    wire_bytes: int  # bytes this rank sends, ring conventions
    what: str  # e.g. "dispatch", "combine"
    estimated: bool = False  # data-dependent size, estimated (e.g. balanced routing)


@dataclass
class EmbeddedComm:
    node: fx.Node
    transfers: list[EmbeddedTransfer]


_EMBEDDED: dict[Any, Callable[[fx.Node], list[EmbeddedTransfer]]] = {}


def register_embedded_comm(op: Any, transfers: Callable[[fx.Node], list[EmbeddedTransfer]]) -> None:
    _EMBEDDED[op] = transfers


def embedded_comm(node: fx.Node) -> EmbeddedComm | None:
    fn = _EMBEDDED.get(node.target) if node.op == "call_function" else None
    if fn is None:
        return None
    return EmbeddedComm(node, fn(node))
