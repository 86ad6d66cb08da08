"""`CollectiveIR`: a typed view over an FX graph, built once per graph version.

The IR never mutates the graph. Passes that change the graph report it, and the
pipeline drops the IR (and every other cached analysis) so the next pass sees a
fresh one — the MLIR analysis-manager discipline.
"""

from __future__ import annotations

import hashlib
import operator
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping

import torch
import torch.fx as fx

from commfuse.core.meta import PHASE_META_KEY
from commfuse.core.torch_private import resolve_process_group
from commfuse.ir import volume
from commfuse.ir.collective import Collective, GroupInfo, ParallelRole
from commfuse.ir.dims import DimTypeAnalysis
from commfuse.ir.embedded import EmbeddedComm, embedded_comm
from commfuse.ir.kinds import CollectiveKind, collective_spec, is_wait
from commfuse.ir.layout import match_gather_shuffle, match_scatter_shuffle
from commfuse.ir.roles import infer_role
from commfuse.ir.shapes import Size, nbytes, shape_of, tensor_meta


def _resolve_group(name: str, size_hint: int | None) -> GroupInfo:
    pg = resolve_process_group(name)
    if pg is None:
        return GroupInfo(name=name, size=size_hint, ranks=None)
    import torch.distributed as dist

    try:
        ranks = tuple(dist.get_process_group_ranks(pg))
    except (RuntimeError, ValueError):
        ranks = None
    return GroupInfo(name=name, size=pg.size(), ranks=ranks)


def resolve_group_info(name: str) -> GroupInfo:
    """The group registered under ``name`` in this process: its size and global ranks (None
    when it is not registered here)."""
    return _resolve_group(name, None)


def _flatten_nodes(x) -> list[fx.Node]:
    if isinstance(x, fx.Node):
        return [x]
    if isinstance(x, (list, tuple)):
        return [n for item in x for n in _flatten_nodes(item)]
    return []


def _waits_of(start: fx.Node, coalesced: bool) -> list[fx.Node]:
    if not coalesced:
        return [u for u in start.users if u.op == "call_function" and is_wait(u.target)]
    waits = []
    for g in start.users:
        if g.op == "call_function" and g.target is operator.getitem:
            waits.extend(u for u in g.users if u.op == "call_function" and is_wait(u.target))
    return waits


def _shape_derived_splits(sizes, shapes, n: int | None) -> bool:
    """No split sizes, or the even division of a static dim 0 by the group size ``n``."""
    if sizes is None:
        return True
    shape = shapes[0] if shapes else None
    if not n or not shape or not all(isinstance(s, int) for s in (*sizes, shape[0])):
        return False
    return len(sizes) == n and all(s * n == shape[0] for s in sizes)


def _sum_sizes(vals: list[Size | None]) -> Size | None:
    if any(v is None for v in vals):
        return None
    total: Size = 0
    for v in vals:
        total = total + v  # type: ignore[operator]
    return total


@dataclass
class IRBuildOptions:
    group_roles: Mapping[str, str] = field(default_factory=dict)  # group name -> role (user/mesh given)
    role_sources: Mapping[str, str] = field(default_factory=dict)  # group name -> "user" | "mesh" | "dtensor"


