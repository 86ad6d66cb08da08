"""commfuse's pipeline runner: the whole model traced on every rank, boundaries as graph ops.

    layout = commfuse.pipeline.setup_pipeline([[0, 1], [2, 3]])      # groups, once, every rank
    runner = commfuse.pipeline.PipelineRunner(layout, stages, loss_fn, microbatches=4)
    loss = runner.step(x, target)

* :mod:`.layout` -- ``setup_pipeline``: stage and boundary groups, aliases, the layout;
* :mod:`.collectives` -- differentiable stage collectives on a ``StageGroup`` (f/g, gather,
  scatter, all_to_all) that ranks outside the stage can trace;
* :mod:`.trace` -- the forward graph (autograd-level ops, what fusion passes rewrite) and
  the joint graph derived from it;
* :mod:`.partition` -- the joint graph cut into per-(stage, phase) parts;
* :mod:`.schedule` -- GPipe / 1F1B action lists and the deadlock check;
* :mod:`.runner` -- ``PipelineRunner``.

Design and how a ``torch.distributed.pipelining`` user adopts it: docs/pipeline.md.
"""

from __future__ import annotations

from commfuse.pipeline.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    copy_to_group,
    reduce_from_group,
    reduce_scatter,
)
from commfuse.pipeline.layout import PipelineLayout, StageGroup, plan_layout, setup_pipeline
from commfuse.pipeline.partition import PartitionedProgram, PartitionError, StagePart, partition, write_dumps
from commfuse.pipeline.runner import PipelineRunner
from commfuse.pipeline.schedule import SCHEDULES, Action, check_schedule, stage_actions
from commfuse.pipeline.trace import InputSpec, PipelineProgram, trace_forward, trace_joint

__all__ = [
    "Action",
    "InputSpec",
    "PartitionError",
    "PartitionedProgram",
    "PipelineLayout",
    "PipelineProgram",
    "PipelineRunner",
    "SCHEDULES",
    "StageGroup",
    "StagePart",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "check_schedule",
    "copy_to_group",
    "partition",
    "plan_layout",
    "reduce_from_group",
    "reduce_scatter",
    "setup_pipeline",
    "stage_actions",
    "trace_forward",
    "trace_joint",
    "write_dumps",
]
