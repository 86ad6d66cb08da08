"""Token routing of commfuse's MoE layer: router, top-k gates, capacity slots.

Pure tensor functions shared by the layer op (:mod:`.op`), its unsharded
reference and the tests, so that "the same routing" is one piece of code.

Semantics (GShard, Lepikhin et al. 2020, §2.2; Switch Transformer for the
auxiliary statistics):

* ``logits = x @ router_w.T`` in float32, ``probs = softmax(logits)``;
* each token picks its ``top_k`` experts; with ``top_k > 1`` the gates are
  renormalised to sum to 1;
* *capacity* (``capacity_factor > 0``): the tokens are split into
  ``token_groups`` equal groups along the token dim; inside a group expert ``e``
  takes at most ``C = max(1, ceil(capacity_factor * top_k * T_g / E))``
  assignments (``T_g`` tokens per group). Slots go to all first choices before
  any second choice, earlier tokens first; assignments past ``C`` are dropped.
  ``capacity_factor <= 0`` is *dropless*: every assignment is kept.

Every token's output depends on that token and the weights only, except for the
capacity rule, which depends on the other tokens of its group: that is why
moving the layer onto token shards is exact when no group is split (or nothing
can be dropped), and a regrouping otherwise (see
:mod:`commfuse.analysis.moe_rules`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


def router_probs(x: torch.Tensor, router_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, probs)`` in float32 for tokens ``x [T, H]`` and ``router_w [E, H]``."""
    logits = x.float() @ router_w.float().t()
    return logits, torch.softmax(logits, dim=-1)


def top_k_gates(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gates [T, k], experts [T, k])``; gates renormalised when ``top_k > 1``."""
    gates, experts = probs.topk(top_k, dim=-1)
    if top_k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return gates, experts


def capacity(capacity_factor: float, top_k: int, tokens_per_group: int, num_experts: int) -> int:
    """Slots per expert per token group (GShard); 0 means dropless."""
    if capacity_factor <= 0:
        return 0
    return max(1, math.ceil(capacity_factor * top_k * tokens_per_group / num_experts))


def capacity_factor_for(cap: int, top_k: int, tokens: int, num_experts: int) -> Optional[float]:
    """A ``capacity_factor`` for which :func:`capacity` gives ``cap`` on ``tokens`` tokens."""
    cf = cap * num_experts / (top_k * tokens)
    for _ in range(8):
        got = capacity(cf, top_k, tokens, num_experts)
        if got == cap:
            return cf
        cf = math.nextafter(cf, 0.0 if got > cap else math.inf)
    return None


def capacity_can_bind(capacity_factor: float, top_k: int, num_experts: int) -> bool:
    """Whether some routing can drop a token, for every group size.

    A token's ``top_k`` choices are distinct experts, so an expert gets at most
    ``T_g`` assignments in a group; ``capacity_factor * top_k >= E`` makes
    ``C >= T_g`` for every ``T_g``."""
    return capacity_factor > 0 and capacity_factor * top_k < num_experts


@dataclass
class Assignments:
    """The kept (token, expert) assignments of one rank's tokens, in GShard order.

    ``slot`` is the assignment's position in its expert's buffer:
    ``group * C + slot-within-group`` (capacity mode) or unused (dropless)."""

    token: torch.Tensor  # [A] int64
    expert: torch.Tensor  # [A] int64
    choice: torch.Tensor  # [A] int64 (0 = first choice)
    slot: torch.Tensor  # [A] int64
    slots_per_expert: int  # token_groups * C (capacity) or 0 (dropless)


def assign(experts: torch.Tensor, num_experts: int, capacity_factor: float, token_groups: int) -> Assignments:
    """Kept assignments for ``experts [T, k]`` (the top-k expert ids)."""
    tokens, k = experts.shape
    if capacity_factor <= 0:
        tok = torch.arange(tokens, device=experts.device).repeat_interleave(k)
        ch = torch.arange(k, device=experts.device).repeat(tokens)
        flat = experts.reshape(-1)
        return Assignments(tok, flat, ch, torch.zeros_like(flat), 0)
    if tokens % token_groups:
        raise ValueError(f"{tokens} tokens do not split into token_groups={token_groups}")
    per_group = tokens // token_groups
    cap = capacity(capacity_factor, k, per_group, num_experts)
    # [G, k, T_g, E] one-hot, ordered choice-major so that a cumsum over (choice, token)
    # gives every first choice a slot before any second choice.
    onehot = F.one_hot(experts.reshape(token_groups, per_group, k), num_experts).permute(0, 2, 1, 3)
    position = onehot.reshape(token_groups, k * per_group, num_experts).cumsum(dim=1) - 1
    position = (position.reshape(onehot.shape) * onehot).sum(-1)  # [G, k, T_g]
    slot = position.permute(0, 2, 1).reshape(tokens, k)  # back to [T, k]
    kept = slot < cap
    group = (torch.arange(tokens, device=experts.device) // per_group).unsqueeze(1).expand(tokens, k)
    tok = torch.arange(tokens, device=experts.device).unsqueeze(1).expand(tokens, k)
    ch = torch.arange(k, device=experts.device).unsqueeze(0).expand(tokens, k)
    return Assignments(tok[kept], experts[kept], ch[kept], (group * cap + slot)[kept], token_groups * cap)


def router_statistics(
    logits: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sums over tokens the auxiliary losses need, as float32:
    ``probs_sum [E]`` (sum of router probabilities), ``top1_count [E]`` (tokens whose
    first choice is e), ``z_sum []`` (sum of squared log-partition, ST-MoE's z-loss).

    Sums, not means: over token shards they add up (the pass all-reduces them)."""
    num_experts = probs.shape[-1]
    top1 = torch.zeros(num_experts, dtype=torch.float32, device=probs.device)
    top1.index_add_(0, experts[:, 0], torch.ones(experts.shape[0], device=probs.device))
    z = torch.logsumexp(logits, dim=-1).pow(2).sum()
    return probs.sum(0), top1, z


def load_balancing_loss(probs_sum: torch.Tensor, top1_count: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss ``E * sum_e(f_e * P_e)`` from the summed statistics."""
    num_experts = probs_sum.shape[0]
    return num_experts * ((top1_count / num_tokens) * (probs_sum / num_tokens)).sum()
