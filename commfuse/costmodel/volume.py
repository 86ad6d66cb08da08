"""Per-rank communication volume formulas as exact `sympy` expressions.

Contract
    Every function returns a sympy expression (``sympy.Integer`` /
    ``sympy.Rational`` when all inputs are numbers) for the bytes ONE rank
    moves. Arguments may be ints, sympy numbers or sympy symbols; the module
    symbols :data:`B`, :data:`S`, :data:`H`, :data:`N`, :data:`N1`,
    :data:`N2`, :data:`k` are provided for symbolic use. ``elt`` is the element
    size in bytes (default 1: the formulas then count elements).

    Two conventions are kept apart, never mixed (the lesson of the volume validation
    in the NCCL-trace thesis: L. Borzyk, "Understanding LLM Communication", Heidelberg
    University, 2026, §5.3.5):

    * ``*_logged``: NCCL count semantics, what ``NCCL_DEBUG=INFO`` logs as
      ``count x dtype size``: all_gather logs the per-rank *send* count,
      reduce_scatter the per-rank *receive* count, all_reduce / all_to_all /
      broadcast / p2p the buffer size. Equals `Collective.logged_bytes` of the IR.
    * ``*_wire``: bytes one rank sends under ring conventions (NCCL bus-bandwidth
      factors): all_reduce 2(N-1)/N·size, all_gather and reduce_scatter
      (N-1)/N·full size, all_to_all (N-1)/N·buffer (equal splits), p2p and
      M2MS the payload. Equals `Collective.wire_bytes` of the IR.

Sources
    * Chimera Table 1 (per-rank overhead of each collective of hybrid
      parallelism) and Table 2 (redundancy at transitions between patterns), §3.2 of
      "Chimera: Communication Fusion for Hybrid Parallelism in Large Language Models"
      (Qin et al., ISCA '25). Chimera's overheads are wire volumes.
    * The thesis's DP/TP/PP/EP models (§2.4.1-2.4.5),
      with every count its "validation" got wrong made an explicit input:
      micro-batches ``m``, layers per stage, MoE layers, top-k, collectives per
      layer. No correction factors.

Symbols (Chimera's notation)
    B: batch size (sequences) of the activation the collective moves, per rank
       unless a docstring says otherwise; S: sequence length; H: hidden size;
    N: ranks in the collective's group (N1 / N2: ranks of the former / latter
       parallel pattern at a transition); k: MoE top-k (experts per token).
    ``B·S·H`` is always the *full* activation the pattern synchronises (the
    all_reduce buffer, the all_gather output, the reduce_scatter input).

Table 2 ranges
    :func:`table2` returns the rows with their ratio (real demand / current
    volume, size 1 + size 2) and the paper's percentage range, each endpoint as a
    :class:`RangePoint`: a substitution and optionally a limit (``N1 -> oo``).
    The paper does not say at which N its ranges are taken; the endpoints below
    are the values that reproduce its numbers exactly, documented per row:

    ========  ==========================  ======================================
    TP+SP     1/2, constant
    TP+PP     3/5 .. 4/5                   inf/sup over N1, N2 >= 2: 3/5 is the
                                           limit N1 -> oo at N2 = 2, 4/5 the limit
                                           N2 -> oo at N1 = 2 (ratio falls with N1,
                                           rises with N2). With N1 = N2 it spans
                                           only 2/3 .. 3/4.
    TP+EP     2/3 .. 1                     N1 = N2 (TP and EP of equal degree, as
                                           in the paper's TP=EP=4 runs): the ratio
                                           is (1+k)/(2+k), 2/3 at k = 1, -> 1 as
                                           k -> oo. (With N1 > N2 and k = 1 it
                                           drops below 2/3.)
    PP+EP     0 .. 2/3                     1/(1 + (N-1)k/N): 2/3 at N = 2, k = 1,
                                           -> 0 as k -> oo (or N, k both large).
    SP+PP     1/2 .. 2/3                   N/(2N-1): 2/3 at N = 2, -> 1/2 as N -> oo.
    SP+EP     1/2 .. 1                     N1 = N2: k/(1+k), 1/2 at k = 1, -> 1 as
                                           k -> oo.
    ========  ==========================  ======================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

import sympy

from commfuse.ir.transfers import BoundaryTransfers

Num = Union[int, sympy.Expr]

__all__ = [
    "B",
    "S",
    "H",
    "N",
    "N1",
    "N2",
    "k",
    "RangePoint",
    "Table2Row",
    "table2",
    "evaluate_point",
    "tp_all_reduce_wire",
    "tp_all_reduce_logged",
    "pp_p2p_wire",
    "pp_p2p_logged",
    "sp_all_gather_wire",
    "sp_all_gather_logged",
    "ep_all_to_all_wire",
    "ep_all_to_all_logged",
    "reduce_scatter_wire",
    "reduce_scatter_logged",
    "m2ms_wire",
    "m2ms_logged",
    "table1",
    "dp_all_reduce_wire",
    "dp_all_reduce_logged",
    "fsdp_wire",
    "fsdp_logged",
    "tp_wire",
    "tp_logged",
    "sp_wire",
    "sp_logged",
    "pp_stage_send_wire",
    "pp_bubble_fraction",
    "ep_wire",
    "ep_logged",
    "moe_dispatch_slots",
    "megatron_param_count",
    "llama_param_count",
]

B, S, H = sympy.symbols("B S H", positive=True)
N, N1, N2 = sympy.symbols("N N1 N2", positive=True, integer=True)
k = sympy.symbols("k", positive=True, integer=True)


def _s(x: Num) -> sympy.Expr:
    return sympy.sympify(x)


def _frac(n: Num) -> sympy.Expr:
    """(n-1)/n, exact."""
    n = _s(n)
    return (n - 1) / n


# --------------------------------------------------------------------------- Chimera Table 1
def tp_all_reduce_wire(B: Num, S: Num, H: Num, N: Num, elt: Num = 1) -> sympy.Expr:
    """TP all_reduce of the ``[B, S, H]`` partial sums over N ranks: 2(N-1)·BSH/N (Table 1, ring)."""
    return 2 * _frac(N) * _s(B) * S * H * elt


def tp_all_reduce_logged(B: Num, S: Num, H: Num, N: Optional[Num] = None, elt: Num = 1) -> sympy.Expr:
    """NCCL count of the TP all_reduce: the whole buffer, BSH (independent of N)."""
    return _s(B) * S * H * elt


def pp_p2p_wire(B: Num, S: Num, H: Num, elt: Num = 1) -> sympy.Expr:
    """PP send of the stage output ``[B, S, H]`` to the next stage: BSH (Table 1)."""
    return _s(B) * S * H * elt


def pp_p2p_logged(B: Num, S: Num, H: Num, elt: Num = 1) -> sympy.Expr:
    """NCCL count of the PP send (and of the matching recv): BSH."""
    return _s(B) * S * H * elt


def sp_all_gather_wire(B: Num, S: Num, H: Num, N: Num, elt: Num = 1) -> sympy.Expr:
    """SP all_gather of sequence shards ``[B, S/N, H]`` into the full ``[B, S, H]``: (N-1)·BSH/N."""
    return _frac(N) * _s(B) * S * H * elt


def sp_all_gather_logged(B: Num, S: Num, H: Num, N: Num, elt: Num = 1) -> sympy.Expr:
    """NCCL count of the all_gather: the per-rank *send* count, BSH/N."""
    return _s(B) * S * H * elt / _s(N)


def ep_all_to_all_wire(B: Num, S: Num, H: Num, N: Num, k: Num, elt: Num = 1) -> sympy.Expr:
    """EP all_to_all of the B·S tokens a rank routes, each to k experts: (N-1)·BSHk/N.

    B, S are the rank's own tokens; the dispatched buffer holds B·S·k token slots
    of H elements (exact for capacity factor 1 with k·B·S divisible by the expert
    count, see :func:`moe_dispatch_slots`); 1/N of it stays on the rank."""
    return _frac(N) * _s(B) * S * H * k * elt


def ep_all_to_all_logged(B: Num, S: Num, H: Num, N: Num, k: Num, elt: Num = 1) -> sympy.Expr:
    """NCCL count of the EP all_to_all: the whole buffer, BSHk."""
    return _s(B) * S * H * k * elt


def reduce_scatter_wire(B: Num, S: Num, H: Num, N: Num, elt: Num = 1) -> sympy.Expr:
    """reduce_scatter of the full ``[B, S, H]`` into N shards: (N-1)·BSH/N (Table 1)."""
    return _frac(N) * _s(B) * S * H * elt


def reduce_scatter_logged(B: Num, S: Num, H: Num, N: Num, elt: Num = 1) -> sympy.Expr:
    """NCCL count of the reduce_scatter: the per-rank *receive* count, BSH/N."""
    return _s(B) * S * H * elt / _s(N)


def m2ms_wire(B: Num, S: Num, H: Num, elt: Num = 1) -> sympy.Expr:
    """Chimera's many-to-many scatter of a ``[B, S, H]`` tensor: every element leaves once, BSH."""
    return _s(B) * S * H * elt


