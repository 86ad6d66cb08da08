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
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from commfuse.ops.moe_layer.routing import Assignments


class Exchange:
    def __init__(self, a: Assignments, num_experts: int, group: Optional[dist.ProcessGroup]) -> None:
        self.a = a
        self.group = group
        self.n = 1 if group is None else dist.get_world_size(group)
        if num_experts % self.n:
            raise ValueError(f"{num_experts} experts do not split over {self.n} ranks")
        self.num_experts, self.local = num_experts, num_experts // self.n
        if a.slots_per_expert == 0:
            self._plan_dropless()

    # -- dropless bookkeeping ------------------------------------------------
    def _plan_dropless(self) -> None:
        a, n, local = self.a, self.n, self.local
        self.order = torch.argsort(a.expert, stable=True)
        counts = torch.bincount(a.expert, minlength=self.num_experts)
        self.send_splits = counts.view(n, local).sum(1).tolist()
        recv_counts = self._a2a(counts)
        recv_counts = recv_counts.view(n, local)  # [source rank, local expert]
        self.recv_splits = recv_counts.sum(1).tolist()
        self.per_expert = recv_counts.sum(0).tolist()
        # Received rows are grouped by source, then expert; experts need them grouped by expert.
        row_expert = torch.repeat_interleave(torch.arange(local).repeat(n), recv_counts.reshape(-1))
        self.by_expert = torch.argsort(row_expert, stable=True)

    def _a2a(self, rows: torch.Tensor, out_splits: Optional[list[int]] = None,
             in_splits: Optional[list[int]] = None) -> torch.Tensor:
        """all_to_all along dim 0 (equal splits without split sizes); identity without a group."""
        if self.group is None:
            return rows
        shape = rows.shape if out_splits is None else (sum(out_splits), *rows.shape[1:])
        out = rows.new_empty(shape)
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=self.group)
        return out

    # -- the two directions ---------------------------------------------------
    def to_experts(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """``rows [A, W]`` (one per assignment) -> per local expert ``[M_l, W]``."""
        a, width = self.a, rows.shape[1]
        if a.slots_per_expert:
            buf = rows.new_zeros(self.num_experts, a.slots_per_expert, width)
            buf[a.expert, a.slot] = rows
            recv = self._a2a(buf)  # [N * local, slots, W], source-major
            recv = recv.view(self.n, self.local, a.slots_per_expert, width).transpose(0, 1)
            return list(recv.reshape(self.local, self.n * a.slots_per_expert, width).unbind(0))
        sent = rows[self.order]
        recv = self._a2a(sent, self.recv_splits, self.send_splits)[self.by_expert]
        return list(recv.split(self.per_expert))

    def to_tokens(self, per_expert: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`to_experts`: per-local-expert rows -> ``[A, W]``."""
        a = self.a
        width = per_expert[0].shape[1]
        if a.slots_per_expert:
            back = torch.stack(per_expert).view(self.local, self.n, a.slots_per_expert, width).transpose(0, 1)
            ret = self._a2a(back.reshape(self.num_experts, a.slots_per_expert, width))
            return ret[a.expert, a.slot]
        grouped = torch.cat(per_expert)
        recv_order = torch.empty_like(grouped)
        recv_order[self.by_expert] = grouped
        sent_back = self._a2a(recv_order, self.send_splits, self.recv_splits)
        out = torch.empty_like(sent_back)
        out[self.order] = sent_back
        return out
