"""DHelix pairing plan search: the dynamic program of Eq. 2 with a peak-memory budget.

Contract
- Input: a forward strand ``fwd`` (segments of micro-batch beta's forward of one layer) and a
  backward strand ``bwd`` (micro-batch alpha's backward of a layer), each an ordered
  sequence of :class:`~.segments.Segment`, and an :class:`~.overlap.OEFTable`.
- A *plan* is a monotone walk from (0, 0) to (N_f, N_b) made of steps ``pair`` (forward
  segment i beside backward segment j, time P(i, j)), ``fwd`` (segment i alone, P(i, 0))
  and ``bwd`` (segment j alone, P(0, j)); barriers separate steps. :func:`best_plan` runs
  Eq. 2, ``T(i,j) = min(T(i-1,j) + P(i,0), T(i,j-1) + P(0,j), T(i-1,j-1) + P(i,j))``,
  ``T(0,0) = 0``, and backtracks to the plan.
- Memory: after consuming i forward and j backward segments the live activation memory is
  ``mem_start + sum(fwd[:i].mem_delta) + sum(bwd[:j].mem_delta)`` (path independent). A step
  may peak before its frees land, so commfuse bounds a step's peak conservatively by the
  memory before it plus the *positive* deltas of its segment(s) (a forward allocating while
  the paired backward has not freed yet). A step whose bound exceeds ``mem_budget`` is
  forbidden; if no plan remains, :class:`InfeasiblePlanError` (a ``ValueError``) names the
  budget and the least budget that would do. Because the bound depends only on the step,
  Eq. 2's optimal substructure still holds.
- Determinism (same plan on every rank): among plans of equal total time the DP keeps the
  one whose step sequence, read from the *last* step backwards, is lexicographically
  smallest with ``pair < fwd < bwd`` (prefer pairing). Arithmetic is plain float addition
  along the walk, in walk order, so identical inputs give bit-identical totals and plans;
  no dict or set iteration order enters the result.
- :func:`search_plans` tries every pair of candidate orders (e.g. from
  :func:`~.segments.legal_orders`) and keeps the fastest (ties: first forward candidate,
  then first backward candidate).

Source: DHelix (Wang et al.), Sec. 4.2 "Pairing by Dynamic Programming", Eq. 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from commfuse.dhelix.overlap import OEFTable, overlap_table
from commfuse.dhelix.segments import Segment, check_strand

STEP_KINDS = ("pair", "fwd", "bwd")  # tie-break preference, first = preferred


class InfeasiblePlanError(ValueError):
    """No pairing plan fits ``mem_budget``."""


@dataclass(frozen=True)
class PlanStep:
    kind: str  # "pair" | "fwd" | "bwd"
    fwd: str | None  # forward segment name, None for "bwd"
    bwd: str | None  # backward segment name, None for "fwd"
    time: float
    peak_memory: float


@dataclass(frozen=True)
class PairingPlan:
    steps: tuple[PlanStep, ...]
    total_time: float
    peak_memory: float

    @property
    def codes(self) -> tuple[str, ...]:
        return tuple(s.kind for s in self.steps)


def _prefix(xs: Sequence[Segment]) -> list[float]:
    out = [0.0]
    for s in xs:
        out.append(out[-1] + s.mem_delta)
    return out


def step_peak(kind: str, mem_before: float, f: Segment | None, b: Segment | None) -> float:
    """Conservative peak of one step (module docstring)."""
    peak = mem_before
    if kind in ("pair", "fwd"):
        peak += max(0.0, f.mem_delta)
    if kind in ("pair", "bwd"):
        peak += max(0.0, b.mem_delta)
    return peak


def _check_number(name: str, v, allow_none: bool = False) -> None:
    if allow_none and v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        raise ValueError(f"{name} must be a number{' or None' if allow_none else ''}, got {v!r}")


def best_plan(
    fwd: Sequence[Segment],
    bwd: Sequence[Segment],
    oef: OEFTable,
    *,
    mem_budget: float | None = None,
    mem_start: float = 0.0,
) -> PairingPlan:
    """Minimal-time pairing plan of ``fwd`` with ``bwd`` by Eq. 2 (module docstring)."""
    fwd = check_strand(fwd, "fwd")
    bwd = check_strand(bwd, "bwd")
    _check_number("mem_budget", mem_budget, allow_none=True)
    _check_number("mem_start", mem_start)
    P = overlap_table(fwd, bwd, oef)
    nf, nb = len(fwd), len(bwd)
    pf, pb = _prefix(fwd), _prefix(bwd)
    budget = math.inf if mem_budget is None else float(mem_budget)

    def mem(i: int, j: int) -> float:
        return mem_start + pf[i] + pb[j]

    def moves(i: int, j: int):
        """(kind, predecessor, step time, step peak) of every step ending at (i, j), in preference order."""
        if i and j:
            yield (
                "pair",
                (i - 1, j - 1),
                P[i][j],
                step_peak("pair", mem(i - 1, j - 1), fwd[i - 1], bwd[j - 1]),
            )
        if i:
            yield "fwd", (i - 1, j), P[i][0], step_peak("fwd", mem(i - 1, j), fwd[i - 1], None)
        if j:
            yield "bwd", (i, j - 1), P[0][j], step_peak("bwd", mem(i, j - 1), None, bwd[j - 1])

    inf = math.inf
    T = [[inf] * (nb + 1) for _ in range(nf + 1)]
    T[0][0] = 0.0 if mem_start <= budget else inf
    for i in range(nf + 1):
        for j in range(nb + 1):
            for _, (pi, pj), t, peak in moves(i, j):
                if peak <= budget and T[pi][pj] + t < T[i][j]:
                    T[i][j] = T[pi][pj] + t
    if T[nf][nb] == inf:
        need = _least_budget(fwd, bwd, mem_start)
        raise InfeasiblePlanError(
            f"mem_budget={mem_budget!r}: no pairing plan keeps the peak within the budget "
            f"(the least feasible budget is {need!r})"
        )
    steps: list[PlanStep] = []
    i, j = nf, nb
    while (i, j) != (0, 0):
        for kind, (pi, pj), t, peak in moves(i, j):  # preference order = tie-break
            if peak <= budget and T[pi][pj] + t == T[i][j]:
                steps.append(
                    PlanStep(
                        kind,
                        fwd[i - 1].name if kind != "bwd" else None,
                        bwd[j - 1].name if kind != "fwd" else None,
                        t,
                        peak,
                    )
                )
                i, j = pi, pj
                break
        else:  # pragma: no cover - T[i][j] came from one of these moves
            raise AssertionError("best_plan: backtracking lost the optimal path")
    steps.reverse()
    peak = max([mem_start] + [s.peak_memory for s in steps])
    return PairingPlan(tuple(steps), T[nf][nb], peak)


def _least_budget(fwd: tuple[Segment, ...], bwd: tuple[Segment, ...], mem_start: float) -> float:
    """Minimal achievable peak over all walks (a bottleneck DP), for the error message."""
    pf, pb = _prefix(fwd), _prefix(bwd)
    nf, nb = len(fwd), len(bwd)
    B = [[math.inf] * (nb + 1) for _ in range(nf + 1)]
    B[0][0] = mem_start
    for i in range(nf + 1):
        for j in range(nb + 1):
            m = lambda a, c: mem_start + pf[a] + pb[c]  # noqa: E731
            if i and j:
                B[i][j] = min(
                    B[i][j], max(B[i - 1][j - 1], step_peak("pair", m(i - 1, j - 1), fwd[i - 1], bwd[j - 1]))
                )
            if i:
                B[i][j] = min(B[i][j], max(B[i - 1][j], step_peak("fwd", m(i - 1, j), fwd[i - 1], None)))
            if j:
                B[i][j] = min(B[i][j], max(B[i][j - 1], step_peak("bwd", m(i, j - 1), None, bwd[j - 1])))
    return B[nf][nb]


@dataclass(frozen=True)
class SearchResult:
    plan: PairingPlan
    fwd_index: int  # which forward candidate order won
    bwd_index: int


def search_plans(
    fwd_candidates: Sequence[Sequence[Segment]],
    bwd_candidates: Sequence[Sequence[Segment]],
    oef: OEFTable,
    *,
    mem_budget: float | None = None,
    mem_start: float = 0.0,
) -> SearchResult:
    """Best plan over all candidate-order pairs (ties: lowest forward, then backward index)."""
    if not fwd_candidates or not bwd_candidates:
        raise ValueError("search_plans: fwd_candidates and bwd_candidates must be non-empty")
    best: SearchResult | None = None
    last_error: InfeasiblePlanError | None = None
    for fi, f in enumerate(fwd_candidates):
        for bi, b in enumerate(bwd_candidates):
            try:
                plan = best_plan(f, b, oef, mem_budget=mem_budget, mem_start=mem_start)
            except InfeasiblePlanError as e:
                last_error = e
                continue
            if best is None or plan.total_time < best.plan.total_time:
                best = SearchResult(plan, fi, bi)
    if best is None:
        raise InfeasiblePlanError(f"search_plans: no candidate order pair is feasible; last: {last_error}")
    return best