def m2ms_logged(B: Num, S: Num, H: Num, elt: Num = 1) -> sympy.Expr:
    """The M2MS payload as the sends log it: BSH."""
    return _s(B) * S * H * elt


def table1() -> dict[str, sympy.Expr]:
    """Chimera Table 1 in symbols B, S, H, N, k (wire, elements)."""
    return {
        "TP all_reduce": tp_all_reduce_wire(B, S, H, N),
        "PP p2p": pp_p2p_wire(B, S, H),
        "SP all_gather": sp_all_gather_wire(B, S, H, N),
        "EP all_to_all": ep_all_to_all_wire(B, S, H, N, k),
        "reduce_scatter": reduce_scatter_wire(B, S, H, N),
        "M2MS": m2ms_wire(B, S, H),
    }


# --------------------------------------------------------------------------- Chimera Table 2
@dataclass(frozen=True)
class RangePoint:
    """One endpoint of a Table 2 range: substitute ``subs``, then take ``limit`` (symbol -> oo) if set."""

    subs: Mapping[sympy.Symbol, Num] = field(default_factory=dict)
    limit: sympy.Symbol | None = None
    note: str = ""


@dataclass(frozen=True)
class Table2Row:
    """One transition of Chimera Table 2 (symbols B, S, H, N / N1, N2, k; elements).

    ``size1`` / ``size2``: volume of the former / latter pattern's collective
    (``size1`` is 0 where the paper writes "–"); ``real_demand``: the fused
    volume; ``ratio`` = real_demand / (size1 + size2), simplified;
    ``paper_ratio``: the paper's ratio column as exact rationals ``(low, high)``
    and ``low`` / ``high`` the points that give them (see the module docstring).
    """

    transition: str
    size1: sympy.Expr
    size2: sympy.Expr
    real_demand: sympy.Expr
    ratio: sympy.Expr
    paper_ratio: tuple[sympy.Rational, sympy.Rational]
    low: RangePoint
    high: RangePoint
    assumption: str


