"""Stage models for pipeline parallelism combined with SP, TP or EP (commfuse.pipeline).

Every stage is an ``nn.Sequential`` of residual blocks mapping ``[batch, seq, dim]`` to the
same shape; the blocks talk to the other ranks of their stage only through
:mod:`commfuse.pipeline.collectives` on a :class:`StageGroup`, so a rank can trace a stage
it is not a member of. With ``group=None`` the same code is the unsharded model (every
collective is the identity): that is the single-process reference.

Kinds (``PipelineModelConfig.kind``):

* ``"sp"`` -- :class:`SPBlock`, Megatron sequence parallelism: activations are sharded
  along the sequence (dim 1) over the stage; ``RMSNorm`` on the shard (its replicated weight
  through ``copy_to_group``: the gradient is the sum of the shards'), ``all_gather(seq)``,
  column-parallel ``w1`` / row-parallel ``w2`` SiLU MLP, ``reduce_scatter(seq)``, residual.
* ``"tp"`` -- :class:`TPBlock`, Megatron tensor parallelism: activations replicated over the
  stage; ``RMSNorm``, ``f`` (``copy_to_group``), column/row MLP, ``g``
  (``reduce_from_group``), residual.
* ``"ep"`` -- a data-parallel dense block (:class:`DPBlock`: replicated weights through
  ``copy_to_group``, each rank its own tokens) and an expert-parallel GShard MoE block
  (:class:`EPMoEBlock`: replicated router (``copy_to_group``), top-k gating with capacity
  (:func:`commfuse.models.moe.gshard_gating`), ``all_to_all`` dispatch to the experts'
  owners, SwiGLU experts (stacked ``[E, ...]`` weights, ``E/N`` per rank), ``all_to_all``
  back, combine). Unsharded, the tokens form ``N`` token groups (rank r's tokens = group
  r), so capacity drops exactly the same tokens.

Weights: every block is built with its FULL weights from ``(seed, stage, block)`` and then
sharded for a position (:meth:`ShardedBlock.shard_`): the same on every rank, and the
reference gets the unsharded tensors. ``SHARD_DIMS`` says how each parameter is sharded
(``None``: replicated); :func:`shard_of` cuts a full tensor (e.g. a reference gradient) the
same way.

Data and loss (:func:`make_full_data`, :func:`position_view`, :func:`make_loss_fn`): the
global batch is ``[batch, seq, dim]`` (``"ep"``: ``[N*batch, ...]``, rank r's tokens are rows
r*batch...); position p holds its sequence shard (``sp``), everything (``tp``) or its rows
(``ep``). The loss of a rank is ``sum((out - target)^2) / (out.numel() * shards)``
(``shards`` = N for sp/ep, 1 for tp), so the global loss is the sum of the last stage's
per-rank losses (sp/ep) or any one of them (tp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from commfuse.models.moe import gshard_gating
from commfuse.pipeline.collectives import (
    all_gather,
    all_to_all,
    copy_to_group,
    reduce_from_group,
    reduce_scatter,
)
from commfuse.pipeline.layout import StageGroup

KINDS = ("sp", "tp", "ep")


@dataclass(frozen=True)
class PipelineModelConfig:
    kind: str = "sp"
    num_stages: int = 2
    blocks_per_stage: int = 2
    dim: int = 16
    ffn_dim: int = 32
    num_experts: int = 4
    top_k: int = 2
    capacity_factor: float = 1.25
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class ShardedBlock(nn.Module):
    """A block built with full weights, then cut for one position of its stage group."""

    SHARD_DIMS: dict[str, Optional[int]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.group: Optional[StageGroup] = None

    def init_full_(self, gen: torch.Generator) -> None:
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.startswith("norm"):
                    p.fill_(1.0)
                else:
                    fan_in = p.shape[-2] if p.dim() >= 2 else p.shape[-1]
                    p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))

    def shard_(self, group: Optional[StageGroup], position: int) -> "ShardedBlock":
        self.group = group
        n = 1 if group is None else group.size
        for name, dim in self.SHARD_DIMS.items():
            p = getattr(self, name)
            if dim is not None and n > 1:
                setattr(
                    self, name, nn.Parameter(shard_of(p.detach(), dim, n, position).clone(), p.requires_grad)
                )
        return self


def shard_of(full: torch.Tensor, dim: Optional[int], n: int, position: int) -> torch.Tensor:
    """Position ``position``'s piece of ``full`` cut in ``n`` along ``dim`` (None: all of it)."""
    if dim is None or n == 1:
        return full
    if full.shape[dim] % n:
        raise ValueError(f"size {full.shape[dim]} of dim {dim} is not divisible by {n}")
    return full.chunk(n, dim)[position]


