"""The MoE building block users put in a model: :class:`MoELayer`.

``MoELayer(dim, num_experts, ffn_dim, top_k, capacity_factor, token_groups)``
maps tokens ``[..., dim]`` to ``(out [..., dim], stats)`` through one
``commfuse::moe_layer`` op (router, dispatch, SwiGLU experts, combine; see
:mod:`commfuse.ops.moe_layer.op`). :meth:`MoELayer.expert_parallel` keeps this rank's ``E/N``
experts and names the process group the op exchanges tokens over.

``stats`` (:class:`RouterStats`) are sums over the layer's tokens; turn them into
losses with :meth:`RouterStats.load_balancing_loss` and :meth:`RouterStats.z_loss`.
They are sums so that a compiler moving the layer onto token shards can
all-reduce them and keep their values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup

from commfuse.ops.moe_layer.op import moe_layer
from commfuse.ops.moe_layer.routing import load_balancing_loss


@dataclass
class RouterStats:
    probs_sum: torch.Tensor  # [E]
    top1_count: torch.Tensor  # [E]
    z_sum: torch.Tensor  # []
    num_tokens: int

    def load_balancing_loss(self) -> torch.Tensor:
        return load_balancing_loss(self.probs_sum, self.top1_count, self.num_tokens)

    def z_loss(self) -> torch.Tensor:
        return self.z_sum / self.num_tokens


def keep_local_experts(
    module: nn.Module, group: ProcessGroup, names: tuple[str, ...] = ("w1", "w3", "w2")
) -> None:
    """Replace ``module``'s stacked expert weights ``names`` ([E, ...]) by this rank's slice
    ``[r*E/N, (r+1)*E/N)`` of ``group`` (rank r of N); ``module.num_experts`` stays E."""
    import torch.distributed as dist

    n, r = dist.get_world_size(group), dist.get_rank(group)
    if module.num_experts % n:
        raise ValueError(f"num_experts={module.num_experts} not divisible by the group size {n}")
    local = module.num_experts // n
    for name in names:
        full = getattr(module, name)
        setattr(
            module, name, nn.Parameter(full.detach()[r * local : (r + 1) * local].clone(), full.requires_grad)
        )


class MoELayer(nn.Module):
    """Router + ``num_experts`` SwiGLU experts as one expert-parallel op."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        ffn_dim: int,
        top_k: int = 2,
        capacity_factor: float = 0.0,
        token_groups: int = 1,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if token_groups < 1:
            raise ValueError(f"token_groups={token_groups} must be >= 1")
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor, self.token_groups = float(capacity_factor), token_groups
        self.router = nn.Parameter(torch.empty(num_experts, dim))
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.group_name = ""  # set by expert_parallel
        for p in self.parameters():
            nn.init.normal_(p, std=1.0 / math.sqrt(dim))

    def expert_parallel(self, group: ProcessGroup) -> "MoELayer":
        """Keep experts ``[r*E/N, (r+1)*E/N)`` of this rank ``r`` of ``group``; returns self."""
        keep_local_experts(self, group)
        self.group_name = group.group_name
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        # Leading dims stay: a graph pass can then shard any of them (e.g. the sequence).
        out, probs_sum, top1, z = moe_layer(
            x,
            self.router,
            self.w1,
            self.w3,
            self.w2,
            self.top_k,
            self.capacity_factor,
            self.token_groups,
            self.group_name,
        )
        return out, RouterStats(probs_sum, top1, z, x.numel() // x.shape[-1])
