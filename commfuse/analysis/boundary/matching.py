"""The matching machinery the boundary rules share.

:class:`Site` (a forward transfer at a boundary, position-aligned), :class:`Match` (a rule's
rewrite, not yet applied, with its bytes), :class:`Env` (what the rules read: the graph, its
IR, the boundary map, options and replication facts), :func:`sites` (the forward transfers
that pair a boundary's positions, and notes for the others) and the helpers several rules
use: walking back through view ops and replaying them after the fused transfer, the checks
every rule applies to its collective (:func:`_collective_ok`: the stage group and size, not
coalesced or in place, one wait, a single logical input/output/dim, static shapes), piece
matrices and the erasure of the replaced transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from commfuse.analysis.boundary.layout import Boundary, BoundaryFusionOptions, BoundaryMap
from commfuse.analysis.boundary.replication import replicated_values
from commfuse.analysis.boundary.volume import RuleVolume
from commfuse.ir import rewrite
from commfuse.ir.collective import Collective
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.ir.kinds import CollectiveKind
from commfuse.ir.shapes import shape_of
from commfuse.ops import STAGE_TRANSFER, STAGE_TRANSFER_AUTOGRAD, parse_stage_transfer

aten = torch.ops.aten
K = CollectiveKind

# ops that only re-view a value (replayed on the receiving side after a fused transfer)
_VIEWS = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.alias.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.flatten.using_ints,
}


@dataclass
class Site:
    """A forward transfer at a boundary, position-aligned."""

    node: fx.Node
    boundary: Boundary


@dataclass
class Match:
    rule: str
    site: Site
    apply: Callable[[], None]
    volume: RuleVolume
    description: str


class Env:
    """What the rules read: the graph, its IR, the boundary map, options and replication facts."""

    def __init__(
        self,
        gm: fx.GraphModule,
        bmap: BoundaryMap,
        options: BoundaryFusionOptions,
        input_names: Optional[Sequence[str]] = None,
    ) -> None:
        self.gm, self.bmap, self.options = gm, bmap, options
        self.ir = CollectiveIR(gm)
        self._rep: dict[str, set] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # graph input -> the stage that owns it ("stage<s>.<name>" parameters/buffers, x: the first
        # stage, target: the last), when the program's input names are known
        self.input_stage: Optional[dict[fx.Node, int]] = None
        if input_names is not None:
            last = max((bd.b.stage for bd in bmap.boundaries.values()), default=0)
            self.input_stage = {}
            for n, name in zip(placeholders, input_names, strict=True):
                head = name.split(".", 1)[0]
                if head.startswith("stage") and head[5:].isdigit():
                    self.input_stage[n] = int(head[5:])
                elif name == "x":
                    self.input_stage[n] = 0
                elif name == "target":
                    self.input_stage[n] = last
        self.replicated_placeholders = set()
        if input_names is not None and options.replicated_inputs:
            for n, name in zip(placeholders, input_names, strict=True):
                if name in options.replicated_inputs:
                    self.replicated_placeholders.add(n)

    def refresh(self) -> None:
        self.ir = CollectiveIR(self.gm)
        self._rep.clear()

    def collective_producing(self, node: fx.Node) -> Optional[Collective]:
        for c in self.ir.collectives:
            if c.logical_output is node:
                return c
        return None

    def replicated(self, group: str) -> set:
        if group not in self._rep:
            self._rep[group] = replicated_values(
                self.gm, group, self.ir, self.bmap, self.replicated_placeholders
            )
        return self._rep[group]


def _view_chain_back(node: fx.Node, stop: Callable[[fx.Node], bool]) -> tuple[fx.Node, list[fx.Node]]:
    """Walk from ``node`` back through single-use view ops until ``stop``; returns the root
    and the views (root's user first)."""
    views: list[fx.Node] = []
    while (
        not stop(node)
        and node.op == "call_function"
        and node.target in _VIEWS
        and len(node.users) == 1
        and isinstance(node.args[0], fx.Node)
    ):
        views.append(node)
        node = node.args[0]
    views.reverse()
    return node, views


def _replay_views(gm: fx.GraphModule, value: fx.Node, views: list[fx.Node], before: fx.Node) -> fx.Node:
    for v in views:
        with gm.graph.inserting_before(before):
            new = gm.graph.node_copy(v, lambda a, v=v: value if a is v.args[0] else a)  # noqa: B023 - node_copy calls it now
        new.meta.update({k: val for k, val in v.meta.items()})
        value = new
    return value


def _single_use_chain(chain: list[fx.Node], last_user: fx.Node) -> bool:
    for a, b in zip(chain, chain[1:] + [last_user], strict=True):
        if set(a.users) != {b}:
            return False
    return True


def _static(node: fx.Node) -> bool:
    s = shape_of(node)
    return s is not None and all(isinstance(v, int) for v in s)


def _collective_ok(c: Collective, group: str, size: int) -> Optional[str]:
    if c.group.name != group:
        return f"{c.name} runs on group {c.group.name!r}, not the stage group {group!r}"
    if c.group.size is not None and c.group.size != size:
        return f"{c.name}: group size {c.group.size} differs from the stage size {size}"
    if c.coalesced or c.inplace:
        return f"{c.name} is coalesced or in place"
    if len(c.waits) != 1:
        return f"{c.name} does not have exactly one wait"
    if c.logical_input is None or c.logical_output is None or c.logical_dim is None:
        return f"{c.name} has no single logical input/output/dim"
    if not (_static(c.logical_input) and _static(c.logical_output)):
        return f"{c.name} has dynamic shapes"
    return None


def _uniform(n_src: int, n_dst: int, size: int) -> list[int]:
    return [size] * (n_src * n_dst)


def _erase_transfer(gm: fx.GraphModule, t: fx.Node, new_value: fx.Node) -> None:
    t.replace_all_uses_with(new_value)
    rewrite.erase_dead(gm, [t])


def _sent_collective(t: fx.Node, bd, env: Env, kind: K):
    """The collective of ``kind`` on the sending group whose result (through views) transfer ``t``
    sends: ``(collective, root, views)``, or the refusal reason."""
    root, views = _view_chain_back(t.args[0], lambda n: env.collective_producing(n) is not None)
    c = env.collective_producing(root)
    if c is None or c.kind is not kind:
        return f"the transferred value is not an {kind.value}'s result (through views)"
    why = _collective_ok(c, bd.a.group, bd.a.size)
    return why or (c, root, views)


def sites(gm: fx.GraphModule, bmap: BoundaryMap) -> tuple[list[Site], list[str]]:
    """Forward transfers that pair a boundary's positions; notes for the others."""
    out: list[Site] = []
    notes: list[str] = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (STAGE_TRANSFER_AUTOGRAD, STAGE_TRANSFER):
            continue
        if n.target is STAGE_TRANSFER:
            notes.append(
                f"{n.name}: the asynchronous stage_transfer (a joint graph?) is left alone: boundary "
                "fusion rewrites the forward graph of commfuse.pipeline"
            )
            continue
        a = parse_stage_transfer(n)
        bd = bmap.boundaries.get(a.group_name)
        if bd is None:
            notes.append(f"{n.name}: group {a.group_name!r} is not a boundary of the pipeline")
        elif a.src == bd.b.boundary_ranks and a.dst == bd.a.boundary_ranks:
            notes.append(
                f"{n.name}: a transfer from stage {bd.b.stage} back to stage {bd.a.stage} is left alone"
            )
        elif a.src != bd.a.boundary_ranks or a.dst != bd.b.boundary_ranks:
            notes.append(
                f"{n.name}: pairs {list(a.src)} -> {list(a.dst)} do not pair the positions of stages "
                f"{bd.a.stage} and {bd.b.stage} ({list(bd.a.boundary_ranks)} -> {list(bd.b.boundary_ranks)})"
            )
        else:
            out.append(Site(n, bd))
    return out, notes


__all__ = ["Env", "Match", "Site", "sites"]