def evaluate_point(expr: sympy.Expr, point: RangePoint) -> sympy.Expr:
    """``expr`` at a :class:`RangePoint` (substitution, then the limit if any), simplified."""
    e = sympy.simplify(_s(expr).subs(dict(point.subs)))
    if point.limit is not None:
        e = sympy.limit(e, point.limit, sympy.oo)
    return sympy.simplify(e)


def _row(
    transition: str,
    size1: sympy.Expr,
    size2: sympy.Expr,
    demand: sympy.Expr,
    paper: tuple[Num, Num],
    low: RangePoint,
    high: RangePoint,
    assumption: str,
) -> Table2Row:
    ratio = sympy.simplify(demand / (size1 + size2))
    return Table2Row(
        transition,
        size1,
        size2,
        demand,
        ratio,
        (sympy.Rational(paper[0]), sympy.Rational(paper[1])),
        low,
        high,
        assumption,
    )


def table2() -> list[Table2Row]:
    """Chimera Table 2, every row, from the Table 1 formulas (elements; multiply by ``elt`` for bytes).

    TP+PP's size 2 is Alpa's cross-mesh resharding: an M2MS of the rank's
    1/N1 share (BSH/N1) followed by an all_gather over the N2 ranks of the next
    stage; its real demand, as the paper prints it, is BSH + (N2-1)BSH/N2.
    """
    half = sympy.Rational(1, 2)
    two_thirds = sympy.Rational(2, 3)
    rows = [
        _row(
            "TP+SP",
            sympy.Integer(0),
            tp_all_reduce_wire(B, S, H, N),
            reduce_scatter_wire(B, S, H, N),
            (half, half),
            RangePoint(),
            RangePoint(),
            "Megatron's all_reduce -> reduce_scatter; constant",
        ),
        _row(
            "TP+PP",
            tp_all_reduce_wire(B, S, H, N1),
            B * S * H / N1 + sp_all_gather_wire(B, S, H, N2),
            pp_p2p_wire(B, S, H) + sp_all_gather_wire(B, S, H, N2),
            (sympy.Rational(3, 5), sympy.Rational(4, 5)),
            RangePoint({N2: 2}, N1, "N2 = 2, N1 -> oo"),
            RangePoint({N1: 2}, N2, "N1 = 2, N2 -> oo"),
            "inf/sup over N1, N2 >= 2 (decreasing in N1, increasing in N2)",
        ),
        _row(
            "TP+EP",
            tp_all_reduce_wire(B, S, H, N1),
            ep_all_to_all_wire(B, S, H, N2, k),
            reduce_scatter_wire(B, S, H, N1) + ep_all_to_all_wire(B, S, H, N2, k),
            (two_thirds, 1),
            RangePoint({N1: N, N2: N, k: 1}, None, "N1 = N2, k = 1"),
            RangePoint({N1: N, N2: N}, k, "N1 = N2, k -> oo"),
            "N1 = N2 (equal TP and EP degree); k >= 1",
        ),
        _row(
            "PP+EP",
            pp_p2p_wire(B, S, H),
            ep_all_to_all_wire(B, S, H, N, k),
            pp_p2p_wire(B, S, H),
            (0, two_thirds),
            RangePoint({N: 2}, k, "N = 2, k -> oo"),
            RangePoint({N: 2, k: 1}, None, "N = 2, k = 1"),
            "N >= 2, k >= 1",
        ),
        _row(
            "SP+PP",
            sp_all_gather_wire(B, S, H, N),
            pp_p2p_wire(B, S, H),
            pp_p2p_wire(B, S, H),
            (half, two_thirds),
            RangePoint({}, N, "N -> oo"),
            RangePoint({N: 2}, None, "N = 2"),
            "N >= 2",
        ),
        _row(
            "SP+EP",
            sp_all_gather_wire(B, S, H, N1),
            ep_all_to_all_wire(B, S, H, N2, k),
            ep_all_to_all_wire(B, S, H, N2, k),
            (half, 1),
            RangePoint({N1: N, N2: N, k: 1}, None, "N1 = N2, k = 1"),
            RangePoint({N1: N, N2: N}, k, "N1 = N2, k -> oo"),
            "N1 = N2; k >= 1",
        ),
    ]
    return rows


