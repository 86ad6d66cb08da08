"""Cost model: topology, collective/compute/contention models, the cost profile.

`AnalyticCostModel` is the `CostEstimator` the simulator and passes use; build it
from a `Topology` (presets, `Topology.detect`) or from a calibrated `CostProfile`.
See docs/costmodel.md.
"""

from .analytic import AnalyticCostModel
from .collectives import AlphaBeta, CollectiveModel, CollectiveParams, bus_factor, busbw_GBps, message_bytes
from .compute import ComputeEstimate, ComputeModel, ComputeParams, FamilyFit, OpCost, op_cost
from .contention import CommResources, ContentionModel, GpuContentionParams
from .estimator import CollectiveEstimate, CostEstimator
from .profile import CostProfile, Provenance
from .step import RuntimeParams, StepPrediction, predict_step
from .simulator import ScheduleComparison, SimResult, Simulator, StreamAssignment, compare_schedules, simulate
from .topology import PRESETS, Topology

__all__ = [
    "PRESETS", "AlphaBeta", "AnalyticCostModel", "CollectiveEstimate", "CollectiveModel", "CollectiveParams",
    "CommResources", "ComputeEstimate", "ComputeModel", "ComputeParams", "ContentionModel", "CostEstimator",
    "CostProfile", "FamilyFit", "GpuContentionParams", "OpCost", "Provenance", "Topology", "bus_factor",
    "busbw_GBps", "message_bytes", "op_cost",
    "RuntimeParams", "StepPrediction", "predict_step",
    "ScheduleComparison", "SimResult", "Simulator", "StreamAssignment", "compare_schedules", "simulate",
]
