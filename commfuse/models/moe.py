"""A GShard-style mixture-of-experts block with expert parallelism (EP).

Model
-----
:class:`MoEBlock` is the MoE feed-forward sub-layer of a transformer,
``out = x + MoE(RMSNorm(x))``, mapping ``[batch, seq, dim]`` to
``[batch, seq, dim]`` (plus an auxiliary load-balancing loss). The MoE:

1. router: linear gate -> softmax over experts -> top-k (k = 1 or 2; top-2
   gate values are renormalised to sum to 1);
2. dispatch with static shapes (GShard): tokens are split into *token groups*;
   within a group each expert takes at most ``capacity`` tokens. Slots are
   assigned with one-hot + cumsum, all first choices before any second
   choice, earlier tokens first; assignments past capacity are dropped (the
   token then gets nothing from that expert). The dispatched activations are
   ``[groups, experts, capacity, dim]``;
3. experts: SwiGLU MLPs stored as stacked weights ``w1/w3 [E, dim, ffn]``,
   ``w2 [E, ffn, dim]`` and run as batched matmuls;
4. combine: each token's output is the gate-weighted sum of its experts'
   outputs (zero for a token dropped by all of its experts).

Capacity semantics: ``capacity = ceil(capacity_factor * top_k * T / E)``
where ``T`` is the number of tokens in ONE token group. Unsharded, the
tokens are split into ``num_token_groups`` groups along the batch dim. Under
EP each rank's local tokens form exactly one group, so the capacity is
computed from the rank's local token count. The unsharded reference of an
N-rank EP run is therefore ``MoEBlock(..., num_token_groups=N)`` fed the full
batch (rank r's slice of the batch = group r): it drops exactly the same
tokens.

Parallelisation (:func:`parallelize_moe`)
----------------------------------------
Over a 1-D EP mesh of N ranks (each with its own batch slice, i.e. the EP
group is also a data-parallel group), rank r keeps experts
``[r*E/N, (r+1)*E/N)`` as plain local parameters. The dispatched
``[E, capacity, dim]`` buffer is exchanged with
``all_to_all_single_autograd`` (equal static splits: E/N experts' slots per
peer), so each rank runs its local experts on ``[E/N, N*capacity, dim]``;
a second all_to_all returns the results. The norm and router are replicated
and made data parallel with :func:`commfuse.models.simple_fsdp.data_parallel`
(``replicate``, summed gradients).

Collectives under ``torch.compile``: forward ``_c10d_functional.all_to_all_single``
x2; backward ``all_to_all_single`` x2 (the transposed exchanges) and one
``all_reduce`` each for the router and norm weight gradients.

Loss convention (:func:`loss_fn`): MSE summed over the rank's tokens divided
by the GLOBAL element count, plus ``aux_weight * aux / N``; the global loss is
the SUM of the per-rank losses (``Batch.loss_reduce == "sum"``). Summing is
what the expert gradients do by construction (the backward all_to_all adds up
the contributions of every rank's tokens), hence the router gradient is
summed too.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from commfuse.models.common import Batch, init_weights_
from commfuse.models.llama import RMSNorm
from commfuse.models.simple_fsdp import data_parallel

__all__ = [
    "GroupedExperts",
    "MoEBlock",
    "build_moe",
    "gshard_gating",
    "loss_fn",
    "make_inputs",
    "parallelize_moe",
]


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs as stacked weights (dim 0 = expert)."""

    def __init__(self, num_experts: int, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[local_experts, tokens, dim]`` -> same shape."""
        return torch.bmm(F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3), self.w2)


def gshard_gating(
    probs: torch.Tensor, top_k: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Static-shape top-k routing with capacity (GShard).

    ``probs``: router softmax ``[G, T, E]``. Returns ``combine`` ``[G, T, E, C]``
    (gate weight of each token in each expert slot), the boolean ``dispatch``
    mask of the same shape, and the auxiliary load-balancing loss per group
    ``[G]`` (Switch/GShard: ``E * sum_e(top1_fraction_e * mean_prob_e)``).
    """
    num_experts = probs.shape[-1]
    gates, experts = probs.topk(top_k, dim=-1)  # [G, T, k]
    if top_k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    choice = F.one_hot(experts, num_experts)  # [G, T, k, E]
    # Slot of each assignment inside its expert: earlier tokens first within a
    # choice rank, and every k-th choice after all (k-1)-th choices.
    earlier_tokens = choice.cumsum(dim=1) - choice
    per_rank_load = choice.sum(dim=1, keepdim=True)  # [G, 1, k, E]
    earlier_ranks = per_rank_load.cumsum(dim=2) - per_rank_load
    slot = ((earlier_tokens + earlier_ranks) * choice).sum(dim=-1)  # [G, T, k]
    kept = (slot < capacity).to(probs.dtype)
    slot_onehot = F.one_hot(slot.clamp(max=capacity - 1), capacity).to(probs.dtype)
    # [G, T, k, E, 1] * [G, T, k, 1, C] summed over k -> [G, T, E, C]
    assign = (choice.to(probs.dtype) * kept.unsqueeze(-1)).unsqueeze(-1) * slot_onehot.unsqueeze(-2)
    combine = (assign * gates.unsqueeze(-1).unsqueeze(-1)).sum(dim=2)
    dispatch = assign.sum(dim=2) > 0
    top1_fraction = choice[:, :, 0].to(probs.dtype).mean(dim=1)  # [G, E]
    aux = num_experts * (top1_fraction * probs.mean(dim=1)).sum(dim=-1)
    return combine, dispatch, aux


class MoEBlock(nn.Module):
    """``x + combine(experts(dispatch(RMSNorm(x))))``; see the module docstring.

    ``forward(x [B, S, dim]) -> (out [B, S, dim], aux_loss scalar)`` where
    ``aux_loss`` is the mean over this module's token groups of the
    load-balancing statistic.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        ffn_dim: int,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        num_token_groups: int = 1,
    ) -> None:
        super().__init__()
        if top_k not in (1, 2):
            raise ValueError(f"top_k must be 1 or 2, got {top_k}")
        self.dim, self.num_experts, self.top_k = dim, num_experts, top_k
        self.capacity_factor = capacity_factor
        self.num_token_groups = num_token_groups
        self.norm = RMSNorm(dim)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, dim, ffn_dim)
        # Set by parallelize_moe: the EP process group's name (a string keeps
        # torch.compile guards trivial) and its size.
        self.ep_group_name: str | None = None
        self.ep_size = 1

    def capacity(self, tokens_per_group: int) -> int:
        return max(1, math.ceil(self.capacity_factor * self.top_k * tokens_per_group / self.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bsz, seq, dim = x.shape
        groups = 1 if self.ep_group_name is not None else self.num_token_groups
        tokens = self.norm(x).reshape(groups, -1, dim)  # batch-major: group g = batch slice g
        capacity = self.capacity(tokens.shape[1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        combine, dispatch, aux = gshard_gating(probs, self.top_k, capacity)
        dispatched = torch.einsum("gtec,gtd->gecd", dispatch.to(x.dtype), tokens)
        expert_out = self._run_experts(dispatched)  # [G, E, C, D]
        out = torch.einsum("gtec,gecd->gtd", combine.to(x.dtype), expert_out)
        return x + out.reshape(bsz, seq, dim), aux.mean()

    def _run_experts(self, dispatched: torch.Tensor) -> torch.Tensor:
        groups, experts, capacity, dim = dispatched.shape
        if self.ep_group_name is None:
            # All experts local: expert e processes its slots of every group.
            flat = dispatched.transpose(0, 1).reshape(experts, groups * capacity, dim)
            out = self.experts(flat).reshape(experts, groups, capacity, dim)
            return out.transpose(0, 1)
        # EP: this rank's single group. all_to_all splits dim 0 into ep_size
        # equal chunks, chunk j = the slots of rank j's experts -> rank j; we
        # receive [source rank, local expert, C, D], i.e. the same
        # (expert, group, slot) order as the unsharded path.
        n, local = self.ep_size, experts // self.ep_size
        received = all_to_all_single_autograd(
            dispatched.reshape(experts * capacity, dim), None, None, self.ep_group_name
        )
        flat = received.reshape(n, local, capacity, dim).transpose(0, 1).reshape(local, n * capacity, dim)
        out = self.experts(flat).reshape(local, n, capacity, dim).transpose(0, 1)
        returned = all_to_all_single_autograd(
            out.reshape(experts * capacity, dim), None, None, self.ep_group_name
        )
        return returned.reshape(1, experts, capacity, dim)


def build_moe(
    dim: int = 32,
    num_experts: int = 8,
    ffn_dim: int = 64,
    top_k: int = 2,
    capacity_factor: float = 1.25,
    num_token_groups: int = 1,
    seed: int = 0,
) -> MoEBlock:
    """A :class:`MoEBlock` with deterministic weights (same on every rank).

    The router is initialised with a larger std than the experts so that the
    routing is far from uniform (and capacity actually drops tokens)."""
    model = MoEBlock(dim, num_experts, ffn_dim, top_k, capacity_factor, num_token_groups)
    init_weights_(model, seed, std=0.1)
    return model


def parallelize_moe(model: MoEBlock, mesh: DeviceMesh) -> MoEBlock:
    """Expert-parallelise ``model`` over the 1-D ``mesh`` in place; returns it.

    Keeps rank r's ``E/N`` experts (slicing the full stacked weights every
    rank built identically) and makes the norm and router DDP-replicated with
    summed gradients. ``num_experts`` must be divisible by the mesh size.
    """
    n, rank = mesh.size(), mesh.get_local_rank()
    if model.num_experts % n:
        raise ValueError(f"num_experts={model.num_experts} not divisible by EP degree {n}")
    local = model.num_experts // n
    experts = model.experts
    for name in ("w1", "w2", "w3"):
        full = getattr(experts, name)
        shard = full.detach()[rank * local : (rank + 1) * local].clone()
        setattr(experts, name, nn.Parameter(shard, full.requires_grad))
    for replicated in (model.norm, model.router):
        data_parallel(replicated, mesh, "replicate", grad_reduction="sum")
    model.ep_group_name = mesh.get_group().group_name
    model.ep_size = n
    return model


# ------------------------------------------------------------ data and loss


def make_inputs(
    batch: int,
    seq_len: int,
    dim: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 1234,
) -> Batch:
    """Rank ``rank``'s slice along the batch dim (``batch / world_size`` rows)
    of a deterministic global ``[batch, seq_len, dim]`` input and MSE target;
    ``world_size=1`` gives the full batch for the reference."""
    if batch % world_size:
        raise ValueError(f"batch {batch} not divisible by world size {world_size}")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, dim, generator=gen)
    target = torch.randn(batch, seq_len, dim, generator=gen)
    local = batch // world_size
    sl = slice(rank * local, (rank + 1) * local)
    reduce = "none" if world_size == 1 else "sum"
    return Batch(x[sl].contiguous(), target[sl].contiguous(), x.numel(), reduce)


def loss_fn(out: torch.Tensor, aux: torch.Tensor, batch: Batch, aux_weight: float = 0.01) -> torch.Tensor:
    """This rank's share of ``global MSE + aux_weight * mean_over_groups(aux)``."""
    # The batch is split over denominator / local-numel ranks; each rank's aux
    # is the statistic of its own group, so it contributes 1/N of the mean.
    num_shards = batch.loss_denominator // batch.target.numel()
    mse = (out.float() - batch.target).pow(2).sum() / batch.loss_denominator
    return mse + aux_weight * aux / num_shards
