"""`PipelineRunner`: run this rank's stage of a traced, partitioned pipeline with GPipe or 1F1B.

    layout = commfuse.pipeline.setup_pipeline([[0, 1], [2, 3]])
    runner = commfuse.pipeline.PipelineRunner(layout, stages, loss_fn, microbatches=4, schedule="1f1b")
    loss = runner.step(x, target)          # every rank; the loss on the last stage, None elsewhere
    optimizer.step(); optimizer.zero_grad()

Contract
- ``stages``: the whole model as one module per stage, built identically on every rank
  (same seed) and sharded for this rank's *position* (a rank's copies of other stages are
  the shapes of its peers at that position and are never read). ``loss_fn(out, target)``
  returns the last stage's scalar loss for one micro-batch.
- ``step(x, target)`` on every rank: ``x`` and ``target`` have the same shapes on every
  rank (values are read only where used: ``x`` on stage 0, ``target`` on the last stage)
  and are cut into ``microbatches`` equal pieces along dim 0. Semantics are exactly the
  plain accumulation loop run on the whole model::

      for x_i, t_i in zip(x.tensor_split(M), target.tensor_split(M)):
          (loss_fn(model(x_i), t_i) / M).backward()     # reduction="mean"; "sum": no division

  gradients are added into ``param.grad`` of this rank's stage, micro-batch by micro-batch
  in ascending order (what ``.backward()`` in the loop does); parameters of other stages
  are untouched. Returns the loop's total ``sum_i loss_i / M`` on the last stage, None on
  other stages. Modules and their ``state_dict`` are not modified.
- First call (and whenever the micro-batch shapes change): trace the forward graph
  (:func:`trace_forward`), run ``forward_passes`` on it (each gets the
  :class:`PipelineProgram`; the seam where boundary-fusion passes rewrite the forward
  graph), derive the joint graph (:func:`trace_joint`), partition it
  (:func:`partition`), and dump every graph to ``dump_dir/rank<r>/`` when given. Every
  rank does this on fake tensors; nothing communicates.
- Execution: the actions of :func:`stage_actions` run this stage's parts eagerly; a part
  runs with no autograd (the backward is in the graph). Saved forward values are kept per
  micro-batch until its backward ran. A part's sends are posted and *not* waited
  (they are waited once all actions have run): waiting a send before the next receive
  could block both neighbours on backends whose sends complete only when received
  (NCCL, large gloo messages); with non-blocking sends the 1F1B/GPipe orders are
  deadlock-free (:func:`check_schedule`). Receives are waited inside the part, before use.
  Boundary transfers are point-to-point (``commfuse::stage_transfer``), matched per pair
  of ranks in posting order; both sides of a boundary post them in micro-batch order.

Source: GPipe (Huang et al. 2019) and 1F1B (Narayanan et al. 2021), as in :mod:`.schedule`.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn as nn

from commfuse.core.dump_layout import rank_dump_dir, update_dump_index
from commfuse.pipeline.layout import PipelineLayout
from commfuse.pipeline.partition import (
    BW,
    FW,
    PartitionedProgram,
    StagePart,
    partition,
    wait_pending,
    write_dumps,
)
from commfuse.pipeline.schedule import SCHEDULES, Action, check_schedule, stage_actions
from commfuse.pipeline.trace import (
    BUFFER,
    GRAD_SEED,
    PARAM,
    TARGET,
    PipelineProgram,
    X,
    collect_inputs,
    trace_forward,
    trace_joint,
)

ForwardPass = Callable[[PipelineProgram], None]


class PipelineRunner:
    """See the module docstring."""

    def __init__(
        self,
        layout: PipelineLayout,
        stages: Sequence[nn.Module],
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        microbatches: int,
        schedule: str = "1f1b",
        *,
        reduction: str = "mean",
        dump_dir: Optional[Union[str, os.PathLike]] = None,
        forward_passes: Sequence[ForwardPass] = (),
    ) -> None:
        if not isinstance(layout, PipelineLayout):
            raise TypeError(
                f"layout: expected the PipelineLayout setup_pipeline returns, got {type(layout).__name__}"
            )
        stages = list(stages)
        if len(stages) != layout.num_stages:
            raise ValueError(f"stages: the layout has {layout.num_stages} stages, got {len(stages)} modules")
        for s, m in enumerate(stages):
            if not isinstance(m, nn.Module):
                raise TypeError(f"stages[{s}]: expected an nn.Module, got {type(m).__name__}")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable: loss_fn(out, target) -> scalar tensor")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction: expected 'mean' or 'sum', got {reduction!r}")
        self.actions: list[Action] = stage_actions(schedule, layout.num_stages, layout.stage, microbatches)
        # the same check on every rank, from arguments every rank shares
        check_schedule(
            [stage_actions(schedule, layout.num_stages, s, microbatches) for s in range(layout.num_stages)]
        )
        self.layout, self.stages, self.loss_fn = layout, stages, loss_fn
        self.microbatches, self.schedule, self.reduction = microbatches, schedule, reduction
        self.dump_dir = dump_dir
        self.forward_passes = list(forward_passes)
        self.program: Optional[PipelineProgram] = None
        self.parted: Optional[PartitionedProgram] = None
        self._key: Any = None

    # ------------------------------------------------------------------ build
    def _split(self, t: Any, what: str) -> list[torch.Tensor]:
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"{what}: expected a tensor on every rank (same shape everywhere; its values are "
                f"only read where used), got {type(t).__name__}"
            )
        if t.dim() == 0 or t.shape[0] % self.microbatches:
            raise ValueError(
                f"{what}: dim 0 (size {tuple(t.shape)[:1]}) must split into {self.microbatches} "
                "equal micro-batches"
            )
        return list(t.tensor_split(self.microbatches))

    def build(self, x_mb: torch.Tensor, target_mb: torch.Tensor) -> PartitionedProgram:
        """Trace, rewrite, derive the joint graph and partition it for micro-batches like these."""

        program = trace_forward(self.layout, self.stages, self.loss_fn, x_mb, target_mb)
        for p in self.forward_passes:
            p(program)
            program.forward.recompile()
        _, tensors = collect_inputs(self.stages)
        trace_joint(program, [*tensors, x_mb, target_mb])
        parted = partition(program)
        if self.dump_dir is not None:
            top, mine = rank_dump_dir(self.dump_dir, self.layout.rank)
            write_dumps(mine, program, parted)
            update_dump_index(top, self.layout.rank, self.layout.world_size)
        self.program, self.parted = program, parted
        return parted

    # ------------------------------------------------------------------ run
    def _tensor(self, spec_index: int, i: int, xs, ts, seed) -> torch.Tensor:
        spec = self.program.joint_inputs[spec_index]
        if spec.kind == PARAM:
            return self.stages[spec.stage].get_parameter(spec.local_name).detach()
        if spec.kind == BUFFER:
            return self.stages[spec.stage].get_buffer(spec.local_name)
        if spec.kind == X:
            return xs[i]
        if spec.kind == TARGET:
            return ts[i]
        if spec.kind == GRAD_SEED:
            return seed
        raise AssertionError(spec.kind)

    def _run(self, part: StagePart, i: int, xs, ts, seed, saved: dict[int, dict[str, torch.Tensor]]) -> list:
        args = [
            self._tensor(inp.key, i, xs, ts, seed) if inp.kind == "input" else saved[i][inp.key]
            for inp in part.inputs
        ]
        with torch.no_grad():
            outs = part.gm(*args)
        return list(outs)

    def step(self, x: torch.Tensor, target: torch.Tensor) -> Optional[torch.Tensor]:
        xs, ts = self._split(x, "x"), self._split(target, "target")
        key = (tuple(xs[0].shape), xs[0].dtype, tuple(ts[0].shape), ts[0].dtype)
        if self.parted is None or key != self._key:
            self.build(xs[0], ts[0])
            self._key = key
        s, m = self.layout.stage, self.microbatches
        fw, bw = self.parted.part(s, FW), self.parted.part(s, BW)
        loss_dtype = self.program.joint.graph.find_nodes(op="placeholder")[-1].meta["val"].dtype
        seed = (
            torch.ones((), dtype=loss_dtype) / m
            if self.reduction == "mean"
            else torch.ones((), dtype=loss_dtype)
        )
        saved: dict[int, dict[str, torch.Tensor]] = {}
        pending: list[torch.Tensor] = []
        losses: dict[int, torch.Tensor] = {}
        params = {n: p for n, p in self.stages[s].named_parameters()}
        for a in self.actions:
            i = a.microbatch
            if a.phase == "F":
                outs = self._run(fw, i, xs, ts, seed, saved)
                saved[i] = {}
                for o, v in zip(fw.outputs, outs, strict=True):
                    if o.kind == "loss":
                        losses[i] = v
                    elif o.kind == "saved":
                        saved[i][o.key] = v
                    elif o.kind == "pending":
                        pending.append(v)
            else:
                outs = self._run(bw, i, xs, ts, seed, saved)
                for o, v in zip(bw.outputs, outs, strict=True):
                    if o.kind == "grad":
                        p = params[o.key.split(".", 1)[1]]
                        if p.grad is None:
                            p.grad = v.detach().clone()
                        else:
                            p.grad.add_(v)
                    elif o.kind == "pending":
                        pending.append(v)
                del saved[i]
        for t in pending:
            wait_pending(t)
        if s != self.layout.num_stages - 1:
            return None
        total = None
        for i in range(m):
            li = losses[i].detach() / m if self.reduction == "mean" else losses[i].detach()
            total = li if total is None else total + li
        return total


__all__ = ["ForwardPass", "PipelineRunner", "SCHEDULES"]
