"""The local forms of a value in a sharded region, and what a shard rule answers.

A region's values are held as ``Sharded(d)`` (this rank's chunk along ``d``), ``Partial()``
(the full value is the sum over the group) or ``Complete()`` (the local value is the full
value); a rule (:mod:`.shard_rules`, :mod:`.moe_rules`) answers with a :class:`LocalOp`:
the local node's arguments and its outputs' layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch.fx as fx


@dataclass(frozen=True)
class Sharded:
    dim: int


@dataclass(frozen=True)
class Partial:
    pass


@dataclass(frozen=True)
class Complete:
    pass


Layout = Union[Sharded, Partial, Complete]


@dataclass
class LocalOp:
    """How to compute a node locally: new args/kwargs (with ``fx.Node`` inputs still the
    *full* nodes; the caller swaps in local forms) and the output layout(s).

    ``index_map`` renumbers the tuple elements a ``getitem`` takes from the local
    node (a split of the local chunk has one piece where the full value had N).
    ``wire_saved``: for an op that communicates inside its kernel, how many fewer bytes
    it sends on shards -- what makes moving a gather past it pay."""

    args: tuple
    kwargs: dict
    out: Layout | tuple[Optional[Layout], ...]
    index_map: Optional[dict[int, int]] = None
    wire_saved: int = 0  # bytes the op itself sends less on shards (ops that communicate inside)


StateOf = Callable[[fx.Node], Optional[Layout]]
Replicated = Callable[[fx.Node], bool]


@dataclass(frozen=True)
class RuleEnv:
    """What the rules may know besides the graph: the region's group, its size, this
    rank's index in it (None: unknown, rank-specific rules are off), which values are
    identical on every rank, the MoE capacity-regrouping opt-in, and which other groups
    cross the region's as mesh dims."""

    group: str
    n: int
    replicated: Replicated
    rank: Optional[int] = None
    moe_capacity_regroup: bool = False
    # group name -> None when that group and the region's cross as the two dims of a mesh known
    # to every rank (a rank's position in the region's group is the same for all its members),
    # else why not
    crossing: Callable[[str], Optional[str]] = lambda group: "no mesh declared to compare the groups"
    # node -> why a rule that knows the op refused it (for the pass report's "why not")
    refusals: dict[fx.Node, str] = field(default_factory=dict)


__all__ = ["Complete", "Layout", "LocalOp", "Partial", "Replicated", "RuleEnv", "Sharded", "StateOf"]
