"""Helpers shared by the example models, their tests and the example scripts.

Nothing here is specific to one model:

* deterministic weight initialisation from a seed, so that every rank builds
  the same full weights before parallelisation (and an unsharded reference
  built in another process gets them too);
* turning sharded results back into full tensors for comparisons
  (:func:`full_tensor`, :func:`all_gather_cat`);
* a graph-recording ``torch.compile`` backend built on AOTAutograd that runs
  the captured graphs eagerly (:class:`GraphRecorder`);
* picking the default backend and setting up a torchrun-launched example's ranks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
import torch.fx
import torch.nn as nn
from torch.distributed.tensor import DTensor

from commfuse.backend import commfuse_backend

__all__ = [
    "Batch",
    "GraphRecorder",
    "all_gather_cat",
    "batch_to",
    "default_backend",
    "full_tensor",
    "global_loss",
    "init_distributed",
    "init_weights_",
    "print_loss_comparison",
]


# -------------------------------------------------------------------- batches


class Batch(NamedTuple):
    """One rank's inputs and target, and how its loss relates to the global one.

    A rank's loss is ``sum(per-element loss) / loss_denominator``.
    ``loss_reduce`` says how the per-rank losses make up the global loss
    (the one the unsharded reference computes on the full batch):

    * ``"none"``: every rank already holds the global loss (replicated data);
    * ``"sum"``: the global loss is the sum of the per-rank losses (sharded
      data, ``loss_denominator`` = the global element count);
    * ``"avg"``: the global loss is their mean (DDP: each rank averages over
      its local batch).
    """

    inputs: torch.Tensor
    target: torch.Tensor
    loss_denominator: int
    loss_reduce: Literal["none", "sum", "avg"]


def global_loss(loss: torch.Tensor, batch: Batch, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The global loss from this rank's ``loss`` (eager collective; for logging
    and checks, every rank of ``group`` must call it)."""
    total = loss.detach().clone()
    if batch.loss_reduce != "none":
        dist.all_reduce(total, group=group)
        if batch.loss_reduce == "avg":
            total /= dist.get_world_size(group)
    return total


# --------------------------------------------------------------------------- init


@torch.no_grad()
def init_weights_(module: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """Re-initialise every parameter of ``module`` from ``seed``, in place.

    Uses a private ``torch.Generator`` (the global RNG is left alone) and visits
    parameters in ``named_parameters()`` order, which is the same on every rank
    and in every process as long as the module structure is the same. Vectors
    (norm weights, biases) get ones / zeros, matrices N(0, std).
    Must be called BEFORE parallelisation (it writes full tensors).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if p.ndim == 1:
            p.fill_(0.0 if name.endswith("bias") else 1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)
    return module


# ------------------------------------------------------------------ comparisons


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The full (unsharded, reduced) value of ``t``; plain tensors pass through.

    For a DTensor this runs collectives (all_gather / all_reduce), so every rank
    of its mesh must call it.
    """
    return t.full_tensor() if isinstance(t, DTensor) else t


def all_gather_cat(t: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate the plain tensor ``t`` of every rank of ``group`` along ``dim``
    (eager, for checking results; every rank gets the result)."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


# ------------------------------------------------------------ graph recording


class GraphRecorder:
    """A ``torch.compile`` backend that records the AOTAutograd forward and
    backward graphs and runs them eagerly (no Inductor, so compiling is fast).

    Usage::

        rec = GraphRecorder()
        cmodel = torch.compile(model, backend=rec.backend, fullgraph=True)
        loss_fn(cmodel(x)).backward()
        print(rec.forward_code, rec.backward_code)

    ``rec.forward_graphs`` / ``rec.backward_graphs`` hold the GraphModules (one
    per compiled region; the backward one appears once backward has run).
    """

    def __init__(self) -> None:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.forward_graphs: list[torch.fx.GraphModule] = []
        self.backward_graphs: list[torch.fx.GraphModule] = []

        def fw(gm: torch.fx.GraphModule, _inputs: Sequence[Any]) -> Callable:
            self.forward_graphs.append(gm)
            return make_boxed_func(gm.forward)

        def bw(gm: torch.fx.GraphModule, _inputs: Sequence[Any]) -> Callable:
            self.backward_graphs.append(gm)
            return make_boxed_func(gm.forward)

        self.backend = aot_autograd(fw_compiler=fw, bw_compiler=bw)

    @property
    def forward_code(self) -> str:
        return "\n".join(g.code for g in self.forward_graphs)

    @property
    def backward_code(self) -> str:
        return "\n".join(g.code for g in self.backward_graphs)


# ---------------------------------------------------------------- examples


def default_backend() -> Callable:
    """The commfuse backend callable: the entry point in pyproject registers the name
    ``"commfuse"`` only for installed packages, so the examples pass the callable itself."""
    return commfuse_backend


def print_loss_comparison(title: str, backend: object, eager: list[float], compiled: list[float]) -> None:
    """Print both loss curves and check they agree (fp32, a few steps)."""
    label = backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))
    print(f"{title}, backend={label}")
    for step, (e, c) in enumerate(zip(eager, compiled, strict=True)):
        print(f"step {step}: eager loss {e:.6f}   compiled loss {c:.6f}   diff {abs(e - c):.2e}")
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-5)
    print("compiled matches eager")


def init_distributed() -> str:
    """Initialise the default process group from torchrun's environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``LOCAL_RANK``) and return the device type to build on:
    ``"cuda"`` with NCCL, each rank on GPU ``LOCAL_RANK``, where CUDA is available, else
    ``"cpu"`` with gloo and one intra-op thread per rank (the ranks share the machine's cores)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        return "cuda"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return "cpu"


def batch_to(batch: Batch, device: str | torch.device) -> Batch:
    """``batch`` with its tensors on ``device``."""
    return Batch(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in batch))
