"""The cost estimator a pass decides with: one per graph, from the topology only.

Partition and scheduling passes compare candidate rewrites by predicted time. The
estimator must be a deterministic function of what every rank shares (the
topology in the config or from ``commfuse.setup``), never of local timings, so
all ranks pick the same rewrite. GPU topologies are priced as NCCL, CPU ones
(``num_sms == 0``) as gloo; both with the topology's nominal link figures.
"""

from __future__ import annotations

from typing import Optional

from commfuse.costmodel.analytic import AnalyticCostModel
from commfuse.passes.context import PassContext

ESTIMATOR_KEY = "cost_estimator"


def backend_of(ctx: PassContext) -> str:
    topo = ctx.topology
    return "nccl" if topo is not None and topo.is_gpu else "gloo"


def estimator_for(ctx: PassContext) -> Optional[AnalyticCostModel]:
    """The graph's estimator (None without a topology: callers refuse with "no topology").

    Cached as an analysis (rebuilt after a change, which is cheap: it holds no per-node state)."""
    if ctx.topology is None:
        return None
    return ctx.analysis(ESTIMATOR_KEY, lambda _gm: AnalyticCostModel(ctx.topology, backend=backend_of(ctx)))
