"""Rank-pool jobs for tests/test_pipeline_runner.py (module-level so the pool can pickle them)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from commfuse.models.pipeline_models import (
    PipelineModelConfig,
    build_stages,
    make_full_data,
    make_loss_fn,
    position_view,
)
from commfuse.ops.boundary import stage_transfer
from commfuse.pipeline import PipelineLayout, PipelineRunner, setup_pipeline

STAGES_2x2 = [[0, 1], [2, 3]]


def eager_pipeline_reference(
    layout: PipelineLayout,
    stages: Sequence[nn.Module],
    loss_fn,
    x: torch.Tensor,
    target: torch.Tensor,
    microbatches: int,
) -> Optional[torch.Tensor]:
    """The same stage modules run eagerly with the differentiable commfuse.ops.boundary.stage_transfer,
    one micro-batch at a time (forward, then backward). The receiver's transfer input is a
    zeros tensor that requires grad (its output then does, and its backward sends the
    gradient back); on the sender, ``autograd.backward(out, zeros)`` runs the transfer's
    backward, which RECEIVES the real gradient and continues through the stage. Stage
    outputs have the input's shape in these models (the receiver's stand-in shape)."""
    s, last = layout.stage, layout.num_stages - 1
    mod = stages[s]
    total = None
    for xi, ti in zip(x.tensor_split(microbatches), target.tensor_split(microbatches), strict=True):
        if s == 0:
            inp = xi
        else:
            src, dst = layout.boundary_pairs(s - 1)
            inp = stage_transfer(
                torch.zeros_like(xi, requires_grad=True), src, dst, layout.boundaries[s - 1].name
            )
        out = mod(inp)
        if s < last:
            src, dst = layout.boundary_pairs(s)
            sent = stage_transfer(out, src, dst, layout.boundaries[s].name)
            torch.autograd.backward(sent, torch.zeros_like(sent))
        else:
            li = loss_fn(out, ti) / microbatches
            li.backward()
            total = li.detach() if total is None else total + li.detach()
    return total


def _shapes(stages: Sequence[nn.Module]) -> list[dict[str, tuple[int, ...]]]:
    return [{k: tuple(v.shape) for k, v in st.state_dict().items()} for st in stages]


def pipeline_matches(
    kind: str,
    microbatches: Sequence[int] = (2, 4),
    schedules: Sequence[str] = ("gpipe", "1f1b"),
    batch: int = 4,
    seq: int = 8,
    dump_dir: Optional[str] = None,
    stage_ranks: Sequence[Sequence[int]] = STAGES_2x2,
) -> dict[str, Any]:
    """Run the runner for every (micro-batches, schedule) and the eager reference per micro-batch
    count; return this rank's losses, gradients and checks."""
    from commfuse.core.torch_private import resolve_process_group

    layout = setup_pipeline(stage_ranks)
    cfg = PipelineModelConfig(kind=kind, num_stages=layout.num_stages)
    n = layout.stage_size
    x_full, t_full = make_full_data(cfg, n, batch, seq)
    x, t = position_view(cfg, n, layout.position, x_full), position_view(cfg, n, layout.position, t_full)
    loss_fn = make_loss_fn(cfg, n)
    out: dict[str, Any] = {"stage": layout.stage, "position": layout.position, "runs": {}, "eager": {}}
    # aliases: this rank resolves exactly the groups it is a member of, with the layout's sizes
    out["aliases"] = {
        g.name: (resolve_process_group(g.name).size() if layout.rank in g.ranks else None)
        for g in layout.stages + layout.boundaries
    }
    for m in microbatches:
        for sched in schedules:
            stages = build_stages(cfg, layout.stages, layout.position, n)
            before = _shapes(stages)
            runner = PipelineRunner(
                layout,
                stages,
                loss_fn,
                m,
                sched,
                dump_dir=dump_dir if (m, sched) == (microbatches[0], schedules[0]) else None,
            )
            loss = runner.step(x, t)
            out["runs"][f"{m}-{sched}"] = {
                "loss": loss,
                "grads": {k: p.grad.clone() for k, p in stages[layout.stage].named_parameters()},
                "other_grads_untouched": all(
                    p.grad is None
                    for s, st in enumerate(stages)
                    if s != layout.stage
                    for p in st.parameters()
                ),
                "state_dict_unchanged": _shapes(stages) == before,
                "num_parts": len(runner.parted.parts),
            }
        stages = build_stages(cfg, layout.stages, layout.position, n)
        loss = eager_pipeline_reference(layout, stages, loss_fn, x, t, m)
        out["eager"][str(m)] = {
            "loss": loss,
            "grads": {k: p.grad.clone() for k, p in stages[layout.stage].named_parameters()},
        }
    return out
