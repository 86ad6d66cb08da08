"""Rule ar_p2p: Megatron's g (all_reduce) plus replicated residuals on the sending stage,
followed by the stage transfer -> reduce_scatter + diagonal m2ms + all_gather (TP+PP:
Chimera Table 2, R-S + M2MS + A-G, the Alpa cross-mesh resharding).

Matches: a forward transfer ``T(y)`` with ``y = g(h)`` (``reduce_from_group`` over the
sending stage group SA) plus residuals proven replicated over SA
(:func:`~commfuse.analysis.boundary.replication.replicated_values`), ``y = (g + r1) + r2 ...``
in any operand order.
Produces: on A ``s_i = RS_d(h)`` (+ ``chunk_i(x, d)`` of each residual), ``M(s_i, d,
diagonal S)``, on B ``w = AG_d`` whose own chunk keeps its gradient
(:func:`~commfuse.analysis.boundary.templates.fused_allreduce_transfer`); d is the lowest dim
other than the last that n divides (else the last), as split_all_reduce.
Refuses: the transferred value is not g plus replicated residuals; g reduces over another
group or size than SA; the receiving stage is not declared tensor-parallel
(:attr:`BoundaryFusionOptions.tp_stages`); this rank's position is unknown; the reduced value
or a residual sum has other users on the sending stage; the stages differ in size; dynamic
shapes, or a residual broadcasts the reduced value; no dim is divisible by n.

Why it is the same program (Megatron TP on both stages): y = x + g(h) with g = all_reduce
(backward identity) and x replicated over SA. A_i reduce-scatters h and adds its chunk of x;
the diagonal m2ms sends chunk i to B_i; B all-gathers. Gradients: B's gather keeps only its
own chunk's gradient (B_i's chunk goes back to A_i) and A's reduce_scatter all-gathers the
chunks (its backward), so A_i gets ``cat_j grad_y_j[chunk j]``: the full gradient, equal to
the unfused ``grad_y`` because under the TP contract every B rank holds the same gradient of
the received activation. The residual x gets that gradient through a zero-valued tie
``h + (x - x.detach())`` (value h, gradient to both) so one all_gather serves both; its
forward value uses ``x.detach()``'s chunk. This needs the rank's position (the chunk) and the
TP contract of stage B (declared:
:class:`~commfuse.analysis.boundary.layout.BoundaryFusionOptions` ``tp_stages``); the
residual operands must be proven replicated over SA
(:func:`~commfuse.analysis.boundary.replication.replicated_values`).

Notation (A, B, SA, SB, T, n, ``x_i``, ``chunk_i``, ``M(v, d, S)``): :mod:`commfuse.analysis.boundary`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.fx as fx

from commfuse.analysis.boundary.matching import Env, Match, Site, _erase_transfer, _single_use_chain, _static
from commfuse.analysis.boundary.splicing import splice_autograd
from commfuse.analysis.boundary.templates import fused_allreduce_transfer
from commfuse.analysis.boundary.volume import OpBytes, RuleVolume, _nbytes, ring_bytes
from commfuse.ir.shapes import shape_of
from commfuse.pipeline.collectives import REDUCE_FROM_GROUP
from commfuse.pipeline.layout import StageGroup

aten = torch.ops.aten


def _diag(n: int, size: int) -> list[int]:
    return [size if i == j else 0 for i in range(n) for j in range(n)]


def _scatter_dim(shape: Sequence[int], n: int) -> Optional[int]:
    """The lowest dim other than the last with a size n divides (else the last), as split_all_reduce."""
    dims = list(range(len(shape) - 1)) + [len(shape) - 1]
    for d in dims:
        if shape[d] > 0 and shape[d] % n == 0:
            return d
    return None


def match_ar_p2p(site: Site, env: Env) -> Match | str:
    t, bd = site.node, site.boundary
    y = t.args[0]
    # walk back through residual adds to g (reduce_from_group): y = (g + r1) + r2 ... in any operand order
    rep = env.replicated(bd.a.group)

    def walk(node):  # -> every (g, adds outermost first, residuals, residual-is-left flags)
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return []
        if node.target is REDUCE_FROM_GROUP:
            return [(node, [], [], [])]
        if node.target is not aten.add.Tensor or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
            return []
        out = []
        for k in (0, 1):
            inner, other = node.args[k], node.args[1 - k]
            if isinstance(other, fx.Node) and other in rep:
                out += [
                    (g, [node, *adds], [other, *res], [k == 1, *left]) for g, adds, res, left in walk(inner)
                ]
        return out

    # the candidate whose reduced value feeds only the sum that reaches the transfer (the last g)
    candidates = walk(y)
    found = next(
        (c for c in candidates if _single_use_chain([c[0], *reversed(c[1])], t)),
        candidates[0] if candidates else None,
    )
    if found is None:
        if isinstance(y, fx.Node) and y.target is aten.add.Tensor:
            return (
                "the transferred value is not g (reduce_from_group) plus residuals proven replicated over "
                f"{bd.a.group} (declare TP inputs with replicated_inputs)"
            )
        return "the transferred value is not a reduce_from_group (all_reduce) result"
    node, chain, residuals, plan = found
    g = node
    h, gsize, gname = g.args[0], g.args[1], g.args[2]
    if gname != bd.a.group or gsize != bd.a.size:
        return f"{g.name} reduces over {gname!r} (size {gsize}), not the sending stage {bd.a.group!r}"
    if bd.b.stage not in env.options.tp_stages:
        return (
            f"stage {bd.b.stage} is not declared tensor-parallel (BoundaryFusionOptions.tp_stages): the "
            "fused form needs every rank of it to hold the same gradient of the received activation"
        )
    if env.bmap.position is None:
        return "this rank's position is unknown (give the pipeline layout)"
    chain.reverse()
    residuals.reverse()
    plan.reverse()
    if not _single_use_chain([g, *chain], t):
        return "the reduced value or a residual sum has other users on the sending stage"
    if bd.a.size != bd.b.size:
        return f"stages of {bd.a.size} and {bd.b.size} ranks (the diagonal m2ms pairs positions)"
    if not _static(y) or shape_of(h) != shape_of(y) or any(shape_of(r) is None for r in residuals):
        return "dynamic shapes, or the reduced value is broadcast by a residual"
    n = bd.a.size
    d = _scatter_dim(shape_of(y), n)
    if d is None:
        return f"no dim of {shape_of(y)} is divisible by the stage size {n}"
    size = shape_of(y)[d] // n
    splits = _diag(n, size)
    yb = _nbytes(y)
    vol = RuleVolume(
        (
            OpBytes("all_reduce", bd.a.stage, ring_bytes("all_reduce", n, _nbytes(h))),
            OpBytes("stage_transfer", bd.a.stage, yb),
        ),
        (
            OpBytes("reduce_scatter", bd.a.stage, ring_bytes("reduce_scatter", n, _nbytes(h))),
            OpBytes("m2ms", bd.a.stage, yb // n),
            OpBytes("all_gather", bd.b.stage, ring_bytes("all_gather", n, yb // n)),
        ),
    )
    ga = StageGroup(bd.a.group, n, tuple(range(n)))
    gb = StageGroup(bd.b.group, n, tuple(range(n)))

    def fn(h, *res):
        return fused_allreduce_transfer(
            h,
            *res,
            d=d,
            n=n,
            p=env.bmap.position,
            plan=tuple(plan),
            splits=splits,
            src=list(bd.a.boundary_ranks),
            dst=list(bd.b.boundary_ranks),
            gsize=bd.group_size,
            gname=bd.group,
            group_a=ga,
            group_b=gb,
        )

    def apply() -> None:
        out = splice_autograd(
            env.gm, fn, [h, *residuals], before=t, position=env.bmap.position, consts=(), meta_from=t
        )
        _erase_transfer(env.gm, t, out)

    res = f" + {len(residuals)} replicated residual(s)" if residuals else ""
    return Match(
        "ar_p2p",
        site,
        apply,
        vol,
        f"{g.name} (all_reduce on {bd.a.group}){res} + {t.name} -> reduce_scatter dim {d} + diagonal m2ms "
        f"+ all_gather on {bd.b.group}",
    )


__all__ = ["match_ar_p2p"]
