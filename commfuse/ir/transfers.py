"""Every message of one boundary op (``commfuse::m2ms``, ``commfuse::stage_transfer``).

The IR's vocabulary for ops that are sets of point-to-point messages: the cost model and the
volume formulas price them, the ops' IR view (:mod:`commfuse.ops.boundary.ir_view`) reads them
from graph nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from commfuse.ir.shapes import Size

M2MS_OP = "m2ms"
STAGE_TRANSFER_OP = "stage_transfer"


@dataclass(frozen=True)
class BoundaryTransfers:
    """Every message of one boundary op, on every group rank of its group G.

    ``pieces``: ``(from group rank, to group rank, bytes)`` for every non-empty piece,
    pieces to oneself included (they are local copies: :meth:`sent` / :meth:`received`
    leave them out). ``position``: the group rank the graph is for (None: unknown).
    """

    op: str  # "m2ms" | "stage_transfer"
    group_name: str
    group_size: int
    src: tuple[int, ...]
    dst: tuple[int, ...]
    dim: Optional[int]  # m2ms: normalised dim; stage_transfer: None
    splits: Optional[tuple[tuple[int, ...], ...]]  # m2ms: [i][j] = size along dim from src[i] to dst[j]
    unit_bytes: Optional[Size]  # m2ms: bytes of one index along dim; stage_transfer: bytes of x
    position: Optional[int] = None
    position_source: str = "unknown"  # "process" | "shapes" | "unknown"

    # -- the message list -------------------------------------------------------------
    def pieces(self) -> list[tuple[int, int, Size]]:
        if self.unit_bytes is None:
            return []
        if self.op == STAGE_TRANSFER_OP:
            return [
                (s, d, self.unit_bytes)
                for s, d in zip(self.src, self.dst, strict=True)
                if self.unit_bytes != 0
            ]
        out = []
        for i, s in enumerate(self.src):
            for j, d in enumerate(self.dst):
                n = self.splits[i][j]  # type: ignore[index]
                if n != 0:
                    out.append((s, d, n * self.unit_bytes))
        return out

    def sent(self, g: int) -> list[tuple[int, Size]]:
        """(peer, bytes) that group rank ``g`` sends to other ranks, in dst order."""
        return [(d, b) for s, d, b in self.pieces() if s == g and d != g]

    def received(self, g: int) -> list[tuple[int, Size]]:
        """(peer, bytes) that group rank ``g`` receives from other ranks, in src order."""
        return [(s, b) for s, d, b in self.pieces() if d == g and s != g]

    def sent_bytes(self, g: int) -> Size:
        return _total(b for _p, b in self.sent(g))

    def received_bytes(self, g: int) -> Size:
        return _total(b for _p, b in self.received(g))

    def self_bytes(self, g: int) -> Size:
        """Bytes group rank ``g`` copies locally (its piece to itself)."""
        return _total(b for s, d, b in self.pieces() if s == g and d == g)

    # -- shapes -------------------------------------------------------------------------
    def row_sum(self, g: int) -> int:
        """m2ms: size along dim of group rank g's input (0 when it is not a source)."""
        if g not in self.src or self.splits is None:
            return 0
        return sum(self.splits[self.src.index(g)])

    def column_sum(self, g: int) -> int:
        """m2ms: size along dim of group rank g's output (0 when it is not a destination)."""
        if g not in self.dst or self.splits is None:
            return 0
        j = self.dst.index(g)
        return sum(row[j] for row in self.splits)

    def describe(self) -> str:
        if self.op == STAGE_TRANSFER_OP:
            pairs = ", ".join(f"{s}->{d}" for s, d in zip(self.src, self.dst, strict=True))
            return f"stage_transfer [{pairs}] on group {self.group_name}"
        return (
            f"m2ms dim {self.dim} src {list(self.src)} -> dst {list(self.dst)} splits "
            f"{[list(r) for r in self.splits or ()]} on group {self.group_name}"
        )


def _total(vals) -> Size:
    t: Size = 0
    for v in vals:
        t = t + v
    return t


__all__ = ["M2MS_OP", "STAGE_TRANSFER_OP", "BoundaryTransfers"]
