"""The span of a chunked exchange: k dispatch transfers, the compute of each chunk as its
data arrives, k combine transfers.

Used to choose how many chunks an expert exchange is cut into (Centauri's workload partition,
ASPLOS '24 §3.1, applied to the MoE dispatch / expert compute / combine) and to price an op
that runs such a pipeline inside its kernel (``commfuse::moe_layer`` with ``chunks``).
"""

from __future__ import annotations


def pipeline_us(dispatch_us: float, compute_us: float, combine_us: float, k: int, tail_us: float = 0.0) -> float:
    """Predicted span of the chunked exchange: the k dispatches queue on one communication
    stream, chunk i's compute starts when its dispatch arrived and chunk i-1's compute ended,
    its combine queues behind the earlier transfers (k = 1: the unpartitioned exchange);
    ``tail_us`` of compute follows the last chunk's, under the last combines."""
    comm_end = 0.0
    arrived = []
    for _ in range(k):
        comm_end += dispatch_us
        arrived.append(comm_end)
    comp_end = 0.0
    for i in range(k):
        comp_end = max(comp_end, arrived[i]) + compute_us / k
        comm_end = max(comm_end, comp_end) + combine_us
    return max(comm_end, comp_end + tail_us)


__all__ = ["pipeline_us"]
