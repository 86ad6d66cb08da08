"""What a pass sees: the graph, the config, the topology, the session state, and analyses.

Analyses are typed keys (:class:`Analysis`): computed on first use, kept until the graph
changes, and then dropped unless the pass that changed it declares it preserves them
(``GraphPass.preserves``; MLIR's preserved-analyses discipline). Analyses that are functions
of the config and topology alone (``graph_independent``) survive every change.

Everything a pass may decide from comes through here, identical on every rank: the graph,
``config``, ``topology`` (and the :class:`~commfuse.passmgr.cost.CostPolicy` built from it),
and ``session``, the state ``commfuse.setup`` created before compiling (sub-groups, the
communicator pool plan). ``rank`` (this process's rank) may only shape a rewrite's local
form -- a rank's own chunk -- never whether to rewrite. Passes never read global state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generic, Mapping, Optional, Protocol, Sequence, TypeVar

import torch.fx as fx

from commfuse.costmodel.analytic import AnalyticCostModel
from commfuse.costmodel.hierarchy import SubGroups
from commfuse.costmodel.topology import Topology
from commfuse.core.torch_private import process_group_with_members
from commfuse.ir.graph_ir import CollectiveIR, IRBuildOptions
from commfuse.passmgr.cost import CostPolicy
from commfuse.passmgr.invariance import SharedSizes

if TYPE_CHECKING:
    from commfuse.config import Config

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class Analysis(Generic[T]):
    """A typed analysis key: ``build(ctx)`` computes it; ``graph_independent`` ones never go stale."""

    name: str
    build: Callable[["PassContext"], T]
    graph_independent: bool = False

    def __repr__(self) -> str:
        return f"Analysis({self.name})"


COLLECTIVE_IR: Analysis[CollectiveIR] = Analysis(
    "collective_ir", lambda ctx: CollectiveIR(ctx.gm, ctx.ir_options)
)


class SessionState(Protocol):
    """What a pass may use of the job's session (``commfuse.setup``): the same on every rank."""

    communicator_pool_plan: list[Any]
    # every block of every partition the job declared (a DeviceMesh's dims, ``setup(groups=)``)
    partitions: list[list[tuple[int, ...]]]

    def subgroups_of(self, parent: Sequence[int]) -> Optional[SubGroups]: ...


@dataclass
class NoSession:
    """The session of a job that did not call ``commfuse.setup``: no sub-groups, no pool."""

    communicator_pool_plan: list[Any] = field(default_factory=list)
    partitions: list[list[tuple[int, ...]]] = field(default_factory=list)

    def subgroups_of(self, parent: Sequence[int]) -> Optional[SubGroups]:
        return None


class PassContext:
    gm: fx.GraphModule  # declared here: COLLECTIVE_IR's builder above reads it

    def __init__(
        self,
        gm: fx.GraphModule,
        config: "Config",
        *,
        graph_kind: str = "graph",
        topology: Optional[Topology] = None,
        group_roles: Optional[Mapping[str, str]] = None,
        role_sources: Optional[Mapping[str, str]] = None,
        session: Optional[SessionState] = None,
        cost_model: Optional[AnalyticCostModel] = None,
        rank: Optional[int] = None,
        partitions: Sequence[Sequence[Sequence[int]]] = (),
    ) -> None:
        self.gm = gm
        self.config = config
        self.graph_kind = graph_kind
        self.topology = topology
        self.session: SessionState = session if session is not None else NoSession()
        # this process's global rank, for rewrites that differ per rank (a rank's own chunk) while
        # the decision to rewrite stays the same on every rank; None: unknown (such rules are off)
        self.rank = rank
        # Partitions of the world into groups, with every block, as every rank knows them: the
        # session's (setup(mesh=/groups=)) and the graph's DTensor meshes' dims. What a rewrite
        # whose peers are other ranks' groups (a pair on two mesh dims) decides from.
        self.partitions: list[list[tuple[int, ...]]] = [
            [tuple(int(r) for r in b) for b in part]
            for part in [*getattr(self.session, "partitions", []), *partitions]
        ]
        self._ir_options = IRBuildOptions(group_roles=group_roles or {}, role_sources=role_sources or {})
        shared = SharedSizes(self._ir_options, uniform_batches=config.uniform_batches)
        self.cost = CostPolicy(topology, model=cost_model, graph=gm, shared=shared)
        self._analyses: dict[Analysis, Any] = {}
        self._named: dict[str, Analysis] = {}

    def get(self, analysis: Analysis[T]) -> T:
        if analysis not in self._analyses:
            self._analyses[analysis] = analysis.build(self)
        return self._analyses[analysis]

    def group_with_members(self, ranks: Sequence[int]) -> Optional[tuple[str, tuple[int, ...]]]:
        """The name and rank order of an existing process group whose members are ``ranks``
        (None: there is none; a pass never creates one)."""
        return process_group_with_members(ranks)

    @property
    def ir(self) -> CollectiveIR:
        return self.get(COLLECTIVE_IR)

    def analysis(self, name: str, build: Callable[[fx.GraphModule], T]) -> T:
        """``build(gm)`` cached under ``name`` until the graph changes: the untyped form, for passes
        written outside commfuse (built-in passes declare :class:`Analysis` keys)."""
        key = self._named.setdefault(name, Analysis(name, lambda ctx: build(ctx.gm)))
        return self.get(key)

    def invalidate(self, preserved: frozenset = frozenset()) -> None:
        """The graph changed: drop every analysis of it except ``preserved`` ones."""
        self._analyses = {a: v for a, v in self._analyses.items() if a.graph_independent or a in preserved}

    def derive(self, gm: fx.GraphModule) -> "PassContext":
        """A context for another graph (a candidate rewrite on a copy), sharing everything else."""
        other = PassContext(
            gm,
            self.config,
            graph_kind=self.graph_kind,
            topology=self.topology,
            group_roles=self._ir_options.group_roles,
            role_sources=self._ir_options.role_sources,
            session=self.session,
            rank=self.rank,
        )
        other.cost = self.cost
        other.partitions = self.partitions
        return other

    @property
    def ir_options(self) -> IRBuildOptions:
        return self._ir_options


__all__ = ["COLLECTIVE_IR", "Analysis", "NoSession", "PassContext", "SessionState"]
