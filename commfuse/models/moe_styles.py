"""Mixture-of-experts layers written the way users write them, for MoE recognition.

commfuse's own :class:`commfuse.moe.MoELayer` is one graph op. The layers here are
plain PyTorch, written in the two common styles, so that the ``moe_recognition``
pass (docs/moe-recognition.md) has real user code to recognise:

* :class:`GShardMoE` -- GShard capacity dispatch with static shapes: softmax router,
  top-k, one-hot + cumsum slots (:func:`commfuse.models.moe.gshard_gating`), einsum
  dispatch into ``[groups, experts, capacity, dim]``, an equal-split all_to_all,
  batched SwiGLU experts, the all_to_all back and an einsum combine;
* :class:`DroplessMoE` -- torchtitan-style dropless token choice: softmax router,
  top-k with renormalised scores, token counts per expert (``histc``), an
  argsort permutation by expert, the counts exchanged with ``all_to_all_single``,
  ``.tolist()`` split sizes for ``all_to_all_single_autograd``, received rows
  regrouped by local expert, one SwiGLU per local expert (a loop over
  ``split``), the inverse permutation, the all_to_all back, score-weighted
  ``scatter_add`` combine. Compiling it whole needs
  ``torch._dynamo.config.capture_scalar_outputs = True`` (the split sizes are
  data-dependent); without it the ``.tolist()`` breaks the graph.

Both compute the function ``commfuse::moe_layer`` computes (float32 router logits,
softmax, top-k, gates renormalised for ``top_k > 1``, GShard capacity slots or
dropless, SwiGLU experts ``w1/w3 [E, H, F]``, ``w2 [E, F, H]`` -- the dropless
layer stores them torchtitan's way, ``[E, F, H]`` / ``[E, H, F]``, and transposes)
and return ``(out, aux)`` with ``aux`` the Switch load-balancing loss
``E * sum_e(top1_fraction_e * mean_prob_e)`` plus ``z_weight * mean(logsumexp^2)``.
Options that leave the op's semantics (``score_func="sigmoid"``, ``route_norm=False``
with ``top_k > 1``, ``track_tokens=True`` with ``top_k > 1``, a low-precision
router) exist so tests can check the pass refuses them.

:func:`build_moe_style_tp` / :func:`parallelize_moe_style_tp` put either layer in the
TP+EP / SP+EP+SP decoder block of :mod:`commfuse.models.moe_tp` (attention TP over
the mesh, experts split over the same mesh, or over another dim of a 2-D mesh with ``ep_mesh``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from commfuse.models.common import init_weights_
from commfuse.models.llama import Attention, RMSNorm
from commfuse.models.moe import gshard_gating
from commfuse.models.moe_tp import parallelize_moe_block
from commfuse.moe.layer import keep_local_experts

Style = Literal["gshard", "dropless"]
Layout = Literal["ep", "tp_ep", "sp_ep_sp"]

__all__ = [
    "DroplessMoE",
    "GShardMoE",
    "MoEStyleConfig",
    "build_moe_style",
    "build_moe_style_tp",
    "parallelize_moe_style_tp",
]


def _router_logits(x: torch.Tensor, weight: torch.Tensor, fp32: bool) -> torch.Tensor:
    # DeepSeek-style: the router matmul in float32 whatever the model dtype.
    if fp32:
        return F.linear(x.float(), weight.float())
    return F.linear(x, weight).float()


def _switch_aux(
    probs: torch.Tensor, first_choice: torch.Tensor, logits: torch.Tensor, num_experts: int, z_weight: float
) -> torch.Tensor:
    """Switch load balancing over the tokens of dim 0 plus the ST-MoE z-loss."""
    top1_fraction = F.one_hot(first_choice, num_experts).float().mean(dim=0)
    aux = num_experts * (top1_fraction * probs.mean(dim=0)).sum()
    return aux + z_weight * torch.logsumexp(logits, dim=-1).pow(2).mean()


class GShardMoE(nn.Module):
    """GShard capacity MoE on tokens ``[..., dim]`` (one token group per call under EP)."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        ffn_dim: int,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        z_weight: float = 1e-3,
        fp32_router: bool = True,
    ) -> None:
        super().__init__()
        self.dim, self.num_experts, self.top_k = dim, num_experts, top_k
        self.capacity_factor, self.z_weight, self.fp32_router = capacity_factor, z_weight, fp32_router
        self.router = nn.Parameter(torch.empty(num_experts, dim))
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.ep_group_name: Optional[str] = None
        self.ep_size = 1

    def expert_parallel(self, group: dist.ProcessGroup) -> "GShardMoE":
        keep_local_experts(self, group)
        self.ep_group_name, self.ep_size = group.group_name, dist.get_world_size(group)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = x.reshape(1, -1, self.dim)
        capacity = max(1, math.ceil(self.capacity_factor * self.top_k * tokens.shape[1] / self.num_experts))
        logits = _router_logits(tokens, self.router, self.fp32_router)
        probs = F.softmax(logits, dim=-1)
        combine, dispatch, aux = gshard_gating(probs, self.top_k, capacity)
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        dispatched = torch.einsum("gtec,gtd->gecd", dispatch.to(x.dtype), tokens)
        expert_out = self._experts(dispatched[0], capacity)
        out = torch.einsum("gtec,gecd->gtd", combine.to(x.dtype), expert_out.unsqueeze(0))
        return out.reshape(x.shape), aux.mean() + self.z_weight * z

    def _experts(self, dispatched: torch.Tensor, capacity: int) -> torch.Tensor:
        e, d = self.num_experts, self.dim
        n, local = self.ep_size, self.num_experts // self.ep_size
        if self.ep_group_name is not None:
            dispatched = funcol.all_to_all_single_autograd(
                dispatched.reshape(e * capacity, d), None, None, self.ep_group_name
            )
        rows = dispatched.reshape(n, local, capacity, d).transpose(0, 1).reshape(local, n * capacity, d)
        h = torch.bmm(F.silu(torch.bmm(rows, self.w1)) * torch.bmm(rows, self.w3), self.w2)
        back = h.reshape(local, n, capacity, d).transpose(0, 1).reshape(e * capacity, d)
        if self.ep_group_name is not None:
            back = funcol.all_to_all_single_autograd(back, None, None, self.ep_group_name)
        return back.reshape(e, capacity, d)


