"""Moving assignment rows to the ranks that own their experts and back.

An :class:`Exchange` is built once per layer call from the
:class:`~.routing.Assignments` of this rank's tokens. ``to_experts(rows)`` sends
one row per assignment (any width) to the owner of its expert and returns, per
local expert, the rows it received from every rank; ``to_tokens(rows)`` sends
per-local-expert rows back so that row ``a`` of the result answers assignment
``a``. The same exchange serves the forward (tokens out, expert outputs back)
and the backward (tokens and output gradients out, input gradients back).

Two wire formats (expert ``e`` lives on rank ``e // (E/N)``):

* *capacity*: a static ``[E, slots, W]`` buffer (empty slots are zero rows) and one
  ``all_to_all`` with equal splits -- GShard's layout, bytes fixed by shapes;
* *dropless*: only the kept rows, sorted by expert; an ``all_to_all`` of the
  per-expert counts first, then one with those split sizes (torchtitan style).

Without a process group every expert is local and nothing is sent.

Each direction has a ``start_*`` form that issues the all_to_all asynchronously and returns
a :class:`Pending` whose ``wait()`` gives the result: :func:`token_chunk_exchanges` builds
one exchange per contiguous token chunk (dropless) with a single count exchange for all of
them, so that one chunk's rows travel while another chunk's experts compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from commfuse.core.kernel_collectives import announce
from commfuse.ops.moe_layer.routing import Assignments


@dataclass
class Pending:
    """An exchange in flight: ``wait()`` waits for the all_to_all and returns its result."""

    received: torch.Tensor
    work: Any  # the c10d Work, or None when nothing was sent
    finish: Callable[[torch.Tensor], Any]

    def wait(self) -> Any:
        if self.work is not None:
            self.work.wait()
        return self.finish(self.received)


class Exchange:
    def __init__(
        self,
        a: Assignments,
        num_experts: int,
        group: Optional[dist.ProcessGroup],
        recv_counts: Optional[torch.Tensor] = None,
    ) -> None:
        """``recv_counts`` (dropless): the ``[source rank, local expert]`` counts when they were
        exchanged already (:func:`token_chunk_exchanges`); else they are exchanged here."""
        self.a = a
        self.group = group
        self.n = 1 if group is None else dist.get_world_size(group)
        if num_experts % self.n:
            raise ValueError(f"{num_experts} experts do not split over {self.n} ranks")
        self.num_experts, self.local = num_experts, num_experts // self.n
        if a.slots_per_expert == 0:
            self._plan_dropless(recv_counts)

    # -- dropless bookkeeping ------------------------------------------------
    def _plan_dropless(self, recv_counts: Optional[torch.Tensor]) -> None:
        a, n, local = self.a, self.n, self.local
        self.order = torch.argsort(a.expert, stable=True)
        counts = torch.bincount(a.expert, minlength=self.num_experts)
        self.send_splits = counts.view(n, local).sum(1).tolist()
        if recv_counts is None:
            recv_counts = self._a2a(counts)
        recv_counts = recv_counts.reshape(n, local)  # [source rank, local expert]
        self.recv_splits = recv_counts.sum(1).tolist()
        self.per_expert = recv_counts.sum(0).tolist()
        # Received rows are grouped by source, then expert; experts need them grouped by expert.
        row_expert = torch.repeat_interleave(torch.arange(local).repeat(n), recv_counts.reshape(-1))
        self.by_expert = torch.argsort(row_expert, stable=True)

    def _a2a(
        self,
        rows: torch.Tensor,
        out_splits: Optional[list[int]] = None,
        in_splits: Optional[list[int]] = None,
    ) -> torch.Tensor:
        """all_to_all along dim 0 (equal splits without split sizes); identity without a group."""
        out, work = _start_a2a(rows, self.group, out_splits, in_splits)
        if work is not None:
            work.wait()
        return out

    # -- the two directions ---------------------------------------------------
    def start_to_experts(self, rows: torch.Tensor) -> Pending:
        """Issue :meth:`to_experts` without waiting."""
        a, width = self.a, rows.shape[1]
        if a.slots_per_expert:
            buf = rows.new_zeros(self.num_experts, a.slots_per_expert, width)
            buf[a.expert, a.slot] = rows

            def by_expert_slots(
                recv: torch.Tensor,
            ) -> list[torch.Tensor]:  # [N * local, slots, W], source-major
                recv = recv.view(self.n, self.local, a.slots_per_expert, width).transpose(0, 1)
                return list(recv.reshape(self.local, self.n * a.slots_per_expert, width).unbind(0))

            return Pending(*_start_a2a(buf, self.group), by_expert_slots)
        return Pending(
            *_start_a2a(rows[self.order], self.group, self.recv_splits, self.send_splits),
            lambda recv: list(recv[self.by_expert].split(self.per_expert)),
        )

    def to_experts(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """``rows [A, W]`` (one per assignment) -> per local expert ``[M_l, W]``."""
        return self.start_to_experts(rows).wait()

    def start_to_tokens(self, per_expert: list[torch.Tensor]) -> Pending:
        """Issue :meth:`to_tokens` without waiting."""
        a = self.a
        width = per_expert[0].shape[1]
        if a.slots_per_expert:
            back = torch.stack(per_expert).view(self.local, self.n, a.slots_per_expert, width).transpose(0, 1)
            return Pending(
                *_start_a2a(back.reshape(self.num_experts, a.slots_per_expert, width), self.group),
                lambda ret: ret[a.expert, a.slot],
            )
        grouped = torch.cat(per_expert)
        recv_order = torch.empty_like(grouped)
        recv_order[self.by_expert] = grouped

        def in_assignment_order(sent_back: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(sent_back)
            out[self.order] = sent_back
            return out

        return Pending(
            *_start_a2a(recv_order, self.group, self.send_splits, self.recv_splits), in_assignment_order
        )

    def to_tokens(self, per_expert: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`to_experts`: per-local-expert rows -> ``[A, W]``."""
        return self.start_to_tokens(per_expert).wait()