# --------------------------------------------------------------------------- thesis models
def dp_all_reduce_wire(
    P: Num, n_dp: Num, n_tp: Num = 1, n_pp: Num = 1, elt: Num = 1, reductions: Num = 1
) -> sympy.Expr:
    """DP gradient all_reduce per iteration (thesis, ring): 2(n_DP-1)/n_DP · P/(n_TP·n_PP) · β.

    P: parameters of the whole model; the rank holds P/(n_TP·n_PP) of them.
    ``reductions``: gradient reductions per iteration (1 with gradient
    accumulation / no_sync over the micro-batches; m when every micro-batch
    reduces, as a compiled step without no_sync does)."""
    return _s(reductions) * 2 * _frac(n_dp) * _s(P) / (_s(n_tp) * n_pp) * elt


def dp_all_reduce_logged(
    P: Num, n_dp: Num, n_tp: Num = 1, n_pp: Num = 1, elt: Num = 1, reductions: Num = 1
) -> sympy.Expr:
    """NCCL count of the DP all_reduces: the gradient buffer, P/(n_TP·n_PP) · β per reduction."""
    return _s(reductions) * _s(P) / (_s(n_tp) * n_pp) * elt


def fsdp_wire(
    P: Num, n_dp: Num, elt: Num = 1, micro_batches: Num = 1, gathers_per_step: Num = 1
) -> sympy.Expr:
    """FSDP / ZeRO-3 (SimpleFSDP) per iteration: parameter all_gather + gradient reduce_scatter.

    Each moves (n-1)/n · P · β on the wire, ``gathers_per_step`` all_gathers (1:
    gathered in the forward, kept for the backward; 2: re-gathered in the
    backward) and one reduce_scatter per micro-batch."""
    per_mb = (_s(gathers_per_step) + 1) * _frac(n_dp) * _s(P) * elt
    return _s(micro_batches) * per_mb


