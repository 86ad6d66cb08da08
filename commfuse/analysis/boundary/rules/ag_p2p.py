"""Rule ag_p2p: an all_gather on the sending stage followed by the stage transfer -> one m2ms
(Chimera Table 3, A-G + P2P).

Matches: a forward transfer ``T(y)`` whose value is, through single-use views, the result of
``y = AG_d(x)`` on the sending stage group SA.
Produces: ``M(cat^d of n copies of x_i, d, S[i][j] = l)`` (``l`` = x's size along d;
:func:`~commfuse.analysis.boundary.templates.fused_gather_transfer`) spliced where T was, the
views replayed on the receiving side; the all_gather and T are gone.
Refuses: the transferred value is not an all_gather's result (through views); the all_gather
fails the common checks (:func:`~commfuse.analysis.boundary.matching._collective_ok`: not on
SA or not of its size, coalesced or in place, not exactly one wait, no single logical
input/output/dim, dynamic shapes); the gathered value has other users on the sending stage
(the all_gather must stay).

Why it is the same program: B_j receives, in src order, x_0..x_{n-1} = AG(x) (what every A
rank sent). Backward: A_i receives the gradient of its piece from every B_j and the n copies'
gradients are added: ``sum_j grad_w_j[chunk i]``, which is the all_gather's reduce_scatter of
the gradients T brought back.

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
from commfuse.analysis.boundary.templates import fused_gather_transfer
from commfuse.analysis.boundary.volume import OpBytes, RuleVolume, _nbytes, ring_bytes
from commfuse.ir.kinds import CollectiveKind
from commfuse.ir.shapes import shape_of

K = CollectiveKind


def match_ag_p2p(site: Site, env: Env) -> Match | str:
    t, bd = site.node, site.boundary
    y = t.args[0]
    found = _sent_collective(t, bd, env, K.ALL_GATHER)
    if isinstance(found, str):
        return found
    c, root, views = found
    if not _single_use_chain([root, *views], t):
        return "the gathered value has other users on the sending stage (the all_gather must stay)"
    x, d, n = c.logical_input, c.logical_dim, bd.a.size
    size = shape_of(x)[d]  # the docstring's l
    splits = _uniform(n, bd.b.size, size)
    vol = RuleVolume(
        (
            OpBytes("all_gather", bd.a.stage, ring_bytes("all_gather", n, _nbytes(x))),
            OpBytes("stage_transfer", bd.a.stage, _nbytes(y)),
        ),
        (OpBytes("m2ms", bd.a.stage, bd.b.size * _nbytes(x)),),
    )

    def apply() -> None:
        out = splice_autograd(
            env.gm,
            fused_gather_transfer,
            [x],
            before=t,
            position=env.bmap.position,
            consts=(
                d,
                bd.b.size,
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
        "ag_p2p",
        site,
        apply,
        vol,
        f"{c.name} (all_gather dim {d} on {bd.a.group}) + {t.name} -> m2ms dim {d}",
    )


__all__ = ["match_ag_p2p"]
