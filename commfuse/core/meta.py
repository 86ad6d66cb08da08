"""Every key commfuse reads or writes in ``node.meta`` / ``gm.meta``, and their readers.

A key is a contract between the layer that writes it and the layer that reads it (a pass
writes a stream hint, the lowering reads it), so each is defined once, here, below both.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

# node.meta["custom"][MICROBATCH_META_KEY]: the micro-batch a node of a compile_train_step graph
# was traced for.
MICROBATCH_META_KEY = "commfuse_microbatch"
# node.meta: "forward" / "backward" for the nodes of a fused train-step graph.
PHASE_META_KEY = "commfuse_phase"
# gm.meta: True on the one graph that holds a whole fused train step.
FUSED_GRAPH_META_KEY = "commfuse_fused_step"
# node.meta: the side compute stream a pass chose for a node (0 or absent: the default stream).
STREAM_META = "commfuse_stream"
# node.meta: a barrier label; consecutive nodes with one label form one interval the lowering orders.
BARRIER_META = "commfuse_barrier"
# start-node meta of a collective: the communicator setting Lagom chose (a plain dict).
SETTING_META = "commfuse_comm_setting"
# start-node meta of a collective: the DHelix segment kind of its communication.
DHELIX_COMM_META = "commfuse_dhelix_comm"
# gm.meta: the PipelineLayout of a pipeline-parallel forward graph, for boundary fusion.
LAYOUT_META_KEY = "commfuse.pipeline_layout"
# gm.meta: the PipelineReports of every pipeline run on the graph, oldest first.
REPORTS_META = "commfuse_reports"


def microbatch_of(node: fx.Node) -> Optional[int]:
    """The micro-batch a node of a `compile_train_step` graph was traced for (None: shared, e.g.
    parameters, gradient accumulation, the loss sum, or nodes a pass created without the tag)."""
    if node.op in ("placeholder", "output", "get_attr"):
        # Dynamo lifts a parameter where it is first read, i.e. inside micro-batch 0's tag.
        return None
    custom = node.meta.get("custom")
    return custom.get(MICROBATCH_META_KEY) if isinstance(custom, dict) else None


def stream_hint(node: fx.Node) -> int:
    """The compute stream a pass assigned to ``node`` (0: default); rejects a malformed hint."""
    s = node.meta.get(STREAM_META, 0)
    if not isinstance(s, int) or isinstance(s, bool) or s < 0:
        raise ValueError(f"node {node.name}: meta[{STREAM_META!r}] must be a non-negative int, got {s!r}")
    return s


__all__ = [
    "BARRIER_META",
    "DHELIX_COMM_META",
    "FUSED_GRAPH_META_KEY",
    "LAYOUT_META_KEY",
    "MICROBATCH_META_KEY",
    "PHASE_META_KEY",
    "REPORTS_META",
    "SETTING_META",
    "STREAM_META",
    "microbatch_of",
    "stream_hint",
]