def fsdp_logged(
    P: Num, n_dp: Num, elt: Num = 1, micro_batches: Num = 1, gathers_per_step: Num = 1
) -> sympy.Expr:
    """NCCL counts of FSDP: all_gather logs its send count P/n, reduce_scatter its receive count P/n."""
    return _s(micro_batches) * (_s(gathers_per_step) + 1) * _s(P) / n_dp * elt


def tp_wire(
    layers: Num,
    b: Num,
    s: Num,
    h: Num,
    n_tp: Num,
    elt: Num = 1,
    micro_batches: Num = 1,
    forward_all_reduces: Num = 2,
    backward_all_reduces: Num = 2,
) -> sympy.Expr:
    """Megatron TP (thesis): layers · (fwd + bwd all_reduces) · 2(n-1)/n · b·s·h · β per micro-batch, × m.

    The thesis's ``L_stage · 8·b·s·h·(n_TP-1)/n_TP · β`` is the default 2 + 2
    all_reduces per layer. ``layers``: transformer layers on the rank's
    pipeline stage; b, s, h: micro-batch, sequence, hidden. commfuse's example
    Llama reduces each of wq/wk/wv's input gradients separately:
    ``backward_all_reduces=5``."""
    per_layer = (_s(forward_all_reduces) + backward_all_reduces) * tp_all_reduce_wire(b, s, h, n_tp, elt)
    return _s(micro_batches) * layers * per_layer


def tp_logged(
    layers: Num,
    b: Num,
    s: Num,
    h: Num,
    n_tp: Optional[Num] = None,
    elt: Num = 1,
    micro_batches: Num = 1,
    forward_all_reduces: Num = 2,
    backward_all_reduces: Num = 2,
) -> sympy.Expr:
    """NCCL counts of Megatron TP: every all_reduce logs the whole b·s·h buffer."""
    return (
        _s(micro_batches)
        * layers
        * (_s(forward_all_reduces) + backward_all_reduces)
        * tp_all_reduce_logged(b, s, h, elt=elt)
    )


def sp_wire(
    layers: Num,
    b: Num,
    s: Num,
    h: Num,
    n_tp: Num,
    elt: Num = 1,
    micro_batches: Num = 1,
    gathers_per_layer: Num = 4,
    scatters_per_layer: Num = 4,
) -> sympy.Expr:
    """Megatron TP+SP: per layer 2 all_gathers + 2 reduce_scatters forward, the mirror images backward.

    s is the full sequence (the gathered tensor is [b, s, h]). Wire volume
    equals :func:`tp_wire` (an all_reduce is a reduce_scatter + all_gather)."""
    return (
        _s(micro_batches)
        * layers
        * (
            _s(gathers_per_layer) * sp_all_gather_wire(b, s, h, n_tp, elt)
            + _s(scatters_per_layer) * reduce_scatter_wire(b, s, h, n_tp, elt)
        )
    )


def sp_logged(
    layers: Num,
    b: Num,
    s: Num,
    h: Num,
    n_tp: Num,
    elt: Num = 1,
    micro_batches: Num = 1,
    gathers_per_layer: Num = 4,
    scatters_per_layer: Num = 4,
) -> sympy.Expr:
    """NCCL counts of TP+SP: b·s·h/n per all_gather (send) and per reduce_scatter (receive).

    Only 2/n of :func:`tp_logged`'s: why logged volume "drops" with SP far
    more than the wire volume does."""
    return (
        _s(micro_batches)
        * layers
        * (
            _s(gathers_per_layer) * sp_all_gather_logged(b, s, h, n_tp, elt)
            + _s(scatters_per_layer) * reduce_scatter_logged(b, s, h, n_tp, elt)
        )
    )


