"""The span of a chunked exchange: k dispatch transfers, the compute of each chunk as its
data arrives, k combine transfers.

Used to choose how many chunks an expert exchange is cut into (Centauri's workload partition,
ASPLOS '24 §3.1, applied to the MoE dispatch / expert compute / combine) and to price an op
that runs such a pipeline inside its kernel (``commfuse::moe_layer`` with ``chunks``).
"""

from __future__ import annotations


def pipeline_us(
    dispatch_us: float, compute_us: float, combine_us: float, k: int, tail_us: float = 0.0
) -> float:
    """Predicted span of the exchange cut into k even chunks (k = 1: the unpartitioned
    exchange); see :func:`chunk_pipeline_us`."""
    return chunk_pipeline_us([dispatch_us] * k, [compute_us / k] * k, [combine_us] * k, tail_us)


def chunk_pipeline_us(
    dispatch: list[float], compute: list[float], combine: list[float], tail_us: float = 0.0
) -> float:
    """Predicted span of a chunked exchange with per-chunk dispatch, compute and combine times:
    the dispatches queue on one communication stream, chunk i's compute starts when its
    dispatch arrived and chunk i-1's compute ended, its combine queues behind the earlier
    transfers; ``tail_us`` of compute follows the last chunk's, under the last combines."""
    comm_end, arrived = 0.0, []
    for d in dispatch:
        comm_end += d
        arrived.append(comm_end)
    comp_end = 0.0
    for a, w, b in zip(arrived, compute, combine, strict=True):
        comp_end = max(comp_end, a) + w
        comm_end = max(comm_end, comp_end) + b
    return max(comm_end, comp_end + tail_us)


__all__ = ["chunk_pipeline_us", "pipeline_us"]
