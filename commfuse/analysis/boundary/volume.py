"""Per-rank boundary bytes of a rule's before and after (Chimera Table 1 conventions).

:class:`OpBytes` (one collective of a transition: who runs it and the bytes one of its ranks
sends), :class:`RuleVolume` (a rule's collectives before and after; a rewrite is kept only when
the bytes do not grow) and :func:`ring_bytes` (Table 1 per-rank bytes of a group collective:
ring conventions, P2P/M2MS = bytes sent). The derivation is docs/boundary-fusion.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from commfuse.ir.shapes import tensor_meta


@dataclass(frozen=True)
class OpBytes:
    """One collective of a transition: who runs it and the bytes one of its ranks sends
    (Chimera Table 1's per-rank overhead: ring conventions, P2P/M2MS = bytes sent)."""

    op: str  # all_gather | reduce_scatter | all_reduce | all_to_all | stage_transfer | m2ms
    stage: int  # the stage whose ranks send
    bytes: int


@dataclass(frozen=True)
class RuleVolume:
    before: tuple[OpBytes, ...]
    after: tuple[OpBytes, ...]

    @property
    def bytes_before(self) -> int:
        return sum(o.bytes for o in self.before)

    @property
    def bytes_after(self) -> int:
        return sum(o.bytes for o in self.after)

    def to_json(self) -> dict:
        return {
            "before": [vars(o) for o in self.before],
            "after": [vars(o) for o in self.after],
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
        }


def _nbytes(node: fx.Node) -> int:
    v = tensor_meta(node)
    return int(v.numel()) * v.dtype.itemsize


def ring_bytes(kind: str, n: int, in_bytes: int) -> int:
    """Table 1 per-rank bytes of a group collective over n ranks on an input of ``in_bytes``."""
    if kind == "all_gather":
        return (n - 1) * in_bytes  # (n-1)/n of the n*in output
    if kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) * in_bytes // n
    if kind == "all_reduce":
        return 2 * (n - 1) * in_bytes // n
    raise ValueError(kind)


__all__ = ["OpBytes", "RuleVolume", "ring_bytes"]