class _MLPBlock(ShardedBlock):
    """The weights SP and TP blocks share: a norm weight (replicated) and a column-/row-parallel MLP."""

    SHARD_DIMS = {"norm_weight": None, "w1": 1, "w2": 0}

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.empty(dim))
        self.w1 = nn.Parameter(torch.empty(dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(ffn_dim, dim))


class SPBlock(_MLPBlock):
    """``x + rs(seq)(silu(ag(seq)(norm(x)) @ w1) @ w2)`` on sequence shards (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group
        h = _rms_norm(x, copy_to_group(self.norm_weight, g))  # replicated weight, sharded tokens
        h = all_gather(h, 1, g)
        h = F.silu(h @ self.w1) @ self.w2  # partial sums over the ffn shards
        return x + reduce_scatter(h, 1, g)


class TPBlock(_MLPBlock):
    """``x + g(silu(f(norm(x)) @ w1) @ w2)`` on replicated activations (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group
        h = copy_to_group(_rms_norm(x, self.norm_weight), g)
        h = F.silu(h @ self.w1) @ self.w2
        return x + reduce_from_group(h, g)


class DPBlock(ShardedBlock):
    """A dense SiLU MLP with replicated weights on each rank's own tokens (gradients summed)."""

    SHARD_DIMS = {"norm_weight": None, "w1": None, "w2": None}

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.empty(dim))
        self.w1 = nn.Parameter(torch.empty(dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(ffn_dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group
        h = _rms_norm(x, copy_to_group(self.norm_weight, g))
        h = F.silu(h @ copy_to_group(self.w1, g)) @ copy_to_group(self.w2, g)
        return x + h


class EPMoEBlock(ShardedBlock):
    """GShard MoE with experts sharded over the stage (module docstring)."""

    SHARD_DIMS = {"norm_weight": None, "router": None, "w1": 0, "w3": 0, "w2": 0}

    def __init__(
        self, dim: int, ffn_dim: int, num_experts: int, top_k: int, capacity_factor: float, token_groups: int
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.token_groups = token_groups  # used unsharded only: one group per EP rank
        self.norm_weight = nn.Parameter(torch.empty(dim))
        self.router = nn.Parameter(torch.empty(num_experts, dim))
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))

    def init_full_(self, gen: torch.Generator) -> None:
        super().init_full_(gen)
        with torch.no_grad():  # a sharp router, so that capacity really drops tokens
            self.router.mul_(4.0)

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3), self.w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group
        bsz, seq, dim = x.shape
        groups = 1 if g is not None else self.token_groups
        tokens = _rms_norm(x, copy_to_group(self.norm_weight, g)).reshape(groups, -1, dim)
        e = self.num_experts
        capacity = max(1, math.ceil(self.capacity_factor * self.top_k * tokens.shape[1] / e))
        probs = F.softmax(tokens @ copy_to_group(self.router, g).t(), dim=-1)
        combine, dispatch, _aux = gshard_gating(probs, self.top_k, capacity)
        dispatched = torch.einsum("gtec,gtd->gecd", dispatch.to(x.dtype), tokens)  # [G, E, C, D]
        if g is None or g.size == 1:
            flat = dispatched.transpose(0, 1).reshape(e, groups * capacity, dim)
            out = self._experts(flat).reshape(e, groups, capacity, dim).transpose(0, 1)
        else:
            n, local = g.size, e // g.size
            # piece j of dim 0 = the slots of rank j's experts; received: [source, local expert, C, D]
            recv = all_to_all(dispatched.reshape(e * capacity, dim), g)
            flat = recv.reshape(n, local, capacity, dim).transpose(0, 1).reshape(local, n * capacity, dim)
            out = self._experts(flat).reshape(local, n, capacity, dim).transpose(0, 1)
            out = all_to_all(out.reshape(e * capacity, dim), g).reshape(1, e, capacity, dim)
        y = torch.einsum("gtec,gecd->gtd", combine.to(x.dtype), out)
        return x + y.reshape(bsz, seq, dim)


def _block(cfg: PipelineModelConfig, index: int, stage_size: int) -> ShardedBlock:
    if cfg.kind == "sp":
        return SPBlock(cfg.dim, cfg.ffn_dim)
    if cfg.kind == "tp":
        return TPBlock(cfg.dim, cfg.ffn_dim)
    if index % 2 == 0:
        return DPBlock(cfg.dim, cfg.ffn_dim)
    return EPMoEBlock(cfg.dim, cfg.ffn_dim, cfg.num_experts, cfg.top_k, cfg.capacity_factor, stage_size)


def build_stages(
    cfg: PipelineModelConfig, stage_groups: Optional[Sequence[StageGroup]], position: int, stage_size: int
) -> list[nn.Sequential]:
    """One ``nn.Sequential`` per stage, sharded for ``position`` of ``stage_groups`` (None: the
    unsharded reference of a pipeline whose stages have ``stage_size`` ranks)."""
    if stage_groups is not None and len(stage_groups) != cfg.num_stages:
        raise ValueError(f"stage_groups: {len(stage_groups)} groups for {cfg.num_stages} stages")
    if cfg.kind == "ep" and cfg.num_experts % stage_size:
        raise ValueError(f"num_experts={cfg.num_experts} is not divisible by the stage size {stage_size}")
    stages = []
    for s in range(cfg.num_stages):
        blocks = []
        for b in range(cfg.blocks_per_stage):
            blk = _block(cfg, b, stage_size)
            blk.init_full_(torch.Generator().manual_seed(cfg.seed * 1000 + s * 100 + b))
            blk.shard_(None if stage_groups is None else stage_groups[s], position)
            blocks.append(blk)
        stages.append(nn.Sequential(*blocks))
    return stages


def shard_dims(stage: nn.Module) -> dict[str, Optional[int]]:
    """Parameter name (as ``stage.named_parameters()``) -> its shard dim (None: replicated)."""
    out = {}
    for prefix, mod in stage.named_modules():
        if isinstance(mod, ShardedBlock):
            for name, dim in mod.SHARD_DIMS.items():
                out[f"{prefix}.{name}" if prefix else name] = dim
    return out


# ------------------------------------------------------------------ data and loss
def make_full_data(
    cfg: PipelineModelConfig, stage_size: int, batch: int, seq: int, seed: int = 1234
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global input and target (``ep``: ``stage_size * batch`` rows, one block of rows per rank)."""
    rows = batch * stage_size if cfg.kind == "ep" else batch
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, seq, cfg.dim, generator=gen)
    return x, torch.randn(rows, seq, cfg.dim, generator=gen)


def position_view(
    cfg: PipelineModelConfig, stage_size: int, position: int, full: torch.Tensor
) -> torch.Tensor:
    """Position ``position``'s part of a global tensor (input, target or output)."""
    if cfg.kind == "tp" or stage_size == 1:
        return full
    dim = 1 if cfg.kind == "sp" else 0
    return full.chunk(stage_size, dim)[position].contiguous()


def reference_microbatch(
    cfg: PipelineModelConfig, stage_size: int, full: torch.Tensor, microbatches: int, i: int
) -> torch.Tensor:
    """The global tensor of micro-batch ``i``: every position's micro-batch i, put together."""
    if cfg.kind != "ep":
        return full.tensor_split(microbatches)[i]
    parts = [position_view(cfg, stage_size, p, full).tensor_split(microbatches)[i] for p in range(stage_size)]
    return torch.cat(parts, 0)


def make_loss_fn(
    cfg: PipelineModelConfig, stage_size: int
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    shards = 1 if cfg.kind == "tp" else stage_size

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).pow(2).sum() / (out.numel() * shards)

    return loss_fn


def reference_step(
    cfg: PipelineModelConfig, stage_size: int, x_full: torch.Tensor, t_full: torch.Tensor, microbatches: int
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The unsharded model in one process, the plain accumulation loop over micro-batches.

    Returns every position's loss (what the last stage's rank at that position reports:
    ``sum_i loss_i / M`` of its share) and the full gradients per stage (by parameter name)."""
    stages = build_stages(cfg, None, 0, stage_size)
    model = nn.Sequential(*stages)
    per_position = [torch.zeros(()) for _ in range(stage_size)]
    pos_loss = make_loss_fn(cfg, stage_size)
    for i in range(microbatches):
        x = reference_microbatch(cfg, stage_size, x_full, microbatches, i)
        t = reference_microbatch(cfg, stage_size, t_full, microbatches, i)
        out = model(x)
        loss = (out - t).pow(2).sum() / out.numel()  # the global loss (module docstring)
        (loss / microbatches).backward()
        with torch.no_grad():
            for p in range(stage_size):
                lp = pos_loss(position_view(cfg, stage_size, p, out), position_view(cfg, stage_size, p, t))
                per_position[p] = per_position[p] + lp / microbatches
    grads = [{n: p.grad.detach().clone() for n, p in st.named_parameters()} for st in stages]
    return per_position, grads


__all__ = [
    "DPBlock",
    "EPMoEBlock",
    "KINDS",
    "PipelineModelConfig",
    "SPBlock",
    "ShardedBlock",
    "TPBlock",
    "build_stages",
    "make_full_data",
    "make_loss_fn",
    "position_view",
    "reference_microbatch",
    "reference_step",
    "shard_dims",
    "shard_of",
]
