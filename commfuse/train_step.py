"""`commfuse.compile_train_step`: one joint forward+backward graph for all micro-batches of a step.

    step = commfuse.compile_train_step(model, loss_fn, microbatches=4, config=cfg)
    loss = step(x, targets=y)       # forward + loss + backward of 4 micro-batches, one graph
    optimizer.step(); optimizer.zero_grad()

Semantics (docs/train-step.md): exactly the plain gradient-accumulation loop

    total = 0
    for x_i, y_i in zip(x.tensor_split(M), y.tensor_split(M)):
        loss_i = loss_fn(model(x_i), y_i) / M      # reduction="mean" (default); "sum": no division
        loss_i.backward()                          # adds into param.grad
        total = total + loss_i.detach()
    return total

How: a Python loop over the micro-batches is compiled with `torch.compile` (Dynamo
unrolls it: one graph, parameters shared), it returns the sum of the scaled losses and
`.backward()` runs once on that sum. AOTAutograd therefore builds ONE joint graph with
every micro-batch's forward and backward; autograd sums the parameter gradients of the
micro-batches inside it (accumulation) and adds the result into `param.grad` as the loop
would. Gradient reductions that the model expresses in autograd (SimpleFSDP's
reduce_scatter / all_reduce, DTensor TP/SP collectives) are in that graph, so the
commfuse pipeline sees and may regroup all of them. `torch.autograd.grad` inside the
compiled region is not an option in torch 2.13 (Dynamo graph-breaks on it).

Every node traced for micro-batch i carries `node.meta["custom"]["commfuse_microbatch"] = i`
(`torch.fx.traceback.annotate`; AOTAutograd copies it to the forward AND backward nodes of
the joint graph, gradient-accumulation adds are left untagged): later passes (Centauri's
model level, DHelix interleaving) read it with `microbatch_of(node)`.
"""

from __future__ import annotations

import logging
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional

import torch
import torch.fx as fx
from torch.fx.traceback import annotate

from commfuse.backend import CommfuseBackend
from commfuse.config import Config
from commfuse.core.meta import MICROBATCH_META_KEY, microbatch_of
from commfuse.core.ranks import process_rank, warn_rank0
from commfuse.passmgr.report import PipelineReport
from commfuse.train_step_split import check_divisible, split_microbatches

log = logging.getLogger(__name__)

Reduction = Literal["mean", "sum"]

__all__ = ["MICROBATCH_META_KEY", "CapturedGraph", "TrainStep", "compile_train_step", "microbatch_of"]


@dataclass(frozen=True)
class CapturedGraph:
    """One graph Dynamo captured for the step (more than one per call means graph breaks)."""

    index: int
    num_nodes: int
    # Nodes per micro-batch tag: every micro-batch present, with equal counts, shows the
    # whole step is in this graph.
    nodes_per_microbatch: dict[int, int] = field(default_factory=dict)
    # call_function / call_method / call_module targets -> count (e.g. "linear": 2*M per layer).
    op_counts: dict[str, int] = field(default_factory=dict)


def _target_name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _summarise(index: int, gm: fx.GraphModule) -> CapturedGraph:
    per_mb: Counter[int] = Counter()
    ops: Counter[str] = Counter()
    for n in gm.graph.nodes:
        mb = microbatch_of(n)
        if mb is not None:
            per_mb[mb] += 1
        if n.op in ("call_function", "call_method", "call_module"):
            ops[_target_name(n)] += 1
    return CapturedGraph(
        index=index,
        num_nodes=len(gm.graph.nodes),
        nodes_per_microbatch=dict(sorted(per_mb.items())),
        op_counts=dict(sorted(ops.items())),
    )


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    # Dynamo caches compiled graphs on the code object, at most `recompile_limit` (8) per code
    # object, and every TrainStep's backend differs: with one shared code object the 9th step
    # in a process would silently run eagerly. A private copy of the code gives each step its
    # own cache.
    return types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )


