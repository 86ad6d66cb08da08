"""Replication analysis: which values of a pipeline forward graph are the same on every rank of a stage.

:func:`replicated_values` proves a value replicated over a stage group (outputs of full
collectives and of Megatron's f/g on that group, declared graph inputs, transfers of values
replicated on the sending stage, and deterministic functions of those). Rule ar_p2p needs its
residual operands proven replicated over the sending stage.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from commfuse.analysis.boundary.layout import BoundaryMap
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.ir.kinds import CollectiveKind, collective_spec, is_wait
from commfuse.ops import STAGE_TRANSFER_AUTOGRAD, parse_stage_transfer
from commfuse.pipeline.collectives import COPY_TO_GROUP, REDUCE_FROM_GROUP

K = CollectiveKind


def replicated_values(
    gm: fx.GraphModule, group: str, ir: CollectiveIR, bmap: BoundaryMap, replicated_placeholders: set
) -> set:
    """Values proven identical on every rank of stage group ``group``: outputs of all_reduce /
    all_gather / broadcast and of commfuse.pipeline's ``reduce_from_group`` / ``copy_to_group``
    (Megatron's g and f: f marks a value every member holds) on that group, declared graph
    inputs, transfers of a value replicated on the sending stage, and deterministic
    functions of those (no random or mutating op, no other collective)."""

    full = (K.ALL_REDUCE, K.ALL_GATHER, K.BROADCAST)
    rep: set = set()
    for c in ir.collectives:
        if c.kind in full and not c.coalesced and c.group.name == group:
            rep.update(c.waits)
            if c.logical_output is not None:
                rep.add(c.logical_output)
    transfers_into: dict[fx.Node, tuple[str, str]] = {}  # transfer -> (sending, receiving stage group)
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is STAGE_TRANSFER_AUTOGRAD:
            a = parse_stage_transfer(n)
            bd = bmap.boundaries.get(a.group_name)
            if bd is not None and a.src == bd.a.boundary_ranks and a.dst == bd.b.boundary_ranks:
                transfers_into[n] = (bd.a.group, bd.b.group)
    # a transfer of a value replicated on the sending stage is replicated on the receiving one
    # (positions pair up): the sending stage's own set decides
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if n in replicated_placeholders:
                rep.add(n)
            continue
        if n.op == "get_attr":
            rep.add(n)
            continue
        if n.op != "call_function" or n in rep:
            continue
        t = n.target
        if t in (COPY_TO_GROUP, REDUCE_FROM_GROUP):
            if len(n.args) >= 3 and n.args[2] == group:
                rep.add(n)
            continue
        if n in transfers_into:
            src_group, dst_group = transfers_into[n]
            if dst_group == group and src_group != group:
                inner = replicated_values(gm, src_group, ir, bmap, replicated_placeholders)
                if n.args[0] in inner:
                    rep.add(n)
            continue
        if is_wait(t) or collective_spec(t) is not None:
            continue
        tags = getattr(t, "tags", ())
        schema = getattr(t, "_schema", None)
        if torch.Tag.nondeterministic_seeded in tags or (schema is not None and schema.is_mutable):
            continue
        if t is operator.getitem or isinstance(t, torch._ops.OpOverload):
            if all(a in rep for a in n.all_input_nodes):
                rep.add(n)
    return rep


__all__ = ["replicated_values"]
