"""Strand segments for DHelix strand interleaving: typed units, legal orders, self-overlap merging.

Contract
- :class:`Segment` is one schedulable unit of one strand (one operator, or several operators
  of one strand merged because they already overlap each other): ``name``, ``kind`` (one of
  :data:`SEGMENT_KINDS`: ``compute``, ``comm_local`` = intra-node collective, ``comm_cross``
  = inter-node collective), solo ``duration`` (>= 0, seconds or any consistent unit) and
  ``mem_delta`` (activation bytes the unit leaves allocated: > 0 in a forward, < 0 for a
  backward that frees). Values are validated; errors name the field.
- :func:`legal_orders` enumerates the topological orders of one layer's operator DAG in a
  deterministic order (lexicographic in the input's op order), stopping with a
  ``ValueError`` beyond ``limit`` orders (DHelix only moves the weight-gradient GEMM and the
  MoE router, so real layers have few orders; a blow-up means a wrong DAG).
- :func:`commfuse.dhelix.overlap.merge_overlapping` merges groups of *adjacent* segments of one strand that overlap
  each other into one segment (DHelix Fig. 10: "self-overlapping operators within a strand
  are treated as a single operator in the pairing search"). The merged duration folds the
  members pairwise with the Eq. 1 model of :mod:`.overlap`; the merged ``mem_delta`` is
  the sum; the merged ``kind`` is the kind of the longest member (ties: earlier member),
  i.e. the resource the unit mostly occupies when it is paired with the other strand.
  That kind rule is a modelling choice of commfuse, not the paper's.

Source: Wang et al., "Hiding Communication Cost in Distributed LLM Training via
Micro-batch Co-execution" (DHelix), Sec. 4.2 ("Operator Sequencing and Partitioning").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

SEGMENT_KINDS = ("compute", "comm_local", "comm_cross")


@dataclass(frozen=True)
class Segment:
    name: str
    kind: str
    duration: float
    mem_delta: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Segment.name must be a non-empty str, got {self.name!r}")
        if self.kind not in SEGMENT_KINDS:
            raise ValueError(f"Segment {self.name!r}: kind must be one of {SEGMENT_KINDS}, got {self.kind!r}")
        for field in ("duration", "mem_delta"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"Segment {self.name!r}: {field} must be a finite number, got {v!r}")
        if self.duration < 0:
            raise ValueError(f"Segment {self.name!r}: duration must be >= 0, got {self.duration!r}")


def check_strand(segments: Sequence[Segment], what: str) -> tuple[Segment, ...]:
    """Validate one strand (a sequence of distinct-named :class:`Segment`)."""
    out = tuple(segments)
    for k, s in enumerate(out):
        if not isinstance(s, Segment):
            raise ValueError(f"{what}[{k}] must be a Segment, got {type(s).__name__}")
    names = [s.name for s in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{what}: segment names must be unique, repeated: {dup}")
    return out


def legal_orders(
    ops: Sequence[str], deps: Mapping[str, Iterable[str]], *, limit: int = 10_000
) -> list[tuple[str, ...]]:
    """All topological orders of ``ops`` under ``deps`` (op -> ops it needs first).

    Deterministic: orders come out lexicographically by position in ``ops``, whatever
    the iteration order of ``deps`` or its value collections."""
    ops = tuple(ops)
    index = {o: k for k, o in enumerate(ops)}
    if len(index) != len(ops):
        raise ValueError("legal_orders: ops must be unique")
    preds: dict[str, frozenset[str]] = {o: frozenset() for o in ops}
    for o, ds in deps.items():
        if o not in index:
            raise ValueError(f"legal_orders: deps names unknown op {o!r}")
        ds = frozenset(ds)
        bad = sorted(d for d in ds if d not in index)
        if bad:
            raise ValueError(f"legal_orders: deps[{o!r}] names unknown ops {bad}")
        preds[o] = ds
    out: list[tuple[str, ...]] = []
    order: list[str] = []
    placed: set[str] = set()

    def rec() -> None:
        if len(order) == len(ops):
            if len(out) >= limit:
                raise ValueError(f"legal_orders: more than limit={limit} orders; is the DAG missing edges?")
            out.append(tuple(order))
            return
        for o in ops:  # position order -> lexicographic output
            if o not in placed and preds[o] <= placed:
                placed.add(o)
                order.append(o)
                rec()
                order.pop()
                placed.discard(o)

    rec()
    if not out:
        raise ValueError("legal_orders: the dependency graph has a cycle")
    return out
