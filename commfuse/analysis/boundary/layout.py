"""The stage layout boundary fusion works on: each boundary's two stages and their positions.

:class:`StageSide` (one stage at a boundary: its group alias, size and its positions' ranks
in the boundary group), :class:`Boundary`, :class:`BoundaryMap` (the pipeline's boundaries by
boundary-group name and this rank's position, from a ``PipelineLayout`` or from the aliases
of a commfuse.pipeline forward graph) and :class:`BoundaryFusionOptions` (what the rules may
assume beyond the graph), with :data:`RULES`, the rule names in their default order (the
options validate against it; :data:`commfuse.analysis.boundary.MATCHERS` maps each to its
match function).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.fx as fx

from commfuse.core.meta import LAYOUT_META_KEY  # where the registered pass finds a PipelineLayout
from commfuse.ops import STAGE_TRANSFER_AUTOGRAD, parse_stage_transfer
from commfuse.pipeline.layout import BOUNDARY_PREFIX, STAGE_PREFIX

RULES = ("ag_p2p", "p2p_ag", "a2a_p2p", "ar_p2p", "p2p_a2a")


@dataclass(frozen=True)
class StageSide:
    """One stage at a boundary: its group alias, size and its positions' ranks in the boundary group."""

    stage: int
    group: str
    size: int
    boundary_ranks: tuple[int, ...]  # boundary-group rank of position 0..size-1


@dataclass(frozen=True)
class Boundary:
    index: int
    group: str
    group_size: int
    a: StageSide  # sending stage (forward)
    b: StageSide  # receiving stage


@dataclass(frozen=True)
class BoundaryMap:
    """The pipeline's boundaries by boundary-group name, and this rank's position (None: unknown)."""

    boundaries: dict[str, Boundary]
    position: Optional[int]
    source: str  # "layout" | "graph"
    stage_groups: dict[str, int] = field(default_factory=dict)  # stage group name -> stage

    @classmethod
    def from_layout(cls, layout) -> "BoundaryMap":
        bds = {}
        for b, g in enumerate(layout.boundaries):
            src, dst = layout.boundary_pairs(b)
            sa, sb = layout.stages[b], layout.stages[b + 1]
            bds[g.name] = Boundary(
                b,
                g.name,
                g.size,
                StageSide(b, sa.name, sa.size, tuple(src)),
                StageSide(b + 1, sb.name, sb.size, tuple(dst)),
            )
        return cls(bds, layout.position, "layout", {g.name: s for s, g in enumerate(layout.stages)})

    @classmethod
    def from_graph(cls, gm: fx.GraphModule) -> tuple["BoundaryMap", list[str]]:
        """The map a pipeline forward graph implies through commfuse.pipeline's aliases
        (``commfuse.pp.boundary<b>`` joins ``commfuse.pp.stage<b>`` and ``<b+1>``; a forward
        transfer pairs positions). Position unknown. Returns the map and notes on what did not fit."""

        notes: list[str] = []
        pairs: dict[str, set] = {}
        sizes: dict[str, int] = {}
        for n in gm.graph.nodes:
            if n.op != "call_function" or n.target is not STAGE_TRANSFER_AUTOGRAD:
                continue
            a = parse_stage_transfer(n)
            if (
                not a.group_name.startswith(BOUNDARY_PREFIX)
                or not a.group_name[len(BOUNDARY_PREFIX) :].isdigit()
            ):
                notes.append(f"{n.name}: group {a.group_name!r} is not a commfuse.pipeline boundary alias")
                continue
            pairs.setdefault(a.group_name, set()).add((a.src, a.dst))
            sizes[a.group_name] = a.group_size
        bds: dict[str, Boundary] = {}
        for name, found in pairs.items():
            if len(found) != 1:  # e.g. a router weight sent back by p2p_a2a: which way is forward?
                notes.append(
                    f"{name}: transfers in more than one direction; without the pipeline layout "
                    f"(gm.meta[{LAYOUT_META_KEY!r}]) the stage order is unknown, boundary left alone"
                )
                continue
            ((src, dst),) = found
            b = int(name[len(BOUNDARY_PREFIX) :])
            if sizes[name] == len(src) + len(dst) and not set(src) & set(dst):
                bds[name] = Boundary(
                    b,
                    name,
                    sizes[name],
                    StageSide(b, f"{STAGE_PREFIX}{b}", len(src), src),
                    StageSide(b + 1, f"{STAGE_PREFIX}{b + 1}", len(dst), dst),
                )
        stage_groups = {s.group: s.stage for bd in bds.values() for s in (bd.a, bd.b)}
        return cls(bds, None, "graph", stage_groups), notes

    def stage_size(self, group: str) -> Optional[int]:
        for bd in self.boundaries.values():
            for s in (bd.a, bd.b):
                if s.group == group:
                    return s.size
        return None


@dataclass(frozen=True)
class BoundaryFusionOptions:
    """What the rules may assume beyond the graph.

    ``tp_stages``: stages that follow Megatron's tensor-parallel contract (activations and
    their gradients are the same on every rank of the stage): rule ar_p2p needs it of the
    receiving stage. ``replicated_inputs``: names of graph inputs (``InputSpec.name``, e.g.
    ``"x"``) that hold the same value on every rank of the stage owning them (TP input data).
    ``reverse_transfers``: allow rule p2p_a2a to send values of the receiving stage (the router
    weight) to the sending stage every micro-batch; their gradients come back in the backward.
    The channel from the receiving to the sending stage then carries forward and backward
    messages, which commfuse.pipeline's point-to-point matching (one tag per pair of ranks)
    keeps in order under GPipe but not under 1F1B (measured: gloo aborts on a size mismatch);
    docs/boundary-fusion.md says what the runner needs for 1F1B.
    ``rules``: the rules to try, in this order."""

    rules: tuple[str, ...] = RULES
    tp_stages: tuple[int, ...] = ()
    replicated_inputs: tuple[str, ...] = ()
    reverse_transfers: bool = False

    def __post_init__(self) -> None:
        bad = [r for r in self.rules if r not in RULES]
        if bad:
            raise ValueError(f"BoundaryFusionOptions.rules: unknown rules {bad}; known: {list(RULES)}")
        for s in self.tp_stages:
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise ValueError(
                    f"BoundaryFusionOptions.tp_stages: stage indices are non-negative ints, got {s!r}"
                )
        for s in self.replicated_inputs:
            if not isinstance(s, str):
                raise ValueError(f"BoundaryFusionOptions.replicated_inputs: input names are str, got {s!r}")


__all__ = ["Boundary", "BoundaryFusionOptions", "BoundaryMap", "LAYOUT_META_KEY", "RULES", "StageSide"]