def pp_stage_send_wire(
    stage: int,
    n_pp: int,
    b: Num,
    s: Num,
    h: Num,
    elt: Num = 1,
    micro_batches: Num = 1,
    n_tp: Num = 1,
    scatter_gather: bool = True,
) -> sympy.Expr:
    """Bytes one rank of pipeline ``stage`` (0-based) sends per iteration (thesis PP model).

    b·s·h·β per adjacent stage pair, per direction, per micro-batch: the first
    stage sends m activations, the last m gradients, a middle stage both (2m).
    With TP and Megatron's scatter/gather optimisation each of the n_TP ranks
    sends b·s·h/n_TP (``scatter_gather=False``: the full b·s·h each)."""
    if not 0 <= stage < n_pp:
        raise ValueError(f"stage {stage} not in [0, {n_pp})")
    directions = (stage < n_pp - 1) + (stage > 0)
    per = pp_p2p_wire(b, s, h, elt) / (_s(n_tp) if scatter_gather else 1)
    return _s(micro_batches) * directions * per


def pp_bubble_fraction(n_pp: Num, micro_batches: Num) -> sympy.Expr:
    """1F1B / GPipe bubble fraction (n_PP - 1) / m."""
    return (_s(n_pp) - 1) / micro_batches


def moe_dispatch_slots(tokens: Num, experts: Num, k: Num, capacity_factor: Num = 1) -> sympy.Expr:
    """Token slots of a GShard dispatch buffer: E · ceil(capacity_factor · k · T / E).

    Equals k·T (Chimera's B·S·k) exactly when capacity_factor = 1 and E divides k·T."""
    return _s(experts) * sympy.ceiling(_s(capacity_factor) * k * tokens / experts)


def ep_wire(
    B: Num,
    S: Num,
    h: Num,
    n_ep: Num,
    k: Num,
    elt: Num = 1,
    moe_layers: Num = 1,
    micro_batches: Num = 1,
    all_to_alls_per_layer: Num = 4,
) -> sympy.Expr:
    """EP with the all-to-all dispatcher (thesis): 4·B·S·k·h·(1 - 1/n_EP)·β per MoE layer per micro-batch.

    4 = dispatch + combine in the forward and their transposes in the
    backward. B, S: the rank's tokens. ``moe_layers`` and ``k`` must be the
    run's (the thesis's check used top-1 and 4 layers for a top-2, 8-layer run)."""
    return _s(micro_batches) * moe_layers * all_to_alls_per_layer * ep_all_to_all_wire(B, S, h, n_ep, k, elt)


def ep_logged(
    B: Num,
    S: Num,
    h: Num,
    n_ep: Num,
    k: Num,
    elt: Num = 1,
    moe_layers: Num = 1,
    micro_batches: Num = 1,
    all_to_alls_per_layer: Num = 4,
) -> sympy.Expr:
    """NCCL counts of the EP all_to_alls: each logs its whole B·S·k·h buffer."""
    return (
        _s(micro_batches) * moe_layers * all_to_alls_per_layer * ep_all_to_all_logged(B, S, h, n_ep, k, elt)
    )


def megatron_param_count(layers: Num, h: Num, vocab: Num, seq: Num) -> sympy.Expr:
    """GPT parameter count in Megatron's form: 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)).

    For GPT blocks (4h MLP, biases, LayerNorms, learned positions); not
    Llama's SwiGLU blocks: use :func:`llama_param_count` there."""
    L, h = _s(layers), _s(h)  # L: the formula's l (layers)
    return sympy.expand(12 * L * h**2 * (1 + sympy.Rational(13, 12) / h + (_s(vocab) + seq) / (12 * L * h)))


def llama_param_count(layers: Num, dim: Num, ffn_dim: Num, vocab: Num | None = None) -> sympy.Expr:
    """Exact parameter count of :class:`commfuse.models.llama.LlamaModel` (no biases).

    Per block: 4·dim² (wq, wk, wv, wo) + 3·dim·ffn (w1, w2, w3) + 2·dim (norms);
    with a vocabulary also the embedding, the final norm and the output head."""
    dim, ffn = _s(dim), _s(ffn_dim)
    total = _s(layers) * (4 * dim**2 + 3 * dim * ffn + 2 * dim)
    if vocab:
        total += 2 * _s(vocab) * dim + dim
    return sympy.expand(total)