class DroplessMoE(nn.Module):
    """torchtitan-style dropless token-choice MoE on tokens ``[..., dim]``."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        ffn_dim: int,
        top_k: int = 2,
        z_weight: float = 1e-3,
        score_func: Literal["softmax", "sigmoid"] = "softmax",
        route_norm: bool = True,
        route_scale: float = 1.0,
        fp32_router: bool = True,
        track_tokens: bool = False,
    ) -> None:
        super().__init__()
        self.dim, self.num_experts, self.top_k, self.z_weight = dim, num_experts, top_k, z_weight
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale
        self.fp32_router = fp32_router
        self.gate = nn.Linear(dim, num_experts, bias=False)
        # torchtitan's layout: w1/w3 [E, F, H], w2 [E, H, F], applied transposed.
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        # Expert usage, as torchtitan keeps it for its bias-based load balancing.
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)
        self.track_tokens = track_tokens
        self.ep_group_name: Optional[str] = None
        self.ep_size = 1

    def expert_parallel(self, group: dist.ProcessGroup) -> "DroplessMoE":
        keep_local_experts(self, group)
        self.ep_group_name, self.ep_size = group.group_name, dist.get_world_size(group)
        return self

    # -- router ------------------------------------------------------------
    def _route(self, x: torch.Tensor):
        logits = _router_logits(x, self.gate.weight, self.fp32_router)
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            scores = F.softmax(logits, dim=1)
        top_scores, selected = torch.topk(scores, k=self.top_k, dim=1)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        counts = torch.histc(selected.view(-1).float(), bins=self.num_experts, min=0, max=self.num_experts)
        return logits, scores, top_scores, selected, counts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, self.dim)
        logits, scores, top_scores, selected, counts = self._route(x)
        if self.track_tokens:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        # Reorder the assignments by expert (stable: earlier tokens first within an expert).
        order = torch.argsort(selected.view(-1), stable=True)
        scores_sorted = top_scores.view(-1)[order]
        token_of = order // self.top_k
        routed = torch.gather(x, 0, token_of.reshape(-1, 1).expand(-1, self.dim))
        counts = counts.to(torch.int64)
        if self.ep_group_name is None:
            routed_out = self._experts(routed, counts)
        else:
            routed_out = self._expert_parallel(routed, counts)
        weighted = (routed_out.float() * scores_sorted.reshape(-1, 1)).to(x.dtype)
        out = torch.zeros_like(x).scatter_add(0, token_of.reshape(-1, 1).expand(-1, self.dim), weighted)
        aux = _switch_aux(scores, selected[:, 0], logits, self.num_experts, self.z_weight)
        return out.reshape(shape), aux

    # -- experts -----------------------------------------------------------
    def _experts(self, rows: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """One SwiGLU per local expert over its (contiguous) rows."""
        outs = []
        for e, chunk in enumerate(torch.split(rows, per_expert.tolist(), dim=0)):
            h = F.silu(torch.matmul(chunk, self.w1[e].transpose(-2, -1)))
            h = h * torch.matmul(chunk, self.w3[e].transpose(-2, -1))
            outs.append(torch.matmul(h, self.w2[e].transpose(-2, -1)))
        return torch.cat(outs, dim=0)

    def _expert_parallel(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        n, group = self.ep_size, self.ep_group_name
        local = self.num_experts // n
        # How many rows each rank sends me, per local expert: [source rank, local expert].
        recv_counts = funcol.all_to_all_single(counts, None, None, group)
        send_splits = counts.view(n, local).sum(dim=1).tolist()
        recv_splits = recv_counts.view(n, local).sum(dim=1).tolist()
        received = funcol.all_to_all_single_autograd(routed, recv_splits, send_splits, group)
        # Received rows come source-major; regroup them expert-major for the experts.
        row_expert = torch.repeat_interleave(
            torch.arange(local).repeat(n), recv_counts, output_size=received.shape[0]
        )
        perm = torch.argsort(row_expert, stable=True)
        out = self._experts(received[perm], recv_counts.view(n, local).sum(dim=0))
        unpermuted = torch.zeros_like(out).index_copy(0, perm, out)
        return funcol.all_to_all_single_autograd(unpermuted, send_splits, recv_splits, group)


# ------------------------------------------------------------------ builders
@dataclass(frozen=True)
class MoEStyleConfig:
    style: Style = "gshard"
    dim: int = 16
    num_experts: int = 8
    ffn_dim: int = 32
    top_k: int = 2
    capacity_factor: float = 1.25  # gshard only
    z_weight: float = 1e-3
    n_heads: int = 4  # decoder block only


def build_moe_style(cfg: MoEStyleConfig, seed: int = 0, **options) -> nn.Module:
    """A :class:`GShardMoE` or :class:`DroplessMoE` with deterministic weights (same on every rank).

    ``options`` go to the layer's constructor (e.g. ``score_func``, ``fp32_router``)."""
    if cfg.style == "gshard":
        layer = GShardMoE(
            cfg.dim, cfg.num_experts, cfg.ffn_dim, cfg.top_k, cfg.capacity_factor, cfg.z_weight, **options
        )
    elif cfg.style == "dropless":
        layer = DroplessMoE(cfg.dim, cfg.num_experts, cfg.ffn_dim, cfg.top_k, cfg.z_weight, **options)
    else:
        raise ValueError(f"style must be 'gshard' or 'dropless', got {cfg.style!r}")
    # A wider router than the experts: routing far from uniform, so capacity can bind.
    init_weights_(layer, seed, std=0.3)
    return layer


