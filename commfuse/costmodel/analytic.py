"""`AnalyticCostModel`: the `CostEstimator` built from the analytic models.

What it models
    Compute nodes through `compute.ComputeModel` (roofline per op family against
    the topology's device), collectives through `collectives.CollectiveModel`
    (ring/tree/hierarchical/pairwise/p2p by NCCL bus-bandwidth conventions, or
    gloo's algorithms), and compute slowed by a concurrent collective through
    `contention.ContentionModel` (Lagom Eqs. 4-6 on GPUs, (1+κ) on CPU/gloo).
    Calibration enters only through `CollectiveParams`, `ComputeParams`, κ and
    `step.RuntimeParams`, normally loaded from a `profile.CostProfile` file that
    every rank reads.

    ``collective(c)`` prices a collective *inside a graph*: the collective model's
    time (fits or analytic) plus ``runtime.collective_in_graph_us`` (0 unless
    calibrated: on CPU/gloo, a collective issued between compute ops costs more
    than in a back-to-back sweep). ``collectives.time(...)`` stays the raw model.

    ``pricing_shared_only(varies)`` is the same model pricing only the sizes every
    rank shares: a node whose size ``varies(node)`` (across the ranks of a group that
    splits the batch, ``passmgr/invariance.py``) has no bytes, and a compute node or
    collective that reads or makes such a value takes no time. What a pass decides
    from it cannot depend on this rank's local batch.

Sources / assumptions
    See the three modules. All answers are deterministic functions of the graph,
    the topology and the parameters, so every rank computes the same numbers.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch.fx as fx

from commfuse.costmodel.collectives import CollectiveModel, CollectiveParams
from commfuse.costmodel.compute import ComputeEstimate, ComputeModel, ComputeParams, value_bytes
from commfuse.costmodel.contention import ContentionModel
from commfuse.costmodel.estimator import CollectiveEstimate
from commfuse.costmodel.step import RuntimeParams
from commfuse.costmodel.symbol_hints import SymbolHints
from commfuse.costmodel.topology import Topology
from commfuse.ir.collective import Collective


# target -> its time on one rank, for ops whose kernel communicates (their transfers, and how they
# overlap the op's compute, are the op's to say): registered by the op's package
_OP_TIMES: dict[Any, Callable[["AnalyticCostModel", fx.Node], float]] = {}


def register_op_time(target: Any, time_us: Callable[["AnalyticCostModel", fx.Node], float]) -> None:
    """``compute_time_us`` of ``target``'s nodes is ``time_us(model, node)``."""
    _OP_TIMES[target] = time_us


class AnalyticCostModel:
    """Implements `CostEstimator` (``compute_time_us(node)``, ``collective(c)``)."""

    def __init__(
        self,
        topology: Topology,
        backend: str = "nccl",
        collective_params: Optional[CollectiveParams] = None,
        compute_params: Optional[ComputeParams] = None,
        *,
        contention_kappa: Optional[float] = None,
        runtime: Optional[RuntimeParams] = None,
        symbol_hint: int = 4096,
    ) -> None:
        self.topology = topology
        self.runtime = runtime or RuntimeParams()
        self.backend = backend
        self.collectives = CollectiveModel(topology, backend, collective_params, symbol_hint=symbol_hint)
        self.compute = ComputeModel(topology, compute_params, symbol_hint=symbol_hint)
        self.contention = ContentionModel(topology, backend, kappa=contention_kappa)
        # set by pricing_shared_only: which nodes' sizes may differ between ranks
        self._varies: Optional[Callable[[fx.Node], bool]] = None

    # ---- CostEstimator

    def compute_time_us(self, node: fx.Node) -> float:
        if self._unpriced(node):
            return 0.0
        timed = _OP_TIMES.get(node.target) if node.op == "call_function" else None
        if timed is not None:
            return timed(self, node)
        return self.compute.estimate(node).time_us

    def collective(self, c: Collective) -> CollectiveEstimate:
        if self._unpriced(c.start):
            return CollectiveEstimate(0.0, 0, "size varies across ranks: not priced")
        est = self.collectives.estimate(c)
        extra = self.runtime.collective_in_graph_us
        if extra and est.time_us > 0:
            return CollectiveEstimate(est.time_us + extra, est.wire_bytes, est.algorithm)
        return est

    # ---- extras

    @property
    def symbol_hint(self) -> "int | SymbolHints":
        """What a size the graph cannot know is priced at (see :mod:`.symbol_hints`)."""
        return self.collectives.symbol_hint

    def with_symbol_hints(self, hints: SymbolHints) -> "AnalyticCostModel":
        """This model (same topology, parameters and calibration) pricing symbols by ``hints``."""
        other = copy.copy(self)
        other.collectives = copy.copy(self.collectives)
        other.compute = copy.copy(self.compute)
        other.collectives.symbol_hint = other.compute.symbol_hint = hints
        return other

    def value_bytes(self, node: fx.Node) -> int:
        """Bytes of ``node``'s value, symbols at this model's rank-invariant hints (0 for a value
        whose size varies across ranks, under :meth:`pricing_shared_only`)."""
        if self._varies is not None and self._varies(node):
            return 0
        return value_bytes(node.meta.get("val"), self.compute.symbol_hint)

    def pricing_shared_only(self, varies: Callable[[fx.Node], bool]) -> "AnalyticCostModel":
        """This model pricing only what every rank shares: ``varies(node)`` says whether a node's
        size may differ between ranks; such a value has no bytes, and a node that reads or makes
        one takes no time (see the module docstring)."""
        other = copy.copy(self)
        other._varies = varies
        return other

    @property
    def full(self) -> "AnalyticCostModel":
        """This model pricing every size as traced (for reports and timelines: never for a decision
        that changes collectives, see :meth:`pricing_shared_only`)."""
        if self._varies is None:
            return self
        other = copy.copy(self)
        other._varies = None
        return other

    def prices(self, node: fx.Node) -> bool:
        """Whether this model prices ``node``'s time: not a node that reads or makes a value whose
        size varies across ranks (:meth:`pricing_shared_only`)."""
        return not self._unpriced(node)

    def _unpriced(self, node: fx.Node) -> bool:
        varies = self._varies
        return varies is not None and (varies(node) or any(varies(a) for a in node.all_input_nodes))

    def compute_estimate(self, node: fx.Node) -> ComputeEstimate:
        if self._unpriced(node):
            return ComputeEstimate(0.0, 0, 0, "free", "free", False, 0)
        return self.compute.estimate(node)

    def slowdown(self, node_or_estimate: Any, concurrent: Any = None) -> float:
        """Compute slowdown factor while `concurrent` (a collective, or CommResources) runs."""
        est = (
            node_or_estimate
            if isinstance(node_or_estimate, ComputeEstimate)
            else self.compute.estimate(node_or_estimate)
        )
        return self.contention.slowdown(est, concurrent)
