"""Rule p2p_ag: the stage transfer followed by an all_gather on the receiving stage -> one m2ms
(Chimera Table 3, P2P + A-G).

Matches: a forward transfer ``z = T(y)`` whose output feeds ``w = AG_d(z)`` on the receiving
stage group SB.
Produces: ``M(cat^d of n copies of y_i, d, S[i][j] = l)``
(:func:`~commfuse.analysis.boundary.templates.fused_gather_transfer`) spliced where T was, in
place of the gathered value; other users of z on B read ``chunk_p(w, d)`` (this rank's
position p), served locally.
Refuses: the transferred value feeds no all_gather; the all_gather fails the common checks
(:func:`~commfuse.analysis.boundary.matching._collective_ok`, on SB); z has other users on B
and this rank's position is unknown; the transfer's input and output shapes differ or are
dynamic.

Why it is the same program: the same data movement as ag_p2p seen from B (B_j receives
z_0..z_{n-1} = AG(z)); a user of z on B_p other than the gather reads ``chunk_p(w)`` = z_p,
bit for bit.

Notation (A, B, SA, SB, T, n, ``x_i``, ``chunk_i``, ``M(v, d, S)``): :mod:`commfuse.analysis.boundary`.
"""

from __future__ import annotations

import torch

from commfuse.analysis.boundary.matching import Env, Match, Site, _collective_ok, _static, _uniform
from commfuse.analysis.boundary.splicing import splice_autograd
from commfuse.analysis.boundary.templates import fused_gather_transfer
from commfuse.analysis.boundary.volume import OpBytes, RuleVolume, _nbytes, ring_bytes
from commfuse.ir import rewrite
from commfuse.ir.kinds import CollectiveKind
from commfuse.ir.shapes import shape_of, tensor_meta

aten = torch.ops.aten
K = CollectiveKind


def match_p2p_ag(site: Site, env: Env) -> Match | str:
    t, bd = site.node, site.boundary
    gathers = [c for c in env.ir.collectives if c.kind is K.ALL_GATHER and c.logical_input is t]
    if not gathers:
        return "the transferred value does not feed an all_gather on the receiving stage"
    c = gathers[0]
    why = _collective_ok(c, bd.b.group, bd.b.size)
    if why:
        return why
    own = {c.start, *c.layout_nodes}
    others = [u for u in t.users if u not in own]
    if others and env.bmap.position is None:
        return (
            "the transferred value has other users on the receiving stage and this rank's position is "
            "unknown (give the pipeline layout)"
        )
    y, d, n = t.args[0], c.logical_dim, bd.b.size
    if shape_of(y) != shape_of(t) or not _static(y):
        return "the transfer's input and output shapes differ or are dynamic"
    size = shape_of(y)[d]  # the docstring's l
    splits = _uniform(bd.a.size, n, size)
    vol = RuleVolume(
        (
            OpBytes("stage_transfer", bd.a.stage, _nbytes(y)),
            OpBytes("all_gather", bd.b.stage, ring_bytes("all_gather", n, _nbytes(t))),
        ),
        (OpBytes("m2ms", bd.a.stage, n * _nbytes(y)),),
    )

    def apply() -> None:
        gm = env.gm
        out = splice_autograd(
            gm,
            fused_gather_transfer,
            [y],
            before=t,
            position=env.bmap.position,
            consts=(
                d,
                n,
                splits,
                list(bd.a.boundary_ranks),
                list(bd.b.boundary_ranks),
                bd.group_size,
                bd.group,
            ),
            meta_from=t,
        )
        gathered = c.logical_output
        gathered.replace_all_uses_with(out)
        if others:  # the own chunk of the gathered value is this position's transferred value
            p = env.bmap.position
            with gm.graph.inserting_after(out):
                own_chunk = gm.graph.call_function(aten.narrow.default, (out, d, p * size, size))
            own_chunk.meta["val"] = tensor_meta(t)
            for u in others:
                u.replace_input_with(t, own_chunk)
        rewrite.erase_dead(gm, [gathered])
        rewrite.erase_dead(gm, [t])

    extra = f" (other users read chunk {env.bmap.position} of it)" if others else ""
    return Match(
        "p2p_ag",
        site,
        apply,
        vol,
        f"{t.name} + {c.name} (all_gather dim {d} on {bd.b.group}) -> m2ms dim {d}{extra}",
    )


__all__ = ["match_p2p_ag"]
