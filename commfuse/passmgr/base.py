"""The pass interface: a name, a stage, a docstring contract and `run`.

Modelled on XLA's HloPassInterface: a pass reports whether it changed the graph;
the pipeline owns verification, dumps, invalidation and fallback, so a pass only
rewrites. A pass must decide only from what its context holds -- the graph, the config, the
topology (and the cost policy built from it) and the session state -- which is identical on
every rank, never from rank-local state or globals.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import ClassVar, FrozenSet, Optional

from commfuse.costmodel.topology import Topology
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


@dataclass(frozen=True)
class FuzzSpec:
    """How the pass fuzzer (:mod:`commfuse.fuzz`) checks a pass, declared with the pass.

    * ``generators``: the program families that exercise it (``commfuse.fuzz.generator.FAMILIES``;
      None: all);
    * ``needs_joint``: only joint (forward + backward) graphs make sense for it;
    * ``topology``: the ``Config.topology`` to fuzz it under (programs then use its world size);
    * ``exact``: it never changes a value, so results must be bitwise equal (else the tolerance
      policy of :func:`commfuse.reference.numerics.tolerances`);
    * ``world_sizes``: the world sizes to generate (default 2, 4, 8);
    * ``keeps_collective_order``: it adds, removes and reorders no collective (per-group sequence
      hashes and the total-order hash unchanged);
    * ``scaled_tolerance``: compare outputs normalised by their magnitude (for passes that regroup
      sums over many ranks, whose rounding grows with the summands' magnitude);
    * ``microbatches``: fuzz on joint programs run as 2-3 tagged micro-batches (fused train steps);
    * ``not_fuzzed``: why the fuzzer cannot check the pass meaningfully, and what covers it instead
      (then the other fields are unused).
    """

    generators: Optional[tuple[str, ...]] = None
    needs_joint: bool = False
    topology: Optional[Topology] = None
    exact: bool = False
    world_sizes: Optional[tuple[int, ...]] = None
    keeps_collective_order: bool = False
    scaled_tolerance: bool = False
    microbatches: bool = False
    not_fuzzed: Optional[str] = None


class GraphPass(abc.ABC):
    """Subclasses set `name` and `stage` and implement `run`; the class docstring is the contract."""

    name: ClassVar[str]
    stage: ClassVar[Stage]
    # Analyses (commfuse.passmgr.context.Analysis keys) still valid after this pass changed the
    # graph; every other analysis of the graph is dropped then.
    preserves: ClassVar[FrozenSet] = frozenset()
    # How the fuzzer checks this pass (None: the defaults, every family, tolerance compare; a pass
    # in the registry table without one fails tests/test_fuzz.py until its author decides).
    fuzz: ClassVar[Optional[FuzzSpec]] = None
    # Whether the pipeline keeps this pass's change only when the cost model predicts the graph
    # is not slower with it (commfuse.passmgr.gate). Off for passes whose change is not a trade
    # the step time judges: forced variants, which exist to apply a rewrite regardless.
    gated: ClassVar[bool] = True

    @abc.abstractmethod
    def run(self, ctx: PassContext) -> PassResult:
        """Rewrite `ctx.gm` in place; return whether it changed and what it did."""

    @classmethod
    def contract(cls) -> str:
        return (cls.__doc__ or "").strip()
