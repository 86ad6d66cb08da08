"""Cost model: topology, collective/compute/contention models, the cost profile.

`AnalyticCostModel` is the `CostEstimator` the simulator and passes use; build it
from a `Topology` (presets, `Topology.detect`) or from a calibrated `CostProfile`.
See docs/costmodel.md.
"""

from commfuse.costmodel.analytic import AnalyticCostModel
from commfuse.costmodel.collectives import (
    AlphaBeta,
    CollectiveModel,
    CollectiveParams,
    bus_factor,
    busbw_GBps,
    message_bytes,
)
from commfuse.costmodel.compute import (
    ComputeEstimate,
    ComputeModel,
    ComputeParams,
    FamilyFit,
    OpCost,
    op_cost,
)
from commfuse.costmodel.contention import CommResources, ContentionModel, GpuContentionParams
from commfuse.costmodel.estimator import CollectiveEstimate, CostEstimator
from commfuse.costmodel.profile import CostProfile, Provenance
from commfuse.costmodel.simulator import (
    ScheduleComparison,
    SimResult,
    Simulator,
    StreamAssignment,
    compare_schedules,
    simulate,
)
from commfuse.costmodel.step import RuntimeParams, StepPrediction, predict_step
from commfuse.costmodel.topology import PRESETS, Topology

__all__ = [
    "PRESETS",
    "AlphaBeta",
    "AnalyticCostModel",
    "CollectiveEstimate",
    "CollectiveModel",
    "CollectiveParams",
    "CommResources",
    "ComputeEstimate",
    "ComputeModel",
    "ComputeParams",
    "ContentionModel",
    "CostEstimator",
    "CostProfile",
    "FamilyFit",
    "GpuContentionParams",
    "OpCost",
    "Provenance",
    "Topology",
    "bus_factor",
    "busbw_GBps",
    "message_bytes",
    "op_cost",
    "RuntimeParams",
    "StepPrediction",
    "predict_step",
    "ScheduleComparison",
    "SimResult",
    "Simulator",
    "StreamAssignment",
    "compare_schedules",
    "simulate",
]