class TrainStep:
    """A compiled training step; call it with the whole step's batch. See `compile_train_step`."""

    def __init__(
        self,
        model: Callable[..., Any],
        loss_fn: Callable[..., torch.Tensor],
        *,
        microbatches: int,
        config: Optional[Config],
        reduction: Reduction,
        fullgraph: bool,
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self.reduction = reduction
        self.backend = CommfuseBackend(config)
        self.graphs: list[CapturedGraph] = []
        self._graphs_last_compile = 0
        self._warned_eager = False
        self._compiled = torch.compile(
            _own_code(self._make_loop()), backend=self._capture, fullgraph=fullgraph
        )

    # -- what the compiler saw ------------------------------------------------
    @property
    def config(self) -> Config:
        return self.backend.config

    @property
    def reports(self) -> list[PipelineReport]:
        """The pipeline's reports, one per graph compiled (joint, forward, backward), in order.

        With Inductor, graphs served from its FX-graph cache are not re-optimised and add none."""
        return self.backend.reports

    @property
    def graph_count(self) -> int:
        """Dynamo graphs the step was captured as at its latest compilation (1 = no graph break)."""
        return self._graphs_last_compile

    def _capture(self, gm: fx.GraphModule, example_inputs: list[torch.Tensor]):
        self.graphs.append(_summarise(len(self.graphs), gm))
        return self.backend(gm, example_inputs)

    # -- the step ---------------------------------------------------------------
    def _make_loop(self) -> Callable[[tuple[Any, ...], Any], torch.Tensor]:
        # A closure over plain values, so Dynamo guards on them and nothing else.
        model, loss_fn, m = self.model, self.loss_fn, self.microbatches
        scale = m if self.reduction == "mean" else 1

        def accumulate(inputs: tuple[Any, ...], targets: Any) -> torch.Tensor:
            xs = split_microbatches(inputs, m)
            ys = split_microbatches(targets, m) if targets is not None else [None] * m
            total = None
            for i in range(m):
                with annotate({MICROBATCH_META_KEY: i}):
                    out = model(*xs[i])
                    loss = loss_fn(out) if targets is None else loss_fn(out, ys[i])
                    if scale != 1:
                        loss = loss / scale
                # Summed in micro-batch order: the loop's `total + loss_i.detach()`, same rounding.
                total = loss if total is None else total + loss
            return total

        return accumulate

    def __call__(self, *inputs: Any, targets: Any = None) -> torch.Tensor:
        """Run forward, loss and backward of every micro-batch; gradients are ADDED to `param.grad`
        (like `.backward()`; zero them between steps). Returns the detached step loss (mean of the
        micro-batch losses with reduction="mean", their sum with "sum")."""
        if not inputs:
            raise ValueError(
                "TrainStep needs at least one model input (positional) to split into micro-batches"
            )
        check_divisible("inputs", inputs, self.microbatches)
        if targets is not None:
            check_divisible("targets", targets, self.microbatches)
        before = len(self.graphs)
        total = self._compiled(inputs, targets)
        compiled_now = len(self.graphs) - before
        if compiled_now:
            self._graphs_last_compile = compiled_now
            if compiled_now > 1:
                msg = (
                    f"compile_train_step: the step was captured as {compiled_now} graphs (graph breaks), so its "
                    f"{self.microbatches} micro-batches are not in one joint graph; results still match the "
                    f"plain loop. Find the breaks with torch._dynamo.explain or fullgraph=True."
                )
                _warn_once_for_all_ranks(msg)
        if not self.graphs and not self._warned_eager:
            self._warned_eager = True
            msg = (
                "compile_train_step: Dynamo compiled no graph for the step, it runs eagerly (see the "
                "torch._dynamo warnings above, e.g. a recompile limit); results still match the plain loop"
            )
            _warn_once_for_all_ranks(msg)
        if not isinstance(total, torch.Tensor) or total.dim() != 0:
            raise ValueError(
                f"loss_fn must return a scalar tensor, got "
                f"{type(total).__name__ if not isinstance(total, torch.Tensor) else list(total.shape)}"
            )
        if not total.requires_grad:
            raise RuntimeError(
                "the step's loss does not require grad: no parameter of the model takes part in "
                "the loss (frozen model, or loss_fn detached the output)"
            )
        total.backward()
        return total.detach()


def _warn_once_for_all_ranks(msg: str) -> None:
    """Graph breaks are the same on every rank (same program, same Dynamo): rank 0 says so."""
    if process_rank() in (None, 0):
        log.warning(msg)
    warn_rank0(msg, UserWarning, stacklevel=3)  # points at the caller of TrainStep.__call__


def compile_train_step(
    model: Callable[..., Any],
    loss_fn: Callable[..., torch.Tensor],
    *,
    microbatches: int,
    config: Optional[Config] = None,
    reduction: Reduction = "mean",
    fullgraph: bool = False,
) -> TrainStep:
    """Compile forward + loss + backward of `microbatches` micro-batches into one joint graph.

    `step = compile_train_step(model, loss_fn, microbatches=M)`; `step(*inputs, targets=t)` splits
    every tensor in `inputs` and `targets` along dim 0 into M equal micro-batches, calls
    `loss_fn(model(*inputs_i), targets_i)` (or `loss_fn(model(*inputs_i))` without targets), divides
    each loss by M (`reduction="mean"`; `"sum"` leaves it, for losses already normalised by the
    step's token count), back-propagates all of them in one compiled graph and adds the gradients
    into `param.grad` exactly as the plain accumulation loop would. The optimizer is not included.

    `config`: the commfuse `Config` of the backend (default pipeline, Inductor by default).
    `fullgraph=True` makes a graph break an error; otherwise it warns and the step still runs.
    """
    if isinstance(microbatches, bool) or not isinstance(microbatches, int):
        raise TypeError(f"microbatches must be an int >= 1, got {microbatches!r}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    if not callable(model):
        raise TypeError(f"model must be callable (an nn.Module), got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a commfuse.Config or None, got {type(config).__name__}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    return TrainStep(
        model, loss_fn, microbatches=microbatches, config=config, reduction=reduction, fullgraph=fullgraph
    )
