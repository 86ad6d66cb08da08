"""Launches: NCCL calls merged by (communicator, opCount) -- what ran as one kernel.

Contract
- NCCL's ``opCount`` counts kernel launches of a communicator: every call of one
  ``ncclGroupStart/End`` (coalesced collectives, the Send/Recv pairs of an all_to_all or a
  pipeline exchange) shares it, and one kernel runs them all (p2p in
  ``ncclDevKernel_SendRecv``). `launches` merges calls by ``(communicator, opCount)`` in order
  of first appearance; a line logged twice (the NCCL-trace thesis's "ranks that log twice as
  many calls as kernels", Tables 4.1-4.2) adds nothing but a tuning decision it carried. An
  ``opCount`` lower than the pointer's last starts a new epoch (the pointer was reused by a
  new communicator).
- A launch's symbol is the kernel it runs: ``SendRecv`` for p2p groups, the op for one op,
  ``Mixed`` for grouped collectives of different ops (NCCL names the kernel after one of them).

Source: NCCL ``src/enqueue.cc`` (the call line) and ``src/proxy.cc`` (``comm->opCount++`` once
per launch); NVIDIA/nccl #584 (a Send and a Recv sharing an opCount).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from commfuse.trace.nccl_log import NcclCall


@dataclass
class Launch:
    """The calls NCCL ran as one kernel: one ``(communicator, opCount)``."""

    index: int
    comm: str
    op_count: int
    epoch: int
    calls: list[NcclCall]

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.op for c in self.calls))

    @property
    def symbol(self) -> str:
        """What kernel this launch runs: ``SendRecv`` for p2p, the op, or ``Mixed``."""
        ops = self.ops
        if all(o in ("Send", "Recv", "SendRecv") for o in ops):
            return "SendRecv"
        return ops[0] if len(ops) == 1 else "Mixed"

    @property
    def first(self) -> NcclCall:
        return self.calls[0]

    @property
    def time_us(self) -> Optional[float]:
        """When the launch's last call was logged: NCCL launches a group at its end."""
        return self.calls[-1].time_us

    @property
    def dtype(self) -> Optional[str]:
        d = {c.dtype for c in self.calls}
        return d.pop() if len(d) == 1 else None

    @property
    def algo(self) -> Optional[str]:
        return next((c.algo for c in self.calls if c.algo), None)

    @property
    def proto(self) -> Optional[str]:
        return next((c.proto for c in self.calls if c.proto), None)

    @property
    def nranks(self) -> Optional[int]:
        return next((c.nranks for c in self.calls if c.nranks), None)

    @property
    def bytes(self) -> int:
        return sum(c.bytes or 0 for c in self.calls)


def launches(calls: Sequence[NcclCall], *, dedup: bool = True) -> list[Launch]:
    """Merge calls by (communicator, opCount) in order of first appearance (module docstring)."""
    out: list[Launch] = []
    if not dedup:
        return [Launch(i, c.comm, c.op_count, 0, [c]) for i, c in enumerate(calls)]
    by_key: dict[tuple[str, int, int], Launch] = {}
    last: dict[str, int] = {}
    epoch: dict[str, int] = defaultdict(int)
    for c in calls:
        prev = last.get(c.comm)
        if prev is not None and c.op_count < prev:
            epoch[c.comm] += 1
        last[c.comm] = c.op_count
        key = (c.comm, epoch[c.comm], c.op_count)
        lau = by_key.get(key)
        if lau is None:
            lau = by_key[key] = Launch(len(out), c.comm, c.op_count, epoch[c.comm], [])
            out.append(lau)
        twin = next((d for d in lau.calls if _same_call(c, d)), None)
        if twin is None:
            lau.calls.append(c)
        elif twin.algo is None and c.algo is not None:  # a line logged twice adds nothing but its tuning
            twin.algo, twin.proto, twin.channels = c.algo, c.proto, c.channels
    return out


def _same_call(a: NcclCall, b: NcclCall) -> bool:
    return (a.op, a.count, a.datatype, a.redop, a.root, a.sendbuff, a.recvbuff) == (
        b.op,
        b.count,
        b.datatype,
        b.redop,
        b.root,
        b.sendbuff,
        b.recvbuff,
    )


__all__ = ["Launch", "launches"]
