"""Boundary rules: Chimera's fusions of a pipeline stage transfer with its neighbouring collectives.

Each rule matches one ``commfuse::stage_transfer_autograd`` node T of a pipeline FORWARD graph
(:func:`commfuse.pipeline.trace_forward`: autograd-level ops, every stage traced by every rank
"as" its own position ``p``) together with the collective next to it, and replaces both by an
eager function traced with ``make_fx(pre_dispatch=True)`` under the graph's fake mode and
spliced in where T was (the rewrite.py discipline, at the autograd level: the backward is
derived afterwards by ``trace_joint``, so each fused op's backward is its autograd formula).

Notation: boundary ``b`` joins stage A (``n`` ranks, stage group ``SA``, position ``i`` = group
rank ``i`` of SA) and stage B (``n`` ranks, ``SB``); T sends the whole value of A's position
``i`` to B's position ``i`` (``src[i]``/``dst[i]`` are their ranks in the boundary group G).
``x_i`` is a value on A's position i; ``chunk_i(v, d)`` the i-th of n equal pieces of v along d;
``M(v, d, S)`` is ``commfuse::m2ms_autograd`` over G from ``src`` to ``dst`` with piece matrix S.

=========  ============================  ===============================================  ==========
rule       matches (A side -> B side)    replacement                                      Table 3
=========  ============================  ===============================================  ==========
ag_p2p     y = AG_d(x) on SA; T(y)       M(cat^d of n copies of x_i, d, S[i][j] = l)       A-G + P2P
p2p_ag     z = T(y); w = AG_d(z) on SB   M(cat^d of n copies of y_i, d, S[i][j] = l)       P2P + A-G
                                         (other users of z on B: chunk_p(w, d))
a2a_p2p    y = A2A_s->c(x) on SA; T(y)   v = M(x_i, s, S[i][j] = L/n); on B:               A2A + P2P
                                         y = cat_j^c chunk_j(v, s)
ar_p2p     y = g(h) (+ replicated        A: s_i = RS_d(h) (+ chunk_i(x, d)); M(s_i, d,     TP+PP (Table 2:
           residuals) on SA; T(y)        diagonal S); B: w = AG_d (own chunk keeps its     R-S + M2MS +
                                         gradient)                                         A-G)
p2p_a2a    z = T(y); router + gating +   the router/dispatch region on A; its B inputs     P2P + A2A
           dispatch on SB; A2A on SB     (router weight) sent B -> A; M(dispatch buffer,   (PP+EP case
                                         0, S[i][j] = rows/n); what B needs after the      study)
                                         A2A sent as a minimum cut (top-k values)
=========  ============================  ===============================================  ==========

Why each is the same program (values and gradients): the docstring of each rule's module,
``commfuse.analysis.boundary.rules.<rule>``, which also states what the rule matches,
produces and refuses.

Every rule refuses (reason in the report) unless the groups are exactly the two stages of
the boundary, T pairs positions (``src``/``dst`` = the stages' ranks in position order), the
collective has one wait and static shapes and the intermediate values have no other users
(p2p_ag: other users allowed, served locally); kept only when the per-rank boundary bytes
(Chimera Table 1 conventions, :class:`~commfuse.analysis.boundary.volume.RuleVolume`) do not
grow.

Modules: :mod:`.layout` (stages, boundaries, options, :data:`RULES`), :mod:`.volume` (bytes),
:mod:`.replication` (values replicated over a stage), :mod:`.splicing` (tracing and splicing
a replacement), :mod:`.templates` (the fused eager functions), :mod:`.matching` (Site, Match,
Env, the helpers the rules share, :func:`sites`) and :mod:`.rules` (one module per rule);
this package defines :data:`MATCHERS`, the rule name -> match function table.

Source: Chimera (ISCA '25) §3.3 Table 3 (A-G + P2P, P2P + A-G, A2A + P2P, P2P + A2A -> M2MS),
Table 2 (TP+PP: R-S + M2MS + A-G, the Alpa cross-mesh resharding) and the PP+EP case study
(gating moved before the P2P); Megatron-LM's sequence-parallel region ops for the gradient
conventions (gather with split backward).
"""

from __future__ import annotations

from typing import Callable

from commfuse.analysis.boundary.layout import (
    LAYOUT_META_KEY,
    RULES,
    Boundary,
    BoundaryFusionOptions,
    BoundaryMap,
    StageSide,
)
from commfuse.analysis.boundary.matching import Env, Match, Site, sites
from commfuse.analysis.boundary.replication import replicated_values
from commfuse.analysis.boundary.rules.a2a_p2p import match_a2a_p2p
from commfuse.analysis.boundary.rules.ag_p2p import match_ag_p2p
from commfuse.analysis.boundary.rules.ar_p2p import match_ar_p2p
from commfuse.analysis.boundary.rules.p2p_a2a import match_p2p_a2a
from commfuse.analysis.boundary.rules.p2p_ag import match_p2p_ag
from commfuse.analysis.boundary.splicing import (
    m2ms_traceable_across_stages,
    pipeline_trace_position,
    splice_autograd,
)
from commfuse.analysis.boundary.templates import (
    fused_a2a_transfer,
    fused_allreduce_transfer,
    fused_gather_transfer,
)
from commfuse.analysis.boundary.volume import OpBytes, RuleVolume, ring_bytes

MATCHERS: dict[str, Callable[[Site, Env], "Match | str"]] = {
    "ag_p2p": match_ag_p2p,
    "p2p_ag": match_p2p_ag,
    "a2a_p2p": match_a2a_p2p,
    "ar_p2p": match_ar_p2p,
    "p2p_a2a": match_p2p_a2a,
}


# RULES lives in layout.py (BoundaryFusionOptions defaults to it and validates against it); one table
assert tuple(MATCHERS) == RULES, "commfuse.analysis.boundary: MATCHERS and RULES name different rules"


__all__ = [
    "Boundary",
    "BoundaryFusionOptions",
    "BoundaryMap",
    "Env",
    "LAYOUT_META_KEY",
    "MATCHERS",
    "Match",
    "OpBytes",
    "RULES",
    "RuleVolume",
    "Site",
    "StageSide",
    "fused_a2a_transfer",
    "fused_allreduce_transfer",
    "fused_gather_transfer",
    "m2ms_traceable_across_stages",
    "match_a2a_p2p",
    "match_ag_p2p",
    "match_ar_p2p",
    "match_p2p_a2a",
    "match_p2p_ag",
    "pipeline_trace_position",
    "replicated_values",
    "ring_bytes",
    "sites",
    "splice_autograd",
]
