"""Parallel role of a collective: given by the user, from a DeviceMesh, or inferred.

Inference is a best effort from graph structure alone (every rank sees the same
graph, so every rank infers the same role). Rules, first match wins:

* all_to_all -> EP; send/recv/batch_p2p -> PP
* commfuse's boundary ops (ops/boundary/ir_view.py): stage_transfer (p2p) -> PP; m2ms between disjoint
  rank sets (a stage boundary) -> PP, m2ms with src == dst (an uneven all-to-all) -> EP
* all_gather / reduce_scatter along a non-zero logical dim (sequence) -> SP
* all_gather whose input is a graph input (a parameter shard) -> FSDP
* reduce_scatter / all_reduce whose input depends on a tangent (backward region) and whose
  result flows through views/scaling to a graph output (a parameter gradient) -> FSDP / DP
* all_reduce of an activation -> TP
"""

from __future__ import annotations

import torch.fx as fx

from commfuse.ir.collective import Collective, ParallelRole
from commfuse.ir.kinds import CollectiveKind

_VIEWISH = {
    "view",
    "reshape",
    "_unsafe_view",
    "t",
    "permute",
    "transpose",
    "detach",
    "alias",
    "clone",
    "squeeze",
    "unsqueeze",
}


def _strip_views(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in _VIEWISH:
        src = node.args[0]
        if not isinstance(src, fx.Node):
            break
        node = src
    return node


def _feeds_output(node: fx.Node, depth: int = 4) -> bool:
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u.op == "output":
                    return True
                if u.op == "call_function" and getattr(u.target, "__name__", "").split(".")[0] in _VIEWISH | {
                    "wait_tensor",
                    "div",
                    "mul",
                    "add",
                }:
                    nxt.append(u)
        frontier = nxt
    return False


def infer_role(c: Collective, *, in_backward: bool) -> ParallelRole:
    """`in_backward`: the collective's input depends on a tangent (gradient) input."""
    K = CollectiveKind
    if c.kind is K.ALL_TO_ALL:
        return ParallelRole.EP
    if c.kind in (K.SEND, K.RECV, K.BATCH_P2P, K.P2P):
        return ParallelRole.PP
    if c.kind is K.M2MS:
        t = c.extra.get("boundary")
        if t is None:
            return ParallelRole.UNKNOWN
        if not set(t.src) & set(t.dst):
            return ParallelRole.PP
        return ParallelRole.EP if sorted(t.src) == sorted(t.dst) else ParallelRole.UNKNOWN
    # A sequence-dim gather/scatter is SP in forward and backward alike; checked first
    # because SP's backward collectives also sit in the gradient region.
    if c.kind in (K.ALL_GATHER, K.REDUCE_SCATTER) and (c.logical_dim or 0) != 0:
        return ParallelRole.SP
    src = c.logical_input or (c.inputs[0] if c.inputs else None)
    if c.kind is K.ALL_GATHER and isinstance(src, fx.Node) and _strip_views(src).op == "placeholder":
        return ParallelRole.FSDP
    out = c.waits[0] if c.waits else c.start
    if in_backward and c.kind in (K.REDUCE_SCATTER, K.ALL_REDUCE) and _feeds_output(out):
        return ParallelRole.FSDP if c.kind is K.REDUCE_SCATTER else ParallelRole.DP
    if c.kind is K.ALL_REDUCE:
        return ParallelRole.TP
    return ParallelRole.UNKNOWN
