"""Rule a2a_p2p: an all_to_all on the sending stage followed by the stage transfer -> one m2ms
(Chimera Table 3, A2A + P2P).

Matches: a forward transfer ``T(y)`` whose value is, through single-use views, the result of
``y = A2A_s->c(x)`` (equal splits, known concat dim) on the sending stage group SA.
Produces: ``v = M(x_i, s, S[i][j] = L/n)`` and on B ``y = cat_j^c chunk_j(v, s)``
(:func:`~commfuse.analysis.boundary.templates.fused_a2a_transfer`) spliced where T was, the
views replayed on the receiving side.
Refuses: the transferred value is not an all_to_all's result (through views); the
all_to_all fails the common checks (:func:`~commfuse.analysis.boundary.matching._collective_ok`,
on SA) or has unequal splits or no known concat dim; its result has other users on the
sending stage; the two stages differ in size (the chunks do not map onto B's positions); the
split dim is not divisible by n.

Why it is the same program: B_p needs ``cat_i^c chunk_p(x_i, s)``; A_i's pieces along s are
exactly ``chunk_j(x_i, s)`` for B_j, received in src order along s and re-laid along c
locally.

Notation (A, B, SA, SB, T, n, ``x_i``, ``chunk_i``, ``M(v, d, S)``): :mod:`commfuse.analysis.boundary`.
"""

from __future__ import annotations

from commfuse.analysis.boundary.matching import (
    Env,
    Match,
    Site,
    _erase_transfer,
    _replay_views,
    _sent_collective,
    _single_use_chain,
    _uniform,
)
from commfuse.analysis.boundary.splicing import splice_autograd
from commfuse.analysis.boundary.templates import fused_a2a_transfer
from commfuse.analysis.boundary.volume import OpBytes, RuleVolume, _nbytes, ring_bytes
from commfuse.ir.kinds import CollectiveKind
from commfuse.ir.shapes import shape_of

K = CollectiveKind


def match_a2a_p2p(site: Site, env: Env) -> Match | str:
    t, bd = site.node, site.boundary
    y = t.args[0]
    found = _sent_collective(t, bd, env, K.ALL_TO_ALL)
    if isinstance(found, str):
        return found
    c, root, views = found
    if not c.extra.get("equal_splits", False) or c.logical_concat_dim is None:
        return f"{c.name} has unequal splits or no known concat dim"
    if not _single_use_chain([root, *views], t):
        return "the all_to_all's result has other users on the sending stage"
    if bd.a.size != bd.b.size:
        return f"stages of {bd.a.size} and {bd.b.size} ranks: the all_to_all's chunks do not map onto B's positions"
    x, s, cdim, n = c.logical_input, c.logical_dim, c.logical_concat_dim, bd.a.size
    L = shape_of(x)[s]
    if L % n:
        return f"split dim {s} of size {L} is not divisible by {n}"
    splits = _uniform(n, n, L // n)
    vol = RuleVolume(
        (
            OpBytes("all_to_all", bd.a.stage, ring_bytes("all_to_all", n, _nbytes(x))),
            OpBytes("stage_transfer", bd.a.stage, _nbytes(y)),
        ),
        (OpBytes("m2ms", bd.a.stage, _nbytes(x)),),
    )

    def apply() -> None:
        out = splice_autograd(
            env.gm,
            fused_a2a_transfer,
            [x],
            before=t,
            position=env.bmap.position,
            consts=(
                s,
                cdim,
                n,
                splits,
                list(bd.a.boundary_ranks),
                list(bd.b.boundary_ranks),
                bd.group_size,
                bd.group,
            ),
            meta_from=t,
        )
        _erase_transfer(env.gm, t, _replay_views(env.gm, out, views, t))

    return Match(
        "a2a_p2p",
        site,
        apply,
        vol,
        f"{c.name} (all_to_all {s}->{cdim} on {bd.a.group}) + {t.name} -> m2ms dim {s}",
    )


__all__ = ["match_a2a_p2p"]
