"""Trace the whole pipelined model on every rank: one FORWARD graph, then the JOINT graph.

Contract
- :func:`trace_forward` traces ``loss_fn(stage_{S-1}(T(... T(stage_0(x)) ...)), target)``
  for ONE micro-batch with ``make_fx(tracing_mode="fake", pre_dispatch=True)``, where
  ``T`` is ``commfuse::stage_transfer_autograd`` on boundary group ``b`` with
  ``src``/``dst`` = positions of stages b / b+1 (:meth:`PipelineLayout.boundary_pairs`).
  Every rank traces every stage, with the parameters and buffers of every stage as
  graph inputs (every rank builds the full model from one seed; its copies of other
  stages' weights are only shapes here and are never read at run time). A stage this
  rank does not run is traced "as" its peer at the same position: the stage modules a
  rank builds are sharded for its own position, which is the peer's, and the trace runs
  under ``commfuse.ops.trace_position(None, position)`` so boundary ops whose output
  shape depends on the receiving member (m2ms) take the peer's shape.
- The forward graph keeps the collectives at the autograd level
  (``_c10d_functional_autograd.*``, ``commfuse::copy_to_group`` /
  ``reduce_from_group``, ``commfuse::stage_transfer_autograd`` / ``m2ms_autograd``): it is
  what boundary-fusion passes rewrite; the backward follows from autograd.
- :func:`trace_joint` derives the joint graph from a forward GraphModule (rewritten or
  not): ``make_fx(tracing_mode="fake")`` of "run the forward graph, then
  ``torch.autograd.grad(loss, params, grad_outputs=grad_seed)``", with
  :data:`JOINT_DECOMPOSITIONS` applied below autograd: f/g and the autograd collectives
  become ``_c10d_functional`` ops + ``wait_tensor``; the synchronous boundary ops become
  their asynchronous forms + ``wait_tensor`` (so the runner can wait a send late, see
  runner.py). Its inputs are the forward's plus ``grad_seed`` (the scale of the
  micro-batch loss); outputs ``(loss, *grads)`` for the parameters that require grad.
- Nothing here creates or resolves a process group; everything runs on fake tensors.

Source: torchtitan graph_pp (prior art: per-stage graphs
driven by torch.distributed.pipelining's runtime, transfers outside the graphs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from commfuse.core.torch_private import c10d_functional
from commfuse.ops import M2MS, M2MS_AUTOGRAD, STAGE_TRANSFER, STAGE_TRANSFER_AUTOGRAD, trace_position
from commfuse.pipeline.collectives import JOINT_DECOMPOSITIONS
from commfuse.pipeline.layout import PipelineLayout

# input kinds
PARAM, BUFFER, X, TARGET, GRAD_SEED = "param", "buffer", "x", "target", "grad_seed"


@dataclass(frozen=True)
class InputSpec:
    """One graph input: what it is and which stage owns it."""

    kind: str  # param | buffer | x | target | grad_seed
    stage: int
    name: str  # "stage1.w1" for parameters and buffers (module-relative name after the dot)
    requires_grad: bool = False

    @property
    def local_name(self) -> str:
        return self.name.split(".", 1)[1] if self.kind in (PARAM, BUFFER) else self.name


@dataclass
class PipelineProgram:
    """The traced programs of one pipeline (same on every rank up to its position's shapes)."""

    layout: PipelineLayout
    forward: fx.GraphModule  # inputs: `inputs` -> loss
    inputs: list[InputSpec]
    joint: Optional[fx.GraphModule] = None  # inputs: `joint_inputs` -> (loss, *grads)
    joint_inputs: list[InputSpec] = field(default_factory=list)
    grad_names: list[str] = field(default_factory=list)  # parameter name of each grad output, in order


def _boundary_ops_lowered() -> dict:
    def _st(x, src, dst, group_size, group_name):
        return c10d_functional.wait_tensor(STAGE_TRANSFER(x, src, dst, group_size, group_name))

    def _m2ms(x, dim, splits, src, dst, group_size, group_name):
        return c10d_functional.wait_tensor(M2MS(x, dim, splits, src, dst, group_size, group_name))

    return {STAGE_TRANSFER_AUTOGRAD: _st, M2MS_AUTOGRAD: _m2ms}


def joint_decompositions() -> dict:
    """The decomposition table :func:`trace_joint` applies (below autograd)."""
    return {**JOINT_DECOMPOSITIONS, **_boundary_ops_lowered()}


def collect_inputs(stages: Sequence[nn.Module]) -> tuple[list[InputSpec], list[torch.Tensor]]:
    """Parameters and buffers of every stage (stage order, then module order), then x, target."""
    specs: list[InputSpec] = []
    tensors: list[torch.Tensor] = []
    for s, mod in enumerate(stages):
        if not isinstance(mod, nn.Module):
            raise TypeError(f"stages[{s}]: expected an nn.Module, got {type(mod).__name__}")
        for name, p in mod.named_parameters():
            specs.append(InputSpec(PARAM, s, f"stage{s}.{name}", p.requires_grad))
            tensors.append(p)
        for name, b in mod.named_buffers():
            specs.append(InputSpec(BUFFER, s, f"stage{s}.{name}"))
            tensors.append(b)
    last = len(stages) - 1
    specs += [InputSpec(X, 0, X), InputSpec(TARGET, last, TARGET)]
    return specs, tensors


def _transfer(h: Any, layout: PipelineLayout, b: int) -> Any:
    src, dst = layout.boundary_pairs(b)
    g = layout.boundaries[b]

    def one(t):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"stage {b} returned a {type(t).__name__}; stage outputs must be tensors "
                "(or tuples/lists of tensors)"
            )
        return STAGE_TRANSFER_AUTOGRAD(t, src, dst, g.size, g.name)

    # one transfer per tensor of a tuple/list output; the next stage gets them as arguments
    return tuple(one(t) for t in h) if isinstance(h, (tuple, list)) else one(h)


