"""The fused eager functions the rules splice in place of a transfer and its collective.

Each is traced pre-dispatch by :func:`commfuse.analysis.boundary.splicing.splice_autograd`, so
its backward is its autograd formula: :func:`fused_gather_transfer` (ag_p2p, p2p_ag),
:func:`fused_a2a_transfer` (a2a_p2p, p2p_a2a) and :func:`fused_allreduce_transfer` (ar_p2p).
Why each computes the same values and gradients as the unfused pair is in its rule's module
docstring (``commfuse.analysis.boundary.rules.<rule>``; "module docstring" and "docstring"
in :func:`fused_allreduce_transfer` mean :mod:`commfuse.analysis.boundary.rules.ar_p2p`'s).
"""

from __future__ import annotations

import torch

from commfuse.ops import M2MS_AUTOGRAD
from commfuse.pipeline.collectives import all_gather, reduce_scatter


def _copies(x: torch.Tensor, n: int, d: int) -> torch.Tensor:
    return torch.cat([x] * n, d) if n > 1 else x


def fused_gather_transfer(x, d, n_dst, splits, src, dst, gsize, gname):
    """ag_p2p / p2p_ag: every source sends its value to every destination (received in src order)."""
    return M2MS_AUTOGRAD(_copies(x, n_dst, d), d, splits, src, dst, gsize, gname)


def fused_a2a_transfer(x, s, c, n, splits, src, dst, gsize, gname):
    """a2a_p2p: source i's chunk j along s goes to destination j; re-laid along c on B."""
    v = M2MS_AUTOGRAD(x, s, splits, src, dst, gsize, gname)
    return v if c == s else torch.cat(torch.chunk(v, n, s), c)


def fused_allreduce_transfer(h, *residuals, d, n, p, plan, splits, src, dst, gsize, gname, group_a, group_b):
    """ar_p2p: RS on A (+ this position's chunk of each replicated residual), the diagonal m2ms,
    an all_gather on B whose own chunk keeps its gradient (module docstring)."""

    tie = h
    for r in residuals:  # value h, gradient also to r: one all_gather serves both (docstring)
        tie = tie + (r - r.detach())
    s = reduce_scatter(tie, d, group_a)
    y = s
    for r, left in zip(residuals, plan, strict=True):
        rc = r.detach()
        dd = d - (s.dim() - rc.dim())  # r's dim aligned with d under broadcasting
        if dd >= 0 and rc.shape[dd] == s.shape[d] * n:
            rc = rc.narrow(dd, p * s.shape[d], s.shape[d])
        y = rc + y if left else y + rc
    z = M2MS_AUTOGRAD(y, d, splits, src, dst, gsize, gname)
    w = all_gather(z.detach(), d, group_b)
    pieces = list(torch.chunk(w, n, d))
    pieces[p] = z  # B's own chunk, bit for bit the gathered one, carries the gradient
    return torch.cat(pieces, d)


__all__ = ["fused_a2a_transfer", "fused_allreduce_transfer", "fused_gather_transfer"]
