"""SimpleFSDP-style data parallelism whose collectives are visible to torch.compile.

Why not FSDP2: ``fully_shard`` issues its all_gather / reduce_scatter from
module hooks and autograd hooks that torch.compile (2.13) does not trace into
the model's graph, so a compiler backend never sees them. SimpleFSDP (Zhang et
al., 2024, "SimpleFSDP: Simpler Fully Sharded Data Parallel with
torch.compile"; the design torchtitan uses for its compiler work) instead
expresses the parameter all_gather as ordinary DTensor ops in the forward:

* every parameter is stored as a DTensor on the data-parallel mesh,
  ``Shard(0)`` (``mode="fully_shard"``) or ``Replicate()``
  (``mode="replicate"``, i.e. DDP);
* a ``torch.nn.utils.parametrize`` parametrization turns it into the plain
  full tensor the module computes with: ``redistribute(Replicate())`` (an
  ``all_gather_into_tensor`` for sharded params, nothing for replicated ones)
  followed by ``to_local(grad_placements=[Partial(...)])``;
* autograd of that does the gradient reduction: the local gradient is
  declared ``Partial`` and is turned back into the parameter's placement,
  i.e. ``reduce_scatter_tensor`` (fully_shard) or ``all_reduce`` (replicate).

So under ``torch.compile`` the forward graph holds one all_gather per
parameter and the backward graph one reduce_scatter / all_reduce per
parameter gradient; bucketing and overlapping them is the backend's job.

Gradient semantics: ``grad_reduction="mean"`` (default) averages the
per-rank gradients exactly like DDP: with each rank's loss the mean over its
local batch (:func:`make_inputs` / :func:`loss_fn`), the parameter gradient
equals the single-process gradient of the mean loss over the global batch.
``grad_reduction="sum"`` sums them instead (for losses that are already
normalised by the global token count, e.g. :mod:`commfuse.models.moe`).

State dict: parametrize moves each parameter to
``<module>.parametrizations.<name>.original``, e.g. ``layers.0.attention.wq.weight``
becomes ``layers.0.attention.wq.parametrizations.weight.original``; its value is
the DTensor (``Shard(0)`` or ``Replicate()`` over the DP mesh, global shape =
the unsharded shape). :func:`unwrapped_name` maps names back. Plain attribute
access (``module.weight``) runs the parametrization, i.e. all-gathers.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from commfuse.models.common import Batch
from commfuse.models.llama import LlamaConfig

__all__ = [
    "ReplicateComputation",
    "data_parallel",
    "loss_fn",
    "make_inputs",
    "unwrapped_name",
]

Mode = Literal["fully_shard", "replicate"]
GradReduction = Literal["mean", "sum"]


class ReplicateComputation(nn.Module):
    """Parametrization: sharded/replicated DTensor -> full plain tensor.

    Forward: ``redistribute`` to ``Replicate()`` (all_gather when sharded).
    Backward: the gradient is declared ``Partial`` (avg or sum over the mesh)
    and reduced back to the stored placement (reduce_scatter / all_reduce).
    """

    def __init__(self, mesh: DeviceMesh, grad_reduction: GradReduction) -> None:
        super().__init__()
        self.mesh = mesh
        self.grad_placement = Partial("avg" if grad_reduction == "mean" else "sum")

    def forward(self, param: DTensor) -> torch.Tensor:
        full = param.redistribute(self.mesh, [Replicate()])
        return full.to_local(grad_placements=[self.grad_placement])


def data_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    mode: Mode = "fully_shard",
    *,
    grad_reduction: GradReduction = "mean",
) -> nn.Module:
    """Make ``model`` data parallel over the 1-D ``mesh``, in place; returns it.

    Every rank must hold the same full weights on entry (no weights are
    communicated: each rank keeps its own slice). ``fully_shard`` shards every
    parameter along dim 0 (sizes divisible by the mesh size give even shards).
    Parameters that are already DTensors (e.g. TP) are not supported here.
    """
    if mode == "fully_shard":
        placements = [Shard(0)]
    elif mode == "replicate":
        placements = [Replicate()]
    else:
        raise ValueError(f"unknown data-parallel mode {mode!r}")
    # Snapshot first: registering parametrizations adds new submodules.
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                raise NotImplementedError(f"{name} is already a DTensor; 2-D DP is not supported")
            sharded = distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
            # unsafe=True: skip parametrize's consistency check, which would run
            # the parametrization (an all_gather) once at registration time.
            parametrize.register_parametrization(
                module, name, ReplicateComputation(mesh, grad_reduction), unsafe=True
            )
    return model


def unwrapped_name(name: str) -> str:
    """``a.parametrizations.weight.original`` -> ``a.weight`` (others unchanged)."""
    return name.replace("parametrizations.", "").replace(".original", "")


# ------------------------------------------------------------ data and loss


def make_inputs(
    config: LlamaConfig,
    batch: int,
    seq_len: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 1234,
) -> Batch:
    """Rank ``rank``'s slice (along the batch dim) of a deterministic global
    batch for a ``vocab=None`` Llama model; ``world_size=1`` gives the full batch.
    Each rank's loss is the mean over its local slice (``loss_reduce="avg"``)."""
    if batch % world_size:
        raise ValueError(f"batch {batch} not divisible by world size {world_size}")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, config.dim, generator=gen)
    target = torch.randn(batch, seq_len, config.dim, generator=gen)
    local = batch // world_size
    sl = slice(rank * local, (rank + 1) * local)
    x, target = x[sl].contiguous(), target[sl].contiguous()
    return Batch(x, target, x.numel(), "none" if world_size == 1 else "avg")


def loss_fn(out: torch.Tensor, batch: Batch) -> torch.Tensor:
    """MSE over the rank's local batch (DDP convention: mean of local means)."""
    return (out.float() - batch.target).pow(2).sum() / batch.loss_denominator
