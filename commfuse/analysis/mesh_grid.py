"""Two process groups that cross as the two dims of a 2-D mesh, from partitions every rank knows.

A collective on group A followed by one on group B moves data between ranks that are in
neither of *this* rank's groups: the rank ``(k, i)`` of the mesh talks to its A-peers, and
they to their B-peers. Rewriting the pair into one transfer over the plane that A and B span
is therefore only correct when every rank of the plane derives the same plane, with the same
coordinates. This rank cannot see the other ranks' groups in its own process groups, so the
facts come from the partitions every rank shares: a DeviceMesh's dims (``commfuse.setup(mesh=)``
or the graph's DTensor meshes) and ``setup(groups=)``.

:func:`find_grid` returns the :class:`Grid` (coordinates of every rank of the plane) when A's
and B's partitions cover the plane as a product: every A-block meets every B-block of the plane
in exactly one rank, a rank's position in its A-block is the same along its B-block and vice
versa (a DeviceMesh's dims always are), or a sentence saying why not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

Ranks = tuple[int, ...]


@dataclass(frozen=True)
class Grid:
    """The plane of two crossing groups: ``rank_at[k][i]`` is the global rank at position ``k``
    of its A-block and position ``i`` of its B-block (``n1`` = |A|, ``n2`` = |B|)."""

    n1: int
    n2: int
    rank_at: tuple[tuple[int, ...], ...]

    @property
    def ranks(self) -> Ranks:
        return tuple(sorted(r for row in self.rank_at for r in row))

    def coords(self) -> dict[int, tuple[int, int]]:
        return {r: (k, i) for k, row in enumerate(self.rank_at) for i, r in enumerate(row)}


def _block_map(partitions: Sequence[Sequence[Sequence[int]]], block: Ranks) -> Optional[dict[int, Ranks]]:
    """rank -> its block, for the partition that has ``block`` (same ranks, same order) and covers
    the most ranks (a mesh slice lists only this rank's block; the mesh it was cut from, all)."""
    best: Optional[dict[int, Ranks]] = None
    for part in partitions:
        blocks = [tuple(int(r) for r in b) for b in part]
        if block not in blocks:
            continue
        out: dict[int, Ranks] = {}
        for b in blocks:
            for r in b:
                if r in out:  # not a partition: a rank in two blocks
                    return None
                out[r] = b
        if best is None or len(out) > len(best):
            best = out
    return best


def find_grid(
    a: Sequence[int], b: Sequence[int], partitions: Sequence[Sequence[Sequence[int]]]
) -> Union[Grid, str]:
    """The plane groups ``a`` and ``b`` (global ranks in group-rank order) span, or why not."""
    a, b = tuple(a), tuple(b)
    if len(set(a) & set(b)) != 1:
        return f"groups [{_fmt(a)}] and [{_fmt(b)}] share {len(set(a) & set(b))} ranks, not one"
    of_a, of_b = _block_map(partitions, a), _block_map(partitions, b)
    missing = [f"[{_fmt(g)}]" for g, m in ((a, of_a), (b, of_b)) if m is None]
    if missing:
        return (
            f"the blocks of {' and '.join(missing)} on the other ranks are unknown (declare the mesh: "
            "DTensor, commfuse.setup(mesh=...) or setup(groups=...))"
        )
    plane, todo = set(), list(a)
    while todo:
        r = todo.pop()
        if r in plane:
            continue
        if r not in of_a or r not in of_b:
            return f"rank {r} of the plane is in no known block of one of the two groups"
        plane.add(r)
        todo.extend(of_a[r] + of_b[r])
    n1, n2 = len(a), len(b)
    if len(plane) != n1 * n2:
        return f"the plane of the two groups has {len(plane)} ranks, not {n1} x {n2}"
    rank_at: list[list[Optional[int]]] = [[None] * n2 for _ in range(n1)]
    for r in plane:
        ba, bb = of_a[r], of_b[r]
        if len(ba) != n1 or len(bb) != n2:
            return f"rank {r}'s blocks have sizes {len(ba)} and {len(bb)}, not {n1} and {n2}"
        k, i = ba.index(r), bb.index(r)
        if rank_at[k][i] is not None:
            return f"ranks {rank_at[k][i]} and {r} have the same mesh coordinates ({k}, {i})"
        rank_at[k][i] = r
    # product structure: along an A-block the B-position is constant, and vice versa
    for r in plane:
        k, i = of_a[r].index(r), of_b[r].index(r)
        if any(of_b[q].index(q) != i for q in of_a[r]) or any(of_a[q].index(q) != k for q in of_b[r]):
            return (
                "the two groups' blocks do not cross as the dims of a mesh (positions differ along a block)"
            )
    return Grid(n1, n2, tuple(tuple(int(r) for r in row) for row in rank_at))


def _fmt(ranks: Ranks) -> str:
    return ",".join(map(str, ranks))


__all__ = ["Grid", "find_grid"]