def forward_function(
    layout: PipelineLayout,
    stages: Sequence[nn.Module],
    specs: list[InputSpec],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
) -> Callable[..., torch.Tensor]:
    """The whole model for one micro-batch as a function of the flat inputs ``specs``."""
    from torch.func import functional_call

    num = len(stages)

    def whole_model(*flat: torch.Tensor) -> torch.Tensor:
        per_stage: list[dict[str, torch.Tensor]] = [{} for _ in range(num)]
        x = target = None
        for spec, t in zip(specs, flat, strict=True):
            if spec.kind in (PARAM, BUFFER):
                per_stage[spec.stage][spec.local_name] = t
            elif spec.kind == X:
                x = t
            elif spec.kind == TARGET:
                target = t
        h: Any = x
        for s, mod in enumerate(stages):
            if s > 0:
                h = _transfer(h, layout, s - 1)
            args = tuple(h) if isinstance(h, (tuple, list)) else (h,)
            h = functional_call(mod, per_stage[s], args)
        loss = loss_fn(h, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(
                f"loss_fn must return a scalar tensor, got {getattr(loss, 'shape', type(loss).__name__)}"
            )
        return loss

    return whole_model


def trace_forward(
    layout: PipelineLayout,
    stages: Sequence[nn.Module],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    target: torch.Tensor,
) -> PipelineProgram:
    """The forward graph of one micro-batch (``x``, ``target``: micro-batch shaped examples)."""
    if len(stages) != layout.num_stages:
        raise ValueError(f"stages: the layout has {layout.num_stages} stages, got {len(stages)} modules")
    specs, tensors = collect_inputs(stages)
    fn = forward_function(layout, stages, specs, loss_fn)
    with trace_position(None, layout.position):
        gm = make_fx(fn, tracing_mode="fake", pre_dispatch=True)(*tensors, x, target)
    return PipelineProgram(layout, gm, specs)


def trace_joint(program: PipelineProgram, example_inputs: Sequence[torch.Tensor]) -> PipelineProgram:
    """Derive the joint graph from ``program.forward`` (fills ``joint``, ``joint_inputs``,
    ``grad_names``). ``example_inputs``: tensors for ``program.inputs`` (shapes/dtypes)."""
    specs = program.inputs
    fwd = program.forward
    if len(example_inputs) != len(specs):
        raise ValueError(
            f"example_inputs: expected {len(specs)} tensors (program.inputs), got {len(example_inputs)}"
        )
    diff_idx = [i for i, s in enumerate(specs) if s.kind == PARAM and s.requires_grad]
    last = program.layout.num_stages - 1
    used: list[int] = []

    def joint(*flat: torch.Tensor):
        *inputs, seed = flat
        with torch.enable_grad():
            loss = fwd(*inputs)
            grads = torch.autograd.grad(
                loss, [inputs[i] for i in diff_idx], grad_outputs=seed, allow_unused=True
            )
        used[:] = [i for i, g in zip(diff_idx, grads, strict=True) if g is not None]
        return (loss, *[g for g in grads if g is not None])

    args = []
    for i, t in enumerate(example_inputs):
        t = t.detach()
        if i in diff_idx:
            t = t.requires_grad_(True)
        args.append(t)
    seed = torch.ones((), dtype=_loss_dtype(fwd))
    with trace_position(None, program.layout.position):
        gm = make_fx(joint, tracing_mode="fake", decomposition_table=joint_decompositions())(*args, seed)
    program.joint = gm
    program.joint_inputs = list(specs) + [InputSpec(GRAD_SEED, last, GRAD_SEED)]
    program.grad_names = [specs[i].name for i in used]
    return program


def _loss_dtype(gm: fx.GraphModule) -> torch.dtype:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    val = out.args[0]
    val = val[0] if isinstance(val, (tuple, list)) else val
    v = val.meta.get("val") if isinstance(val, fx.Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else torch.float32


__all__ = [
    "BUFFER",
    "GRAD_SEED",
    "InputSpec",
    "PARAM",
    "PipelineProgram",
    "TARGET",
    "X",
    "collect_inputs",
    "forward_function",
    "joint_decompositions",
    "trace_forward",
    "trace_joint",
]
