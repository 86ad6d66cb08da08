"""The "simulated step time (DGX-H100 x2)" column: a baseline's executed graphs, priced on GPUs.

What the number is
    The forward and backward graphs the baseline executed on this CPU run (the
    same graphs its collective columns count: for commfuse baselines the graphs
    the pipeline handed to the inner compiler, for Inductor the post-grad graphs,
    for eager the AOT-captured ones), with their shapes and dtypes *as captured*
    (the workload's small CPU sizes, one rank's shard), simulated by
    :func:`commfuse.costmodel.step.predict_step` with the *analytic* model of
    ``Topology.preset("dgx-h100", num_nodes=2)`` and backend NCCL:

    * compute: roofline per ATen op against one H100 (fp32 non-tensor-core peak
      for fp32 graphs, HBM bandwidth), no calibration, no launch overhead;
    * collectives: NCCL ring/tree/... times over the group *as in the graph*: the
      run's ranks (0..world-1 of a 2- or 4-rank CPU run) are placed on the
      preset's ranks of the same numbers, i.e. inside the first DGX node on
      NVLink; the second node is only used by groups that reach rank 8;
    * the schedule: the graph's own order, one compute stream, one NCCL stream
      per process group, waits block (the simulator's execution model);
    * step = forward makespan + backward makespan, summed over every graph the
      baseline compiled (graph breaks give several pairs); no CPU runtime terms
      (the preset has none: host work overlaps the GPU).

    So it answers "how long would these exact graphs take on H100s", not "how
    long would this model take at a GPU-sized shape"; at the CPU sizes it is
    latency-bound (NCCL launch/hop latencies dominate). It is ``None`` (printed
    as ``n/a``) when the baseline's graphs are unavailable or hold c10d ops the
    IR does not recognise (their time could not be counted).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TOPOLOGY_PRESET = "dgx-h100"
NUM_NODES = 2

__all__ = ["NUM_NODES", "TOPOLOGY_PRESET", "simulate_dgx_step"]


def simulate_dgx_step(graphs: Sequence[Any]) -> tuple[float | None, str]:
    """``(step time in us, note)`` for ``graphs`` (``CompiledGraph``s: ``.kind``, ``.gm``).

    ``None`` with the reason in the note when no forward/backward graph is given or
    one of them holds c10d ops the collective IR does not know."""
    from benchmarks.measure import EXECUTED_GRAPHS, _unrecognised
    from commfuse.costmodel import AnalyticCostModel, Topology
    from commfuse.costmodel.step import predict_step

    executed = [g for g in graphs if g.kind in EXECUTED_GRAPHS]
    if not executed:
        return None, "no executed graphs captured"
    unknown: dict[str, int] = {}
    for g in executed:
        for op, n in _unrecognised(g.gm).items():
            unknown[op] = unknown.get(op, 0) + n
    if unknown:
        return None, f"graphs hold c10d ops the IR does not recognise: {sorted(unknown)}"
    model = AnalyticCostModel(Topology.preset(TOPOLOGY_PRESET, num_nodes=NUM_NODES), backend="nccl")
    # Every graph compiled runs once per step (a model with graph breaks has several
    # forward/backward pairs); they run one after the other.
    named: dict[str, Any] = {}
    for i, g in enumerate(executed):
        named[g.kind if g.kind not in named else f"{g.kind}#{i}"] = g.gm
    pred = predict_step(named, model)
    parts = ", ".join(f"{k} {v.makespan_us:.1f} us" for k, v in pred.graphs.items())
    return pred.total_us, f"{TOPOLOGY_PRESET} x{NUM_NODES}, analytic NCCL model: {parts}"
