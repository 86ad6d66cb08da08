"""DHelix strand interleaving: the fused train-step partition (:mod:`.fused_partition`) and the
interleaved order of its graph (:mod:`.interleave`, run by the ``dhelix_interleave`` pass), segments
(also cut from traced graphs: :mod:`.from_graph`), the OEF overlap model and its profiler
(:mod:`.profile`), the Eq. 2 plan DP, model folding and the W-shaped pipeline schedule (docs/dhelix.md)."""

from commfuse.dhelix.folding import (
    Block,
    ChunkAction,
    PipelineSchedule,
    Timeline,
    folded_layer_map,
    one_f_one_b,
    phase_durations,
    simulate,
    w_schedule,
)
from commfuse.dhelix.from_graph import GraphSegments, cut_segments, defer_movable, graph_segments, movable_ops
from commfuse.dhelix.fused_partition import fused_partition, is_fused_graph
from commfuse.dhelix.interleave import ChunkPlan, InterleavePlan, plan_interleaving, sequential_order
from commfuse.dhelix.overlap import OEFTable, default_oef, merge_overlapping, overlap_table, pair_time
from commfuse.dhelix.plan_dp import (
    InfeasiblePlanError,
    PairingPlan,
    PlanStep,
    SearchResult,
    best_plan,
    search_plans,
)
from commfuse.dhelix.profile import load_oef_profile, measure_oef, oef_for, save_oef_profile
from commfuse.dhelix.segments import SEGMENT_KINDS, Segment, legal_orders

__all__ = [
    "Block",
    "ChunkAction",
    "ChunkPlan",
    "GraphSegments",
    "InterleavePlan",
    "cut_segments",
    "fused_partition",
    "is_fused_graph",
    "plan_interleaving",
    "sequential_order",
    "InfeasiblePlanError",
    "defer_movable",
    "graph_segments",
    "load_oef_profile",
    "measure_oef",
    "movable_ops",
    "oef_for",
    "save_oef_profile",
    "OEFTable",
    "PairingPlan",
    "PipelineSchedule",
    "PlanStep",
    "SEGMENT_KINDS",
    "SearchResult",
    "Segment",
    "Timeline",
    "best_plan",
    "default_oef",
    "folded_layer_map",
    "legal_orders",
    "merge_overlapping",
    "one_f_one_b",
    "overlap_table",
    "pair_time",
    "phase_durations",
    "search_plans",
    "simulate",
    "w_schedule",
]
