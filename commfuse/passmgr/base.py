"""The pass interface: a name, a stage, a docstring contract and `run`.

Modelled on XLA's HloPassInterface: a pass reports whether it changed the graph;
the pipeline owns verification, dumps, invalidation and fallback, so a pass only
rewrites. A pass must decide only from the graph, the config and the topology
(identical on every rank), never from rank-local state.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import ClassVar, FrozenSet

from commfuse.passmgr.context import PassContext


class Stage(str, enum.Enum):
    # Recognition passes run on the graph Dynamo hands the backend, before AOTAutograd
    # traces it: a rewrite into an op with registered autograd there changes what the
    # joint graph differentiates (e.g. hand-written MoE dispatch -> commfuse::moe_layer).
    PRE_AUTOGRAD = "pre_autograd"
    # Rewrites that change what is communicated run on the joint forward+backward graph
    # (or the inference graph) before partitioning, so that moved compute moves what
    # is saved for backward too.
    JOINT = "joint"
    # Ordering passes run on the partitioned forward/backward (or inference) graph.
    SCHEDULE = "schedule"


@dataclass
class PassResult:
    changed: bool
    counts: dict[str, int] = field(default_factory=dict)
    # One line per candidate the pass looked at and left alone, with the reason
    # ("why not fused"); reported and dumped.
    refusals: list[str] = field(default_factory=list)
    # Structured decisions (JSON-serialisable dicts), e.g. the partition search's chosen
    # scheme and predicted gain per collective; reported and dumped.
    decisions: list[dict] = field(default_factory=list)


class GraphPass(abc.ABC):
    """Subclasses set `name` and `stage` and implement `run`; the class docstring is the contract."""

    name: ClassVar[str]
    stage: ClassVar[Stage]
    # Analyses (commfuse.passmgr.context.Analysis keys) still valid after this pass changed the
    # graph; every other analysis of the graph is dropped then.
    preserves: ClassVar[FrozenSet] = frozenset()

    @abc.abstractmethod
    def run(self, ctx: PassContext) -> PassResult:
        """Rewrite `ctx.gm` in place; return whether it changed and what it did."""

    @classmethod
    def contract(cls) -> str:
        return (cls.__doc__ or "").strip()
