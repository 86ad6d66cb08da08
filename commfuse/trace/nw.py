"""Global alignment with run-length-dependent gap penalties (exact dynamic programme).

Contract
- Aligns sequence A (rows, NCCL log launches) with sequence B (columns, kernels). An
  alignment is a list of columns: a *pair* ``(i, j)`` (scored ``S[i, j]``), a *log gap*
  (``a_i`` unmatched) or a *kernel gap* (``b_j`` unmatched).
- Gap rule: the ``k``-th gap (``k = 0, 1, ...``) of a run of consecutive gaps *of one kind*
  (log gaps, or kernel gaps; a pair or a gap of the other kind ends the run) costs
  ``rule.penalty(min(k, R))`` with ``R = max_gap_run``: the penalty grows with the run, as
  the thesis's Eq. 4.2 asks, and stops growing after ``R`` gaps (so the programme stays
  O(n·m·R)). A run of ``L`` gaps costs ``G(L) = sum_{k<L} penalty(min(k, R))``.
- Sequence bonus: ``bonus`` is added to a pair column whose pair and whose preceding column
  are both *matches* (``compatible[i, j]`` true) -- the thesis's ``SEQUENCE_BONUS``.
- ``free_end_gaps``: gap runs before the first / after the last column of the other sequence
  (log gaps while no kernel, or every kernel, has been consumed; likewise kernel gaps) cost
  nothing -- the semi-global variant, for a trace that covers only a window of the log;
  ``free_leading`` / ``free_trailing`` set the two ends separately.
- Guarantees: the returned alignment has the maximum total score over *all* alignments
  under exactly these rules (checked against brute-force enumeration in
  tests/test_alignment.py); ties are broken deterministically (pair before log gap before
  kernel gap; shorter gap runs first).

Source: Needleman & Wunsch (1970); run-dependent gaps as in the NCCL-trace thesis §4.2.2
(Eq. 4.2); the saturation bound and the per-kind runs are commfuse's (docs/alignment.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

NEG = -1e18


@dataclass(frozen=True)
class NWResult:
    pairs: list[tuple[int, int]]  # (i, j), 0-based, in order
    log_gaps: list[int]
    kernel_gaps: list[int]
    score: float
    columns: list[tuple]  # in order: ("pair", i, j), ("log_gap", i), ("kernel_gap", j)


def gap_costs(penalty: Callable[[int], float], R: int, upto: int) -> np.ndarray:
    """``G[L]`` for ``L = 0..upto``: total cost (positive) of a run of ``L`` gaps."""
    g = np.array([penalty(min(k, R)) for k in range(max(upto, 0))], dtype=np.float64)
    return np.concatenate([[0.0], np.cumsum(g)])


def align(
    S: np.ndarray,
    compatible: np.ndarray,
    penalty: Callable[[int], float],
    *,
    max_gap_run: int = 32,
    bonus: float = 0.0,
    free_end_gaps: bool = False,
    free_leading: Optional[bool] = None,
    free_trailing: Optional[bool] = None,
) -> NWResult:
    """Maximum-score global alignment of ``S.shape[0]`` rows with ``S.shape[1]`` columns."""
    n, m = S.shape
    lead = free_end_gaps if free_leading is None else free_leading
    trail = free_end_gaps if free_trailing is None else free_trailing
    R = max(1, int(max_gap_run))
    G = gap_costs(penalty, R, max(n, m) + 1)
    gR = penalty(R)  # per-gap cost once a run is longer than R
    # State arrays, shape (n+1, m+1). X: last column a pair; V: last column a log gap (i advances);
    # H: last column a kernel gap (j advances). P = max(X, H) (what a V run may follow),
    # Q = max(X, V) (what an H run may follow).
    X = np.full((n + 1, m + 1), NEG)
    V = np.full((n + 1, m + 1), NEG)
    H = np.full((n + 1, m + 1), NEG)
    X[0, 0] = 0.0  # the empty prefix: start state, may be followed by anything (no bonus)
    xprev = np.zeros((n + 1, m + 1), dtype=np.int8)  # 0 X, 1 V, 2 H
    vlen = np.zeros((n + 1, m + 1), dtype=np.int32)  # run length (> R: through the tail)
    hlen = np.zeros((n + 1, m + 1), dtype=np.int32)
    TV = np.full((n + 1, m + 1), NEG)  # best V run longer than R ending here
    tv_len = np.zeros((n + 1, m + 1), dtype=np.int32)
    P = np.full((n + 1, m + 1), NEG)
    Q = np.full((n + 1, m + 1), NEG)
    comp = np.zeros((n + 1, m + 1), dtype=bool)
    comp[1:, 1:] = compatible
    Sx = np.full((n + 1, m + 1), NEG)
    Sx[1:, 1:] = S
    cols = np.arange(m + 1)

    for i in range(n + 1):
        if i > 0:
            # pair columns (i, j) from row i-1
            px, pv, ph = X[i - 1, :-1], V[i - 1, :-1], H[i - 1, :-1]
            bx = px + np.where(comp[i, 1:] & comp[i - 1, :-1], bonus, 0.0)
            best = bx.copy()
            choice = np.zeros(m, dtype=np.int8)
            sel = pv > best
            best[sel], choice[sel] = pv[sel], 1
            sel = ph > best
            best[sel], choice[sel] = ph[sel], 2
            X[i, 1:] = np.where(best > NEG / 2, best + Sx[i, 1:], NEG)
            xprev[i, 1:] = choice
            # log-gap runs ending at row i: direct lengths 1..R, then the tail (> R)
            bestv = np.full(m + 1, NEG)
            blen = np.zeros(m + 1, dtype=np.int32)
            for L in range(1, min(R, i) + 1):
                cand = P[i - L] - G[L]
                sel = cand > bestv
                bestv[sel], blen[sel] = cand[sel], L
            if i > R:
                direct = P[i - R - 1] - G[R + 1]
                ext = TV[i - 1] - gR
                take_ext = ext > direct
                TV[i] = np.where(take_ext, ext, direct)
                tv_len[i] = np.where(take_ext, tv_len[i - 1] + 1, R + 1)
                sel = TV[i] > bestv
                bestv[sel], blen[sel] = TV[i][sel], tv_len[i][sel]
            V[i] = np.where(bestv > NEG / 2, bestv, NEG)
            vlen[i] = blen
            # leading log gaps (no kernel consumed yet) and trailing ones (all kernels consumed) cost 0
            if lead:
                V[i, 0], vlen[i, 0] = 0.0, i
            if trail:
                if m == 0:
                    V[i, 0], vlen[i, 0] = 0.0, i
                else:
                    col = P[:i, m]
                    r = int(np.argmax(col[::-1]))  # latest row reaching the max: shortest free run
                    top = i - 1 - r
                    if col[top] > NEG / 2 and col[top] > V[i, m]:
                        V[i, m], vlen[i, m] = col[top], i - top
        # kernel-gap runs along row i (need Q of the whole row first)
        Qi = np.maximum(X[i], V[i])
        besth = np.full(m + 1, NEG)
        hl = np.zeros(m + 1, dtype=np.int32)
        for L in range(1, min(R, m) + 1):
            cand = np.full(m + 1, NEG)
            cand[L:] = Qi[:-L] - G[L]
            sel = cand > besth
            besth[sel], hl[sel] = cand[sel], L
        if m > R:
            # runs longer than R: max over j' <= j-R-1 of Q[j'] - G(j-j'), G linear beyond R
            W = Qi + cols * gR
            cm = np.maximum.accumulate(W)
            pos = np.maximum.accumulate(np.where(W >= cm, cols, -1))
            j = cols[R + 1 :]
            jp = pos[j - R - 1]
            cand = cm[j - R - 1] - j * gR - G[R] + R * gR
            cand = np.where(jp >= 0, cand, NEG)
            sel = cand > besth[R + 1 :]
            idx = np.nonzero(sel)[0] + R + 1
            besth[idx] = cand[sel]
            hl[idx] = idx - jp[sel]
        H[i] = np.where(besth > NEG / 2, besth, NEG)
        hlen[i] = hl
        if m > 0:
            if i == 0 and (lead or (trail and n == 0)):
                H[0, 1:], hlen[0, 1:] = 0.0, cols[1:]
            if i == n and trail:  # trailing kernel gaps: max over j' < j of Q[n, j'], latest j' on ties
                cmq = np.maximum.accumulate(Qi)
                posq = np.maximum.accumulate(np.where(Qi >= cmq, cols, -1))
                cand, jp = cmq[:-1], posq[:-1]
                sel = (cand > NEG / 2) & (cand > H[i, 1:])
                idx = np.nonzero(sel)[0] + 1
                H[i, idx] = cand[sel]
                hlen[i, idx] = idx - jp[sel]
        P[i] = np.maximum(X[i], H[i])
        Q[i] = np.maximum(X[i], V[i])

    # traceback
    cols: list[tuple] = []
    i, j = n, m
    end = [X[n, m], V[n, m], H[n, m]]
    state = int(np.argmax(end)) if n + m > 0 else 0
    score = float(max(end)) if n + m > 0 else 0.0
    while i > 0 or j > 0:
        if state == 0:
            cols.append(("pair", i - 1, j - 1))
            state = int(xprev[i, j])
            i, j = i - 1, j - 1
        elif state == 1:
            L = int(vlen[i, j])
            cols.extend(("log_gap", k) for k in range(i - 1, i - L - 1, -1))
            i -= L
            state = 0 if X[i, j] >= H[i, j] else 2  # what P[i, j] came from
        else:
            L = int(hlen[i, j])
            cols.extend(("kernel_gap", k) for k in range(j - 1, j - L - 1, -1))
            j -= L
            state = 0 if X[i, j] >= V[i, j] else 1  # what Q[i, j] came from
        if i == 0 and j == 0:
            break
    cols.reverse()
    return NWResult(
        [(c[1], c[2]) for c in cols if c[0] == "pair"],
        [c[1] for c in cols if c[0] == "log_gap"],
        [c[1] for c in cols if c[0] == "kernel_gap"],
        score,
        cols,
    )


__all__ = ["NWResult", "align", "gap_costs"]
