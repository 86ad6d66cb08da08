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

Sources / assumptions
    See the three modules. All answers are deterministic functions of the graph,
    the topology and the parameters, so every rank computes the same numbers.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch.fx as fx

from commfuse.costmodel.collectives import CollectiveModel, CollectiveParams
from commfuse.costmodel.compute import ComputeEstimate, ComputeModel, ComputeParams
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

    def __init__(self, topology: Topology, backend: str = "nccl",
                 collective_params: Optional[CollectiveParams] = None,
                 compute_params: Optional[ComputeParams] = None, *,
                 contention_kappa: Optional[float] = None, runtime: Optional[RuntimeParams] = None,
                 symbol_hint: int = 4096) -> None:
        self.topology = topology
        self.runtime = runtime or RuntimeParams()
        self.backend = backend
        self.collectives = CollectiveModel(topology, backend, collective_params, symbol_hint=symbol_hint)
        self.compute = ComputeModel(topology, compute_params, symbol_hint=symbol_hint)
        self.contention = ContentionModel(topology, backend, kappa=contention_kappa)

    # ---- CostEstimator

    def compute_time_us(self, node: fx.Node) -> float:
        timed = _OP_TIMES.get(node.target) if node.op == "call_function" else None
        if timed is not None:
            return timed(self, node)
        return self.compute.estimate(node).time_us

    def collective(self, c: Collective) -> CollectiveEstimate:
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

    def compute_estimate(self, node: fx.Node) -> ComputeEstimate:
        return self.compute.estimate(node)

    def slowdown(self, node_or_estimate: Any, concurrent: Any = None) -> float:
        """Compute slowdown factor while `concurrent` (a collective, or CommResources) runs."""
        est = node_or_estimate if isinstance(node_or_estimate, ComputeEstimate) else self.compute.estimate(
            node_or_estimate)
        return self.contention.slowdown(est, concurrent)
