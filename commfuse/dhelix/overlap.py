"""Overlap Effectiveness Factors (DHelix Eq. 1) and the pairwise overlap-time table P(i, j).

Contract
- DHelix Eq. 1 defines, for operators i and j with solo times T_i, T_j and co-run time P_ij,
  ``OEF_ij = (T_i + T_j - P_ij) / min(T_i, T_j)`` (1 = the shorter op is fully hidden, 0 =
  no gain). commfuse inverts it per *kind* pair to predict co-run times:

      P_ij = T_i + T_j - OEF(kind_i, kind_j) * min(T_i, T_j)

  so P_ij lies between max(T_i, T_j) (OEF = 1) and T_i + T_j (OEF = 0).
- :class:`OEFTable` holds one factor in [0, 1] per unordered kind pair; it is symmetric,
  complete (every pair of :data:`~.segments.SEGMENT_KINDS` must be given, either order,
  and both orders must agree if both are given) and independent of the input dict's order.
- :func:`default_oef` gives *illustrative* factors that follow the paper's qualitative
  findings (Sec. 3.2, Fig. 4): compute-compute overlaps poorly, compute-communication well,
  intra-node with inter-node communication well, each communication kind with itself
  poorly. They are not measurements; real use profiles them per hardware (10-30 min in
  the paper): ``python -m commfuse profile-overlap`` measures them here
  (:mod:`commfuse.dhelix.profile`).
- :func:`overlap_table` builds the (N_f+1) x (N_b+1) table of Eq. 2: ``P[i][j]`` for
  i, j >= 1 is the co-run time of forward segment i (strand beta) beside backward segment
  j (strand alpha), ``P[i][0]``/``P[0][j]`` the solo times, ``P[0][0] = 0``.

Source: DHelix (Wang et al.), Sec. 3.2 Eq. 1 and Sec. 4.2 Eq. 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from commfuse.dhelix.segments import SEGMENT_KINDS, Segment, check_strand


def _key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if SEGMENT_KINDS.index(a) <= SEGMENT_KINDS.index(b) else (b, a)


@dataclass(frozen=True)
class OEFTable:
    """Symmetric kind-pair -> OEF map; build it with :meth:`from_mapping`."""

    factors: tuple[tuple[tuple[str, str], float], ...] = field(default=())

    @classmethod
    def from_mapping(cls, mapping: Mapping[tuple[str, str], float]) -> "OEFTable":
        got: dict[tuple[str, str], float] = {}
        for pair, v in mapping.items():
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(k in SEGMENT_KINDS for k in pair)):
                raise ValueError(f"OEFTable: key {pair!r} must be a pair of kinds from {SEGMENT_KINDS}")
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not (0.0 <= v <= 1.0)
                or not math.isfinite(v)
            ):
                raise ValueError(f"OEFTable: factor for {pair!r} must be a number in [0, 1], got {v!r}")
            k = _key(*pair)
            if k in got and got[k] != v:
                raise ValueError(f"OEFTable: {pair!r} given twice with different factors ({got[k]} vs {v})")
            got[k] = float(v)
        missing = [
            (a, b) for i, a in enumerate(SEGMENT_KINDS) for b in SEGMENT_KINDS[i:] if (a, b) not in got
        ]
        if missing:
            raise ValueError(f"OEFTable: missing factors for kind pairs {missing}")
        return cls(tuple(sorted(got.items())))

    def __call__(self, a: str, b: str) -> float:
        k = _key(a, b)
        for pair, v in self.factors:
            if pair == k:
                return v
        raise ValueError(f"OEFTable: no factor for kinds ({a!r}, {b!r})")


def default_oef() -> OEFTable:
    """Illustrative factors after the paper's qualitative findings (not measured)."""
    return OEFTable.from_mapping(
        {
            ("compute", "compute"): 0.1,
            ("compute", "comm_local"): 0.9,
            ("compute", "comm_cross"): 0.9,
            ("comm_local", "comm_local"): 0.1,
            ("comm_local", "comm_cross"): 0.8,
            ("comm_cross", "comm_cross"): 0.1,
        }
    )


def pair_time(kind_a: str, t_a: float, kind_b: str, t_b: float, oef: OEFTable) -> float:
    """Predicted co-run time of two units (Eq. 1 inverted, see the module docstring)."""
    return t_a + t_b - oef(kind_a, kind_b) * min(t_a, t_b)


def overlap_table(
    fwd: Sequence[Segment], bwd: Sequence[Segment], oef: OEFTable
) -> tuple[tuple[float, ...], ...]:
    """The P table of Eq. 2 for forward strand ``fwd`` (beta) and backward strand ``bwd`` (alpha)."""
    fwd = check_strand(fwd, "fwd")
    bwd = check_strand(bwd, "bwd")
    rows = [tuple([0.0] + [float(s.duration) for s in bwd])]
    for f in fwd:
        rows.append(
            tuple([float(f.duration)] + [pair_time(f.kind, f.duration, b.kind, b.duration, oef) for b in bwd])
        )
    return tuple(rows)


def merge_overlapping(
    segments: Sequence[Segment], groups: Iterable[Sequence[str]], oef
) -> tuple[Segment, ...]:
    """Merge each group (names of adjacent segments) into one segment (see :mod:`commfuse.dhelix.segments`).

    ``oef`` is an :class:`~commfuse.dhelix.overlap.OEFTable`."""

    segs = check_strand(segments, "segments")
    pos = {s.name: k for k, s in enumerate(segs)}
    start_of: dict[int, int] = {}
    used: set[str] = set()
    for g in groups:
        g = tuple(g)
        if len(g) < 2:
            raise ValueError(f"merge_overlapping: group {g} must name at least two segments")
        missing = [n for n in g if n not in pos]
        if missing:
            raise ValueError(f"merge_overlapping: group {g} names unknown segments {missing}")
        again = [n for n in g if n in used]
        if again:
            raise ValueError(f"merge_overlapping: segments {again} appear in more than one group")
        used.update(g)
        idx = sorted(pos[n] for n in g)
        if idx != list(range(idx[0], idx[0] + len(idx))):
            raise ValueError(f"merge_overlapping: group {g} is not contiguous in the strand order")
        start_of[idx[0]] = len(idx)
    out: list[Segment] = []
    k = 0
    while k < len(segs):
        n = start_of.get(k, 1)
        members = segs[k : k + n]
        if n == 1:
            out.append(members[0])
        else:
            dur = members[0].duration
            kind_seg = members[0]
            for m in members[1:]:
                # fold pairwise: the running unit overlaps the next member by the OEF of
                # the dominant kinds so far
                dur = pair_time(kind_seg.kind, dur, m.kind, m.duration, oef)
                if m.duration > kind_seg.duration:
                    kind_seg = m
            out.append(
                Segment(
                    "+".join(m.name for m in members), kind_seg.kind, dur, sum(m.mem_delta for m in members)
                )
            )
        k += n
    return tuple(out)