class StyleBlock(nn.Module):
    """``h = x + Attention(norm(x)); out = h + MoE(norm(h))`` (the block of :mod:`.moe_tp`)."""

    def __init__(self, cfg: MoEStyleConfig, **options) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg.dim, cfg.n_heads)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.moe = build_moe_style(cfg, **options)
        self.mesh: DeviceMesh | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.attention(self.attention_norm(x))
        y = self.ffn_norm(h)
        if self.mesh is not None:  # end of SP: every rank routes every token
            y = y.redistribute(self.mesh, [Replicate()]).to_local()
        out, aux = self.moe(y)
        if self.mesh is not None:
            out = DTensor.from_local(out, self.mesh, [Replicate()], run_check=False)
            out = out.redistribute(self.mesh, [Shard(1)]).to_local()
        return h + out, aux


def build_moe_style_tp(cfg: MoEStyleConfig, seed: int = 0, **options) -> StyleBlock:
    """One decoder block with deterministic weights (the same on every rank)."""
    block = StyleBlock(cfg, **options)
    init_weights_(block, seed, std=0.1)
    with torch.no_grad():  # the router wider than the rest (see build_moe_style)
        router = block.moe.router if isinstance(block.moe, GShardMoE) else block.moe.gate.weight
        router.mul_(3.0)
    return block


def parallelize_moe_style_tp(
    block: StyleBlock, mesh: DeviceMesh, layout: Layout, ep_mesh: DeviceMesh | None = None
) -> StyleBlock:
    """TP attention + EP experts over the 1-D ``mesh`` in place (layouts of :mod:`.moe_tp`);
    with ``ep_mesh`` (the other dim of a 2-D mesh) the experts are split over that one instead,
    TP and EP on separate mesh dims (see :func:`commfuse.models.moe_tp.parallelize_moe_block`)."""
    return parallelize_moe_block(block, mesh, layout, ep_mesh=ep_mesh)
