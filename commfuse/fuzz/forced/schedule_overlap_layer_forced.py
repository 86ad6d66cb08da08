"""schedule_overlap_layer_forced: the layer-level (Eq. 1) order on every graph, simulator not asked.

Contract
- Matches: what ``schedule_overlap`` matches; every node counts as backward, so any graph
  with collectives of FSDP/DP/TP/SP roles gets a layer-level order (a graph without module
  information is one layer).
- Does: ``schedule_overlap`` with only the layer-level candidate: the preferred order and its
  issue order (collectives may change their relative order inside a layer), scheduled by the
  list scheduler; kept when within the memory budget and the in-flight limit, even if the
  simulator predicts it slower than the input order.
- Why it exists: the layer level only runs on backward graphs (nodes that depend on a tangent
  input), which the fuzzer's programs do not have; this name lets the fuzzer exercise the
  preferred order, the re-chained collectives and the scheduler on arbitrary graphs.
  Test-only: not in the product pass table (registered by
  :func:`commfuse.fuzz.forced.register_forced_passes`).
- Guarantees: those of ``schedule_overlap`` except the kept issue order: a pure reorder
  (values bitwise equal), every dependency respected, decided from the graph only.

Source: Centauri §3.2.2 (Eq. 1).
"""

from __future__ import annotations

from commfuse.passmgr.base import FuzzSpec
from commfuse.transforms.schedule_overlap import ScheduleOverlap


class ScheduleOverlapLayerForced(ScheduleOverlap):
    __doc__ = __doc__
    name = "schedule_overlap_layer_forced"
    gated = False  # forced: applies its rewrite whatever the prediction (what it exists for)
    # Re-chains collectives inside a layer (Eq. 1), so the issue order may change; values may not.
    fuzz = FuzzSpec(exact=True)
    force_layer_level = True