# --------------------------------------------------------------------------- boundary transitions
# Table 2's boundary rows (SP+PP, TP+PP, PP+EP) written out with commfuse's boundary ops: the P2P
# and M2MS of each row become a `commfuse::stage_transfer` / `commfuse::m2ms` piece matrix over the
# ranks of both stages, and their per-rank volume is computed by the IR's own rule
# (`commfuse.ir.transfers.BoundaryTransfers`: bytes a rank sends, its piece to itself excluded),
# not copied from the paper. Stage 1 = group ranks 0..n1-1, stage 2 = n1..n1+n2-1 of one group.
@dataclass(frozen=True)
class BoundaryPlan:
    """One boundary op of a transition: ``op`` "m2ms" (``splits[i][j]``: size along the moved dim
    from ``src[i]`` to ``dst[j]``, ``unit`` elements per index) or "stage_transfer" (``src[i]`` sends
    ``unit`` elements to ``dst[i]``). Sizes may be symbolic (B, S, H, k)."""

    op: str
    group_size: int
    src: tuple[int, ...]
    dst: tuple[int, ...]
    unit: sympy.Expr
    splits: tuple[tuple[sympy.Expr, ...], ...] | None = None
    dim: int | None = None

    def transfers(self):
        return BoundaryTransfers(
            self.op, "boundary", self.group_size, self.src, self.dst, self.dim, self.splits, self.unit
        )

    def max_sent(self) -> sympy.Expr:
        """Elements the busiest sender puts on the wire (Chimera's per-rank volume of the op)."""
        t = self.transfers()
        return _smax([_s(t.sent_bytes(g)) for g in range(self.group_size)])

    def max_received(self) -> sympy.Expr:
        t = self.transfers()
        return _smax([_s(t.received_bytes(g)) for g in range(self.group_size)])


def _smax(vals: list[sympy.Expr]) -> sympy.Expr:
    return sympy.simplify(sympy.Max(*vals)) if vals else sympy.Integer(0)


@dataclass(frozen=True)
class BoundaryTransition:
    """A Table 2 transition at a boundary: the unfused (``current``) and fused sequences as
    ``(op, per-rank wire volume)`` pairs in elements (Chimera sums the per-rank volume of each op),
    and the boundary ops as piece matrices (``plans``: op name -> :class:`BoundaryPlan`)."""

    transition: str
    current: tuple[tuple[str, sympy.Expr], ...]
    fused: tuple[tuple[str, sympy.Expr], ...]
    plans: Mapping[str, BoundaryPlan]
    note: str = ""

    @property
    def current_volume(self) -> sympy.Expr:
        return sympy.simplify(sum((v for _o, v in self.current), sympy.Integer(0)))

    @property
    def real_demand(self) -> sympy.Expr:
        return sympy.simplify(sum((v for _o, v in self.fused), sympy.Integer(0)))

    @property
    def ratio(self) -> sympy.Expr:
        return sympy.simplify(self.real_demand / self.current_volume)


def _interval_overlap(i: int, n1: int, j: int, n2: int) -> sympy.Rational:
    """Length of [i/n1, (i+1)/n1) ∩ [j/n2, (j+1)/n2) (a fraction of the sequence)."""
    lo = max(sympy.Rational(i, n1), sympy.Rational(j, n2))
    hi = min(sympy.Rational(i + 1, n1), sympy.Rational(j + 1, n2))
    return max(hi - lo, sympy.Integer(0))


def resharding_plan(n1: int, n2: int, length: Num = S, unit: Num = B * H) -> BoundaryPlan:
    """Alpa's cross-mesh resharding as one m2ms: stage-1 rank i holds the i-th of n1 equal
    slices of ``length`` (along the moved dim), stage-2 rank j needs the j-th of n2: rank i sends
    j the overlap of the two slices."""
    splits = tuple(tuple(_interval_overlap(i, n1, j, n2) * _s(length) for j in range(n2)) for i in range(n1))
    return BoundaryPlan("m2ms", n1 + n2, tuple(range(n1)), tuple(range(n1, n1 + n2)), _s(unit), splits, dim=1)


def stage_pairs_plan(n: int, elements: Num = B * S * H) -> BoundaryPlan:
    """The plain pipeline transfer: stage-1 rank i sends its whole ``[B, S, H]`` to stage-2 rank i."""
    return BoundaryPlan("stage_transfer", 2 * n, tuple(range(n)), tuple(range(n, 2 * n)), _s(elements))


