"""What ``commfuse::moe_layer`` and its backward take on one rank, for the cost model.

The op computes and communicates inside its kernel, so the cost model asks it
(:func:`commfuse.costmodel.analytic.register_op_time`) instead of pricing it as an unknown op:

* compute: the router (``2 T H E`` FLOPs forward, 3 times that backward) and the experts at
  balanced routing, each rank's experts seeing ``T * k`` rows: SwiGLU's 3 matmuls forward
  (``2 T k H F`` FLOPs each), 9 backward (the forward recomputed, the input gradient's and the
  weight gradients' products), on the compute model as one matmul-family op;
* communication: the transfers of :mod:`.comm_volume` on the collective model -- the counts
  exchange (dropless), then the dispatch and the combine;
* together: ``counts + pipeline_us(dispatch, compute, combine, k)``, ``k`` the op's token chunks
  (1: each transfer waited for before the compute that needs it, as the kernel does; more: the
  compute slowed by the contention model, as it runs beside the other chunks' transfers).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.fx as fx

from commfuse.costmodel.analytic import register_op_time
from commfuse.costmodel.compute import OpCost
from commfuse.costmodel.pipeline import pipeline_us
from commfuse.ir.shapes import shape_of
from commfuse.ops.moe_layer.comm_volume import node_transfers
from commfuse.ops.moe_layer.op import MOE_LAYER, MOE_LAYER_BACKWARD, MoeOperands


def compute_cost(node: fx.Node) -> Optional[OpCost]:
    """The router's and the experts' work of one call (None without shapes)."""
    ops = MoeOperands.of(node)
    x, top_k = ops.x, ops.top_k
    shapes = shape_of(x), shape_of(ops.router_w), shape_of(ops.w1)
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if any(s is None for s in shapes) or not isinstance(val, torch.Tensor):
        return None
    if not all(isinstance(d, int) for shape in shapes for d in shape):
        return None  # symbolic sizes: their hints are rank-local; priced as an unknown op
    x_shape, (experts, hidden), (local, _, ffn) = shapes
    tokens = math.prod(x_shape[:-1])
    rows = tokens * top_k
    matmuls, router = (9, 3) if ops.backward else (3, 1)
    flops = matmuls * 2 * rows * hidden * ffn + router * 2 * tokens * hidden * experts
    elt = val.element_size()
    nbytes = elt * (rows * 2 * (hidden + ffn) + 3 * local * hidden * ffn + 2 * tokens * hidden)
    dtype = "bf16" if val.dtype in (torch.bfloat16, torch.float16) else "fp32"
    return OpCost(flops, nbytes, "matmul", dtype, tokens * hidden)


def compute_us(model: Any, node: fx.Node) -> float:
    cost = compute_cost(node)
    return (model.compute.estimate(node) if cost is None else model.compute.estimate_cost(cost)).time_us


def time_us(model: Any, node: fx.Node, chunks: Optional[int] = None) -> float:
    """The call's time on ``model`` (an :class:`~commfuse.costmodel.analytic.AnalyticCostModel`),
    its exchange cut into ``chunks`` (default: the node's). Cut, the experts compute while other
    chunks' rows are on the wire, slowed as the contention model says (gloo: its threads take
    the same cores, ``1 + kappa``; NCCL: the channels' SMs and memory traffic)."""
    cost = compute_cost(node)
    if cost is None:  # no static shapes: priced as an unknown op, the transfers not at all
        return model.compute.estimate(node).time_us
    est = model.compute.estimate_cost(cost)
    compute = est.time_us
    transfers = node_transfers(node, chunks=chunks)  # None: the node's own
    if not transfers:
        return compute
    extra = model.runtime.collective_in_graph_us or 0.0

    def wire_us(t) -> float:  # an empty exchange still pays the call's latency
        return model.collectives.time(t.kind, max(t.logged_bytes, 1), t.group_size).time_us + extra

    counts = sum(wire_us(t) for t in transfers if t.what == "counts")
    # k dispatch transfers, then k combines; the first chunk is the largest (tensor_split)
    ways = [t for t in transfers if t.what != "counts"]
    k = len(ways) // 2
    if k > 1:
        compute *= model.slowdown(est, ways[0])
    return counts + pipeline_us(wire_us(ways[0]), compute, wire_us(ways[k]), k)


def register() -> None:
    """Both MoE ops' times with the cost model (called by :func:`commfuse.ops.install`)."""
    register_op_time(MOE_LAYER, time_us)
    register_op_time(MOE_LAYER_BACKWARD, time_us)


__all__ = ["compute_cost", "compute_us", "register", "time_us"]
