"""The record the IR keeps for every collective in a graph."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from commfuse.ir.kinds import CollectiveKind
from commfuse.ir.shapes import Size


class ParallelRole(str, enum.Enum):
    TP = "tp"
    SP = "sp"
    EP = "ep"
    DP = "dp"
    FSDP = "fsdp"
    PP = "pp"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class GroupInfo:
    """A process group as the graph names it; ranks are global ranks when known."""

    name: str
    size: int | None
    ranks: tuple[int, ...] | None

    def describe(self) -> str:
        ranks = "?" if self.ranks is None else ",".join(map(str, self.ranks))
        return f"group {self.name} (size {self.size if self.size is not None else '?'}, ranks [{ranks}])"

    def same_members(self, other: GroupInfo) -> bool:
        """Whether a collective on ``other`` does exactly what it does on this group.

        True iff the names are equal, or both groups' ranks are known and equal as an
        *ordered* tuple (global ranks in group-rank order). Order matters: group rank ``r``
        is the one that gets chunk ``r`` of a reduce_scatter / all_to_all and whose
        piece lands at position ``r`` of an all_gather, so the same set of ranks in a
        different order is a different group. Where either side's ranks are unknown, only
        the name decides. All members of a group see the same ranks for it, so the ranks
        that communicate on these groups get the same answer.
        """
        if self.name == other.name:
            return True
        return self.ranks is not None and other.ranks is not None and tuple(self.ranks) == tuple(other.ranks)


@dataclass
class Collective:
    """One collective: where it starts, where it is waited, and what it moves.

    `logical_*` describe the collective as the program means it, seen through
    DTensor's layout shuffles: an all_gather along dim 1 is traced as a dim-0
    all_gather followed by split+cat; here it appears with `logical_dim == 1`,
    `logical_output` the cat node and `layout_nodes` the split/getitem/cat nodes.
    """

    index: int  # position among the graph's collectives, in graph order
    start: fx.Node
    kind: CollectiveKind
    group: GroupInfo
    waits: list[fx.Node]
    inputs: list[fx.Node]
    reduce_op: str | None
    dtype: torch.dtype | None
    input_shapes: list[tuple[Size, ...] | None]
    output_shapes: list[tuple[Size, ...] | None]
    input_bytes: Size | None  # per rank, all tensors
    output_bytes: Size | None
    logged_bytes: Size | None  # NCCL count semantics (count x dtype size)
    wire_bytes: Size | None  # bytes each rank sends under ring conventions
    coalesced: bool = False
    inplace: bool = False
    synchronous: bool = False  # completes inside the op (no wait; `waits` is empty): CollectiveOpSpec
    logical_dim: int | None = None  # gather dim (AG), scatter dim (RS), split dim (A2A)
    logical_concat_dim: int | None = None  # A2A only: dim the received pieces are concatenated on
    logical_input: fx.Node | None = None
    logical_output: fx.Node | None = None
    layout_nodes: list[fx.Node] = field(default_factory=list)
    role: ParallelRole = ParallelRole.UNKNOWN
    role_source: str = (
        "unknown"  # "user", "mesh" (setup), "dtensor" (the graph's DTensor meshes), "inferred", "unknown"
    )
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.start.name

    @property
    def input_value(self) -> torch.Tensor | None:
        """The (fake) tensor of the first input as traced, or None where it is not recorded."""
        v = self.inputs[0].meta.get("val") if self.inputs and isinstance(self.inputs[0], fx.Node) else None
        return v if isinstance(v, torch.Tensor) else None

    @property
    def device_type(self) -> str | None:
        """``"cpu"``, ``"cuda"``, ... of the first input (which backend runs it: gloo, NCCL); None: unknown."""
        v = self.input_value
        return v.device.type if v is not None else None

    def signature(self) -> tuple:
        """What must match across ranks for the collective sequences to agree."""
        # Ops whose input shapes legitimately differ between ranks (commfuse::m2ms: a rank's
        # input is its row of the piece matrix) give a rank-independent stand-in (ops/boundary/ir_view.py).
        shapes = self.extra.get("signature_shapes")
        return (
            self.kind.value,
            self.group.name,
            self.reduce_op,
            str(self.dtype),
            shapes if shapes is not None else tuple(str(s) for s in self.input_shapes),
        )