class CollectiveIR:
    """Every collective of a graph with its group, sizes, logical dims and role."""

    def __init__(self, gm: fx.GraphModule, options: IRBuildOptions | None = None) -> None:
        self.gm = gm
        self.options = options or IRBuildOptions()
        self.backward_nodes = _tangent_dependents(gm)
        self.collectives: list[Collective] = []
        self._by_start: dict[fx.Node, Collective] = {}
        self._groups: dict[str, GroupInfo] = {}
        # Higher-order ops (cond, while_loop, checkpoint wrappers, ...) whose subgraphs hold
        # collectives: node -> how many. Passes cannot see inside; they must treat these
        # nodes as opaque barriers (dims are ND there; nothing may move across them).
        self.hidden_collectives: dict[fx.Node, int] = {}
        # Ops that communicate from inside their kernel (commfuse's MoE layer): counted, never moved.
        self.embedded: list[EmbeddedComm] = []
        for node in gm.graph.nodes:
            emb = embedded_comm(node)
            if emb is not None:
                self.embedded.append(emb)
            if node.op == "call_function" and collective_spec(node.target) is not None:
                c = self._build(node, len(self.collectives))
                self.collectives.append(c)
                self._by_start[node] = c
            elif node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
                n = _count_nested_collectives(gm, node)
                if n:
                    self.hidden_collectives[node] = n

    # -- construction -------------------------------------------------------
    def _group(self, name: str, size_hint: int | None) -> GroupInfo:
        if name not in self._groups:
            self._groups[name] = _resolve_group(name, size_hint)
        g = self._groups[name]
        if g.size is None and size_hint is not None:
            g = self._groups[name] = GroupInfo(name, size_hint, g.ranks)
        return g

    def _build(self, node: fx.Node, index: int) -> Collective:
        spec = collective_spec(node.target)
        assert spec is not None
        args = spec.parse(tuple(node.args), dict(node.kwargs))
        inputs = _flatten_nodes(args.inputs)
        group = self._group(args.group_name, args.group_size)
        waits = _waits_of(node, spec.coalesced)
        if spec.coalesced:
            outputs = [w for w in waits]
        else:
            outputs = [node]
        in_shapes = [shape_of(i) for i in inputs]
        out_shapes = [shape_of(o) for o in outputs]
        in_bytes = _sum_sizes([nbytes(i) for i in inputs])
        out_bytes = _sum_sizes([nbytes(o) for o in outputs])
        dtypes = {tensor_meta(i).dtype for i in inputs if tensor_meta(i) is not None}
        dtype = dtypes.pop() if len(dtypes) == 1 else None
        send_bytes = None
        if spec.kind is CollectiveKind.BATCH_P2P:
            ops = node.args[0]
            send_bytes = _sum_sizes([nbytes(t) for op, t in zip(ops, inputs, strict=True) if op == "isend"])
        c = Collective(
            index=index,
            start=node,
            kind=spec.kind,
            group=group,
            waits=waits,
            inputs=inputs,
            reduce_op=args.reduce_op,
            dtype=dtype,
            input_shapes=in_shapes,
            output_shapes=out_shapes,
            input_bytes=in_bytes,
            output_bytes=out_bytes,
            logged_bytes=volume.logged_bytes(spec.kind, in_bytes, out_bytes),
            wire_bytes=volume.wire_bytes(spec.kind, group.size, in_bytes, out_bytes, send_bytes=send_bytes),
            coalesced=spec.coalesced,
            inplace=spec.inplace,
            synchronous=spec.synchronous,
        )
        if spec.kind is CollectiveKind.ALL_TO_ALL:
            c.extra["equal_splits"] = (
                args.input_split_sizes is None or len(set(map(str, args.input_split_sizes))) <= 1
            )
            # split sizes given explicitly are this rank's (uneven, or data-dependent): another
            # rank's sizes, and so the collective's bytes there, may differ -- unless they are the
            # even division of a static dim 0, which every rank with the same shapes passes
            c.extra["rank_local_sizes"] = not (
                _shape_derived_splits(args.input_split_sizes, in_shapes, group.size)
                and _shape_derived_splits(args.output_split_sizes, out_shapes, group.size)
            )
        self._logical_layout(c)
        if spec.refine is not None:
            spec.refine(c)
        self._role(c)
        return c

    def _logical_layout(self, c: Collective) -> None:
        c.logical_dim = (
            0
            if c.kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_TO_ALL)
            else None
        )
        c.logical_input = c.inputs[0] if len(c.inputs) == 1 else None
        c.logical_output = c.waits[0] if len(c.waits) == 1 and not c.coalesced else None
        if c.synchronous:  # no wait: the op's own value is the result
            c.logical_output = c.start
        n = c.group.size
        if c.coalesced or not c.inputs:
            return
        if c.kind in (CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_TO_ALL):
            sh = match_scatter_shuffle(c.inputs[0], n)
            if sh is not None:
                c.logical_dim, c.logical_input = sh.dim, sh.outer
                c.layout_nodes.extend(sh.nodes)
        if c.kind in (CollectiveKind.ALL_GATHER, CollectiveKind.ALL_TO_ALL) and len(c.waits) == 1:
            sh = match_gather_shuffle(c.waits[0], n)
            if sh is not None:
                if c.kind is CollectiveKind.ALL_GATHER:
                    c.logical_dim = sh.dim
                else:
                    c.logical_concat_dim = sh.dim
                c.logical_output = sh.outer
                c.layout_nodes.extend(sh.nodes)
        if c.kind is CollectiveKind.ALL_TO_ALL and c.logical_concat_dim is None:
            c.logical_concat_dim = 0

    def _role(self, c: Collective) -> None:
        src = c.logical_input or (c.inputs[0] if c.inputs else None)
        inferred = infer_role(c, in_backward=src in self.backward_nodes)
        given = self.options.group_roles.get(c.group.name)
        if given is None:
            c.role = inferred
            c.role_source = "inferred" if inferred is not ParallelRole.UNKNOWN else "unknown"
        elif ParallelRole(given) is ParallelRole.TP and inferred is ParallelRole.SP:
            # Sequence parallelism runs on the TP group: a sequence-dim gather/scatter there is SP.
            c.role, c.role_source = (
                ParallelRole.SP,
                self.options.role_sources.get(c.group.name, "user") + "+inferred",
            )
        else:
            c.role = ParallelRole(given)
            c.role_source = self.options.role_sources.get(c.group.name, "user")

    # -- queries ------------------------------------------------------------
    def collective_at(self, node: fx.Node) -> Collective | None:
        return self._by_start.get(node)

    @property
    def groups(self) -> dict[str, GroupInfo]:
        return dict(self._groups)

    @cached_property
    def dims(self) -> DimTypeAnalysis:
        return DimTypeAnalysis(self.gm)

    def by_group(self) -> dict[str, list[Collective]]:
        out: dict[str, list[Collective]] = defaultdict(list)
        for c in self.collectives:
            out[c.group.name].append(c)
        return dict(out)

    def sequence_hashes(self) -> dict[str, str]:
        """Per process group: a stable hash of the ordered collective signatures.

        Two ranks whose hashes differ for a group would issue different collectives
        on it, i.e. hang or corrupt data. Used by the verifier and the cross-rank check.
        """
        return {g: _hash([c.signature() for c in cs]) for g, cs in sorted(self.by_group().items())}

    def order_hash(self) -> str:
        """Hash of the single total issue order across all groups."""
        return _hash([c.signature() for c in self.collectives])


def _count_nested_collectives(gm: fx.GraphModule, node: fx.Node) -> int:
    count = 0
    for a in node.all_input_nodes:
        if a.op == "get_attr":
            sub = getattr(gm, str(a.target), None)
            if isinstance(sub, fx.GraphModule):
                for n in sub.graph.nodes:
                    if n.op == "call_function" and collective_spec(n.target) is not None:
                        count += 1
                    elif n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator):
                        count += _count_nested_collectives(sub, n)
    return count


# Set by the fused train-step partition (commfuse.dhelix.fused_partition) on the nodes of a graph
# that holds forward and backward together: its tangent is a constant there, the tag says which is which.


def _tangent_dependents(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes computed from a tangent input: the backward region of a joint/backward graph (or the
    nodes tagged backward in a fused forward+backward graph)."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or n.meta.get(
            PHASE_META_KEY
        ) == "backward":
            out.add(n)
        elif any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _hash(items: list[tuple]) -> str:
    h = hashlib.sha256()
    for it in items:
        h.update(repr(it).encode())
        h.update(b"\x00")
    return h.hexdigest()[:16]