def sp_pp_transition(n: int) -> BoundaryTransition:
    """SP+PP over n sequence-parallel ranks per stage. Current: the SP all_gather ((n-1)BSH/n),
    then the stage transfer of the gathered ``[B, S, H]`` (BSH). Fused (Table 3: A-G + P2P ->
    M2MS): every stage-1 rank sends its sequence shard (S/n) to every stage-2 rank, which
    concatenates the shards in src order -- the gathered activation: BSH per sender."""
    p2p = stage_pairs_plan(n)
    m2ms = BoundaryPlan(
        "m2ms",
        2 * n,
        tuple(range(n)),
        tuple(range(n, 2 * n)),
        B * H,
        tuple(tuple(S / n for _j in range(n)) for _i in range(n)),
        dim=1,
    )
    return BoundaryTransition(
        "SP+PP",
        (("all_gather", sp_all_gather_wire(B, S, H, n)), ("stage_transfer", p2p.max_sent())),
        (("m2ms", m2ms.max_sent()),),
        {"stage_transfer": p2p, "m2ms": m2ms},
    )


def tp_pp_transition(n1: int, n2: int) -> BoundaryTransition:
    """TP+PP, n1 tensor-parallel ranks in stage 1 (holding partial sums) and n2 in stage 2.
    Current (Alpa): all_reduce over n1, the resharding m2ms of each rank's 1/n1 share
    (BSH/n1 per sender), all_gather over n2. Fused: the all_reduce's all_gather half is
    dropped (Table 3: R-S + M2MS -> M2MS): reduce_scatter, the same resharding m2ms,
    all_gather over n2. Real demand (N1-1)BSH/N1 + BSH/N1 + (N2-1)BSH/N2 = BSH + (N2-1)BSH/N2,
    Table 2's."""
    m2ms = resharding_plan(n1, n2)
    shard = m2ms.max_sent()
    return BoundaryTransition(
        "TP+PP",
        (
            ("all_reduce", tp_all_reduce_wire(B, S, H, n1)),
            ("m2ms", shard),
            ("all_gather", sp_all_gather_wire(B, S, H, n2)),
        ),
        (
            ("reduce_scatter", reduce_scatter_wire(B, S, H, n1)),
            ("m2ms", shard),
            ("all_gather", sp_all_gather_wire(B, S, H, n2)),
        ),
        {"m2ms": m2ms},
    )


def pp_ep_transition(n: int, top_k: Num = 1) -> BoundaryTransition:
    """PP+EP, n ranks per stage, stage 2 expert-parallel over its n ranks. Current: the stage
    transfer of ``[B, S, H]`` (BSH), then the dispatch all_to_all of the B·S·k expert rows on
    stage 2 ((n-1)BSHk/n). Fused (Table 3: P2P + A2A -> M2MS, the gating moved before the
    transfer): every stage-1 rank sends each expert row straight to the rank holding the
    expert, balanced routing (k·B·S/n rows to each of the n ranks): k·BSH per sender.

    Table 2's real demand is BSH: equal at k = 1. With k > 1 a token routed to experts on k
    different ranks must travel k times; the fused op then moves k·BSH and beats the current
    sequence only while k < n (ratio k·n / (n + (n-1)k))."""
    p2p = stage_pairs_plan(n)
    m2ms = BoundaryPlan(
        "m2ms",
        2 * n,
        tuple(range(n)),
        tuple(range(n, 2 * n)),
        H,
        tuple(tuple(_s(top_k) * B * S / n for _j in range(n)) for _i in range(n)),
        dim=0,
    )
    return BoundaryTransition(
        "PP+EP",
        (("stage_transfer", p2p.max_sent()), ("all_to_all", ep_all_to_all_wire(B, S, H, n, top_k))),
        (("m2ms", m2ms.max_sent()),),
        {"stage_transfer": p2p, "m2ms": m2ms},
        note="Table 2's real demand (BSH) holds for k = 1; the fused m2ms moves k·BSH",
    )


def boundary_transitions(n: int = 4, n1: int = 4, n2: int = 2, top_k: Num = 1) -> list[BoundaryTransition]:
    """The three boundary rows of Table 2 with their piece matrices (see the functions above)."""
    return [sp_pp_transition(n), tp_pp_transition(n1, n2), pp_ep_transition(n, top_k)]


__all__ += [
    "BoundaryPlan",
    "BoundaryTransition",
    "boundary_transitions",
    "pp_ep_transition",
    "resharding_plan",
    "sp_pp_transition",
    "stage_pairs_plan",
    "tp_pp_transition",
]