def _start_a2a(
    rows: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    out_splits: Optional[list[int]] = None,
    in_splits: Optional[list[int]] = None,
) -> tuple[torch.Tensor, Any]:
    """Issue an all_to_all along dim 0 (equal splits without split sizes): ``(output, work)``;
    without a group the rows themselves and no work."""
    if group is None:
        return rows, None
    shape = rows.shape if out_splits is None else (sum(out_splits), *rows.shape[1:])
    out = rows.new_empty(shape)
    work = dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group, async_op=True)
    announce(
        "all_to_all",
        group.group_name,
        rows.numel() * rows.element_size(),
        out.numel() * out.element_size(),
        work,
        "commfuse::moe_layer",
    )
    return out, work


def token_chunks(a: Assignments, tokens: int, chunks: int) -> list[Assignments]:
    """Dropless assignments of ``tokens`` tokens cut into ``chunks`` contiguous token ranges
    (as even as ``tensor_split``). Dropless assignments are token-major, so each range is a
    contiguous run of assignments and the chunks concatenated are the assignments again."""
    if a.slots_per_expert:
        raise ValueError("token chunks of capacity assignments would change which rows are dropped")
    per_token = a.token.numel() // tokens if tokens else 0
    out, start = [], 0
    for size in torch.arange(tokens).tensor_split(chunks):
        stop = start + size.numel() * per_token
        out.append(
            Assignments(
                a.token[start:stop], a.expert[start:stop], a.choice[start:stop], a.slot[start:stop], 0
            )
        )
        start = stop
    return out


def token_chunk_exchanges(
    parts: list[Assignments], num_experts: int, group: Optional[dist.ProcessGroup]
) -> list[Exchange]:
    """One dropless :class:`Exchange` per chunk of assignments; the per-expert counts of all
    chunks travel in one all_to_all (``[k, E]`` counts, each rank receiving its experts' rows)."""
    n = 1 if group is None else dist.get_world_size(group)
    k, local = len(parts), num_experts // n
    counts = torch.stack([torch.bincount(p.expert, minlength=num_experts) for p in parts])  # [k, E]
    sent = counts.view(k, n, local).transpose(0, 1).contiguous()  # [destination, chunk, local expert]
    received, work = _start_a2a(sent.view(n * k, local), group)
    if work is not None:
        work.wait()
    received = received.view(n, k, local)  # [source, chunk, local expert]
    return [Exchange(p, num_experts, group, received[:, i]) for i, p in enumerate(parts)]
