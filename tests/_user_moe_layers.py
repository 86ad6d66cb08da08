"""MoE layers written the way other people write them, to test recognition by meaning.

None of these shares code or spelling with ``commfuse.models``: each is written from its
source's description, as a user would.

* :class:`EinsumCapacityMoE` -- GShard (Lepikhin et al. 2020, §2.2 and Algorithm 1):
  matmul router, one-hot masks per choice, slot positions by ``cumsum`` with an offset
  that puts every first choice before any second choice, a ``[T, E, C]`` combine tensor,
  ``einsum`` dispatch, equal-split all_to_all, experts as ``einsum`` s, ``einsum`` combine.
* :class:`SortDroplessMoE` -- sort-based dropless dispatch (the MegaBlocks / torchtitan
  idea, spelled differently): ``torch.sort`` of the flat choices, counts by one-hot sums,
  ``index_select`` of the tokens, counts exchanged, ``.tolist()`` splits, rows regrouped by
  local expert, one ``F.linear`` SwiGLU per ``split`` chunk, results put back by an
  indexed assignment, ``index_add`` combine.
* :class:`ExpertLoopMoE` -- Hugging Face style (Mixtral / Qwen-MoE of transformers 4.4x):
  ``nn.Linear`` router, ``softmax(dtype=float)``, experts as ``nn.ModuleList`` of
  gate/up/down ``nn.Linear`` s, ``one_hot(...).permute(2, 1, 0)`` masks, a loop over
  experts with ``torch.where`` and ``index_add_`` into a zero buffer. With expert
  parallelism the rows are sent to the experts' ranks sorted by expert, and the loop runs
  over the local experts on the received rows.

Every layer takes tokens ``[B, S, H]``. With ``sp=True`` the tokens are this rank's
sequence shard: the layer gathers the sequence (``all_gather_tensor_autograd``), every
rank routes every token (experts split over the same group), and it returns its own
sequence chunk -- the SP+EP+SP layout of Chimera (ISCA '25) §3.2.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F


class _Parallel(nn.Module):
    def __init__(self, num_experts: int, group: Optional[str], ranks: int, rank: int, sp: bool) -> None:
        super().__init__()
        if num_experts % ranks:
            raise ValueError(f"{num_experts} experts over {ranks} ranks")
        self.num_experts, self.group, self.ranks, self.rank, self.sp = num_experts, group, ranks, rank, sp
        self.local = num_experts // ranks

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_gather_tensor_autograd(x, 1, self.group) if self.sp else x

    def _own_chunk(self, y: torch.Tensor) -> torch.Tensor:
        return y.chunk(self.ranks, dim=1)[self.rank] if self.sp else y


def _init(module: nn.Module, seed: int, router: nn.Parameter) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        router.mul_(4.0)  # peaked routing: experts get uneven loads


class EinsumCapacityMoE(_Parallel):
    def __init__(
        self,
        hidden: int,
        num_experts: int,
        ffn: int,
        top_k: int,
        capacity: int,
        *,
        group: Optional[str] = None,
        ranks: int = 1,
        rank: int = 0,
        sp: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__(num_experts, group, ranks, rank, sp)
        self.top_k, self.capacity = top_k, capacity
        self.wg = nn.Parameter(torch.empty(num_experts, hidden))
        # This rank's experts only: [E/N, H, F], [E/N, H, F], [E/N, F, H].
        self.wi_0 = nn.Parameter(torch.empty(self.local, hidden, ffn))
        self.wi_1 = nn.Parameter(torch.empty(self.local, hidden, ffn))
        self.wo = nn.Parameter(torch.empty(self.local, ffn, hidden))
        _init(self, seed + rank, self.wg)
        with torch.no_grad():  # the router is replicated
            self.wg.copy_(
                torch.randn(self.wg.shape, generator=torch.Generator().manual_seed(seed)) * 4 / hidden**0.5
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self._gather(x)
        b, s, h = x.shape
        t, e, c = b * s, self.num_experts, self.capacity
        tok = x.reshape(t, h)
        probs = (tok.float() @ self.wg.float().t()).softmax(-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        combine = tok.new_zeros(t, e, c, dtype=torch.float32)
        filled = torch.zeros(e, dtype=torch.int64)
        for j in range(self.top_k):
            mask = F.one_hot(top_i[:, j], e)  # [T, E]
            pos = (torch.cumsum(mask, dim=0) - 1 + filled) * mask
            filled = filled + mask.sum(0)
            slot = pos.sum(-1)  # [T]
            keep = (slot < c).float()
            combine = (
                combine
                + (top_p[:, j] * keep)[:, None, None]
                * mask[:, :, None].float()
                * F.one_hot(slot.clamp(max=c - 1), c)[:, None, :].float()
            )
        dispatch = (combine > 0).to(x.dtype)
        expert_in = torch.einsum("tec,th->ech", dispatch, tok)
        expert_out = self._experts(expert_in)
        y = torch.einsum("tec,ech->th", combine.to(x.dtype), expert_out).reshape(b, s, h)
        balance = e * (probs.mean(0) * F.one_hot(top_i[:, 0], e).float().mean(0)).sum()
        return self._own_chunk(y), balance

    def _experts(self, expert_in: torch.Tensor) -> torch.Tensor:
        e, c, h = expert_in.shape
        n, local = self.ranks, self.local
        if self.group is not None:
            expert_in = funcol.all_to_all_single_autograd(expert_in.reshape(e * c, h), None, None, self.group)
        rows = expert_in.reshape(n, local, c, h).permute(1, 0, 2, 3).reshape(local, n * c, h)
        act = F.silu(torch.einsum("esh,ehf->esf", rows, self.wi_0)) * torch.einsum(
            "esh,ehf->esf", rows, self.wi_1
        )
        out = torch.einsum("esf,efh->esh", act, self.wo)
        out = out.reshape(local, n, c, h).permute(1, 0, 2, 3).reshape(e * c, h)
        if self.group is not None:
            out = funcol.all_to_all_single_autograd(out, None, None, self.group)
        return out.reshape(e, c, h)


class SortDroplessMoE(_Parallel):
    def __init__(
        self,
        hidden: int,
        num_experts: int,
        ffn: int,
        top_k: int,
        *,
        group: Optional[str] = None,
        ranks: int = 1,
        rank: int = 0,
        sp: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__(num_experts, group, ranks, rank, sp)
        self.top_k = top_k
        self.router = nn.Parameter(torch.empty(num_experts, hidden))
        # Stored the way F.linear takes them: gate/up [E/N, F, H], down [E/N, H, F].
        self.gate = nn.Parameter(torch.empty(self.local, ffn, hidden))
        self.up = nn.Parameter(torch.empty(self.local, ffn, hidden))
        self.down = nn.Parameter(torch.empty(self.local, hidden, ffn))
        _init(self, seed + rank, self.router)
        with torch.no_grad():
            self.router.copy_(
                torch.randn(self.router.shape, generator=torch.Generator().manual_seed(seed))
                * 4
                / hidden**0.5
            )

    def _ffn(self, rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        outs = []
        for i, chunk in enumerate(rows.split(sizes)):
            outs.append(
                F.linear(F.silu(F.linear(chunk, self.gate[i])) * F.linear(chunk, self.up[i]), self.down[i])
            )
        return torch.cat(outs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._gather(x)
        shape, h = x.shape, x.shape[-1]
        tok = x.reshape(-1, h)
        scores = torch.softmax(F.linear(tok.float(), self.router.float()), dim=-1)
        weights, chosen = torch.topk(scores, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.flatten()
        _, perm = torch.sort(flat, stable=True)
        counts = F.one_hot(flat, self.num_experts).sum(0)
        source = perm // self.top_k
        rows = tok.index_select(0, source)
        if self.group is None:
            done = self._ffn(rows, counts.tolist())
        else:
            n, local = self.ranks, self.local
            incoming = funcol.all_to_all_single(counts, None, None, self.group)
            send = counts.view(n, local).sum(1).tolist()
            recv = incoming.view(n, local).sum(1).tolist()
            got = funcol.all_to_all_single_autograd(rows, recv, send, self.group)
            expert_of = torch.arange(local).repeat(n).repeat_interleave(incoming, output_size=got.shape[0])
            _, regroup = torch.sort(expert_of, stable=True)
            ran = self._ffn(got[regroup], incoming.view(n, local).sum(0).tolist())
            back = torch.empty_like(ran)
            back[regroup] = ran
            done = funcol.all_to_all_single_autograd(back, send, recv, self.group)
        y = torch.zeros_like(tok).index_add(
            0, source, done * weights.flatten()[perm].unsqueeze(-1).to(done.dtype)
        )
        return self._own_chunk(y.reshape(shape))


class _Expert(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExpertLoopMoE(_Parallel):
    def __init__(
        self,
        hidden: int,
        num_experts: int,
        ffn: int,
        top_k: int,
        *,
        group: Optional[str] = None,
        ranks: int = 1,
        rank: int = 0,
        sp: bool = False,
        seed: int = 0,
        scoring: str = "softmax",
    ) -> None:
        super().__init__(num_experts, group, ranks, rank, sp)
        self.top_k, self.scoring = top_k, scoring
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(_Expert(hidden, ffn) for _ in range(self.local))
        _init(self, seed + rank, self.gate.weight)
        with torch.no_grad():
            self.gate.weight.copy_(
                torch.randn(self.gate.weight.shape, generator=torch.Generator().manual_seed(seed))
                * 4
                / hidden**0.5
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self._gather(hidden_states)
        batch, seq, dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, dim)
        router_logits = self.gate(hidden_states)
        if self.scoring == "sigmoid":
            routing_weights = torch.sigmoid(router_logits.float())
        else:
            routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        if self.group is None:
            final = self._loop(hidden_states, selected_experts, routing_weights)
        else:
            final = self._expert_parallel(hidden_states, selected_experts, routing_weights)
        return self._own_chunk(final.reshape(batch, seq, dim))

    def _loop(self, hidden_states, selected_experts, routing_weights):
        final = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_states.shape[-1])
            current = self.experts[expert_idx](current_state) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(hidden_states.dtype))
        return final

    def _expert_parallel(self, hidden_states, selected_experts, routing_weights):
        n, local = self.ranks, self.local
        flat = selected_experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        counts = torch.zeros(self.num_experts, dtype=torch.int64).index_add_(0, flat, torch.ones_like(flat))
        incoming = funcol.all_to_all_single(counts, None, None, self.group)
        send = counts.view(n, local).sum(1).tolist()
        recv = incoming.view(n, local).sum(1).tolist()
        got = funcol.all_to_all_single_autograd(hidden_states[token], recv, send, self.group)
        local_expert = torch.arange(local).repeat(n).repeat_interleave(incoming, output_size=got.shape[0])
        result = torch.zeros_like(got)
        for expert_idx in range(local):
            (rows,) = torch.where(local_expert == expert_idx)
            result.index_add_(0, rows, self.experts[expert_idx](got[rows]))
        back = funcol.all_to_all_single_autograd(result, send, recv, self.group)
        weighted = back * routing_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, token, weighted)
