"""DHelix strand interleaving, the pure parts: segments, OEF overlap model, Eq. 2 plan DP,
model folding and the W-shaped pipeline schedule (see docs/dhelix.md; no graph integration yet)."""

from .folding import (Block, ChunkAction, PipelineSchedule, Timeline, folded_layer_map, one_f_one_b,
                      phase_durations, simulate, w_schedule)
from .overlap import OEFTable, default_oef, overlap_table, pair_time
from .plan_dp import InfeasiblePlanError, PairingPlan, PlanStep, SearchResult, best_plan, search_plans
from .segments import SEGMENT_KINDS, Segment, legal_orders, merge_overlapping

__all__ = [
    "Block", "ChunkAction", "InfeasiblePlanError", "OEFTable", "PairingPlan", "PipelineSchedule", "PlanStep",
    "SEGMENT_KINDS", "SearchResult", "Segment", "Timeline", "best_plan", "default_oef", "folded_layer_map",
    "legal_orders", "merge_overlapping", "one_f_one_b", "overlap_table", "pair_time", "phase_durations",
    "search_plans", "simulate", "w_schedule",
]
