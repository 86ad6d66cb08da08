"""Batched point-to-point transfers behind one ``Work``: the runtime of commfuse's boundary ops.

``issue_batched(pg, sends, recvs, finish)`` posts every receive, then every send, of one
boundary op on one rank as asynchronous ``isend``/``irecv`` (through
``dist.batch_isend_irecv``, which NCCL runs as one group of p2p calls and gloo as
independent calls), and returns a :class:`BatchedWork` that

* waits for all of them (``wait``), then runs ``finish`` once (e.g. copying a staging
  buffer into the op's output); a second ``wait`` does nothing;
* keeps every buffer alive until then (the caller's input may be freed or reused as
  soon as the op returns: the send buffers are copies).

The op ties that one Work to its output with ``register_work``, so the graph's single
``_c10d_functional.wait_tensor`` waits for every transfer. ``register_work`` wraps a
Python ``Work`` subclass in c10d's ``PyWorkHolder``, which holds the Python object, so
the work survives until it is waited (checked on torch 2.13 with gloo).

Why point-to-point and not one ``all_to_all`` over the group: a collective must be
entered by every member in the same order, and a 1F1B pipeline issues its boundary
transfers in opposite orders on the two sides (stage s sends activations of micro-batch
m+1 before receiving the gradient of m; stage s+1 the reverse). Point-to-point messages
are matched per (sender, receiver) pair in posting order (one tag, 0), so transfers in
opposite directions never wait on each other, and the order constraint is only that the
two ends of each pair post their messages between them in the same order.

Empty pieces are not sent at all (both ends know every size from the op's arguments),
and a rank's piece to itself is a local copy (gloo has no self-pair).

NCCL caveat (``dist.batch_isend_irecv``): if the first operation ever issued on a
process group is a batched p2p, every member of the group must take part in it.
Source: Chimera §3 (M2MS, destination order i%N, (i+1)%N, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class Transfer:
    """One message of this rank: ``peer`` is a group rank, ``tensor`` is contiguous."""

    peer: int
    tensor: Tensor


class BatchedWork(dist.Work):
    """Several c10d works (and the buffers they use) that complete as one."""

    def __init__(
        self,
        works: Sequence[Any],
        keep_alive: Sequence[Tensor] = (),
        finish: Optional[Callable[[], None]] = None,
    ) -> None:
        super().__init__()
        self._works = list(works)
        self._keep = list(keep_alive)
        self._finish = finish
        self._done = False

    def wait(self, timeout=None) -> bool:  # noqa: D401 - c10d's signature
        if self._done:
            return True
        for w in self._works:
            # A zero timedelta is c10d's "no timeout" (what wait_tensor passes).
            w.wait() if timeout is None else w.wait(timeout)
        if self._finish is not None:
            self._finish()
        self._done = True
        self._works, self._keep, self._finish = [], [], None
        return True

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)


def issue_batched(
    pg,
    sends: Sequence[Transfer],
    recvs: Sequence[Transfer],
    finish: Optional[Callable[[], None]] = None,
    keep_alive: Sequence[Tensor] = (),
) -> BatchedWork:
    """Post ``recvs`` then ``sends`` (in the given orders) on ``pg``; one work for all of them."""
    ops = [dist.P2POp(dist.irecv, t.tensor, group=pg, group_peer=t.peer) for t in recvs]
    ops += [dist.P2POp(dist.isend, t.tensor, group=pg, group_peer=t.peer) for t in sends]
    for t in (*recvs, *sends):
        if not t.tensor.is_contiguous():  # c10d p2p needs dense buffers; callers guarantee it
            raise RuntimeError("commfuse boundary op: internal error, p2p buffer is not contiguous")
    works = dist.batch_isend_irecv(ops) if ops else []
    bufs = [t.tensor for t in (*recvs, *sends)]
    return BatchedWork([w for w in works if w is not None], (*bufs, *keep_alive), finish)


__all__ = ["BatchedWork", "Transfer", "issue_batched"]
