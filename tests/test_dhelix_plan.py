"""DHelix plan search (commfuse.dhelix): Eq. 2 DP against exhaustive search, memory budget,
determinism, legal orders and self-overlap merging. Single-process, pure Python."""

from __future__ import annotations

import random

import pytest

from commfuse.dhelix import (
    SEGMENT_KINDS,
    InfeasiblePlanError,
    OEFTable,
    Segment,
    best_plan,
    default_oef,
    legal_orders,
    merge_overlapping,
    overlap_table,
    pair_time,
    search_plans,
)
from commfuse.dhelix.plan_dp import STEP_KINDS, _least_budget, step_peak

PAIRS = [(a, b) for i, a in enumerate(SEGMENT_KINDS) for b in SEGMENT_KINDS[i:]]


def _oef(values) -> OEFTable:
    return OEFTable.from_mapping(dict(zip(PAIRS, values, strict=True)))


def brute_force(fwd, bwd, oef, budget, mem_start):
    """Every monotone walk; returns (total, codes, peak) of the best under the DP's tie-break, or None."""
    P = overlap_table(fwd, bwd, oef)
    nf, nb = len(fwd), len(bwd)
    budget = float("inf") if budget is None else budget
    mem = lambda i, j: mem_start + sum(s.mem_delta for s in fwd[:i]) + sum(s.mem_delta for s in bwd[:j])  # noqa: E731
    best = None

    def walk(i, j, cost, codes, peak):
        nonlocal best
        if (i, j) == (nf, nb):
            key = (cost, tuple(STEP_KINDS.index(c) for c in reversed(codes)))
            if best is None or key < best[0]:
                best = (key, tuple(codes), peak)
            return
        for kind, ni, nj, t in (
            ("pair", i + 1, j + 1, lambda: P[i + 1][j + 1]),
            ("fwd", i + 1, j, lambda: P[i + 1][0]),
            ("bwd", i, j + 1, lambda: P[0][j + 1]),
        ):
            if ni > nf or nj > nb:
                continue
            pk = step_peak(
                kind, mem(i, j), fwd[i] if kind != "bwd" else None, bwd[j] if kind != "fwd" else None
            )
            if pk <= budget:
                walk(ni, nj, cost + t(), codes + [kind], max(peak, pk))

    if mem_start <= budget:
        walk(0, 0, 0.0, [], mem_start)
    return None if best is None else (best[0][0], best[1], best[2])


def _random_strand(rng, n, prefix, sign):
    return [
        Segment(f"{prefix}{k}", rng.choice(SEGMENT_KINDS), rng.randint(0, 8), sign * rng.randint(-2, 6))
        for k in range(n)
    ]


def test_dp_matches_exhaustive_search_on_random_instances():
    rng = random.Random(1234)
    n_infeasible = n_budgeted = 0
    for _ in range(300):
        fwd = _random_strand(rng, rng.randint(0, 4), "f", +1)  # forwards mostly allocate
        bwd = _random_strand(rng, rng.randint(0, 4), "b", -1)  # backwards mostly free
        oef = _oef([rng.choice((0.0, 0.25, 0.5, 0.75, 1.0)) for _ in PAIRS])  # dyadic: exact sums
        mem_start = rng.randint(0, 10)
        budget = None if rng.random() < 0.3 else mem_start + rng.randint(-1, 12)
        ref = brute_force(fwd, bwd, oef, budget, mem_start)
        if ref is None:
            n_infeasible += 1
            with pytest.raises(InfeasiblePlanError, match="mem_budget"):
                best_plan(fwd, bwd, oef, mem_budget=budget, mem_start=mem_start)
            least = _least_budget(tuple(fwd), tuple(bwd), mem_start)
            assert brute_force(fwd, bwd, oef, least, mem_start) is not None
            continue
        n_budgeted += budget is not None
        plan = best_plan(fwd, bwd, oef, mem_budget=budget, mem_start=mem_start)
        assert plan.total_time == ref[0]
        assert plan.codes == ref[1]
        assert plan.peak_memory == ref[2]
        assert sum(s.time for s in plan.steps) == plan.total_time
        # the plan covers each segment exactly once, in strand order
        assert [s.fwd for s in plan.steps if s.fwd] == [s.name for s in fwd]
        assert [s.bwd for s in plan.steps if s.bwd] == [s.name for s in bwd]
    assert n_infeasible >= 10 and n_budgeted >= 100  # both regimes exercised


def test_hand_checked_pairing():
    oef = OEFTable.from_mapping(
        {
            ("compute", "compute"): 0.0,
            ("compute", "comm_local"): 1.0,
            ("compute", "comm_cross"): 1.0,
            ("comm_local", "comm_local"): 0.0,
            ("comm_local", "comm_cross"): 1.0,
            ("comm_cross", "comm_cross"): 0.0,
        }
    )
    fwd = [Segment("A", "compute", 4), Segment("Bc", "comm_local", 2)]
    bwd = [Segment("C", "comm_local", 3), Segment("D", "compute", 5)]
    plan = best_plan(fwd, bwd, oef)
    # A||C = max(4,3) = 4, Bc||D = max(2,5) = 5; sequential would be 14, A||D (OEF 0) = 9 alone
    assert plan.total_time == 9
    assert [(s.kind, s.fwd, s.bwd, s.time) for s in plan.steps] == [
        ("pair", "A", "C", 4),
        ("pair", "Bc", "D", 5),
    ]


def test_eq1_inverse_and_table():
    oef = default_oef()
    # Eq. 1 round trip: OEF = (Ti + Tj - P) / min(Ti, Tj)
    p = pair_time("compute", 6.0, "comm_cross", 2.0, oef)
    assert (6.0 + 2.0 - p) / 2.0 == pytest.approx(oef("compute", "comm_cross"))
    P = overlap_table(
        [Segment("f", "compute", 3)], [Segment("b", "comm_local", 1), Segment("c", "compute", 2)], oef
    )
    assert P[0] == (0.0, 1.0, 2.0) and P[1][0] == 3.0
    assert P[1][1] == pytest.approx(3 + 1 - 0.9 * 1) and P[1][2] == pytest.approx(3 + 2 - 0.1 * 2)


def test_memory_budget_changes_plan():
    oef = default_oef()
    fwd = [Segment("F1", "compute", 2, mem_delta=5)]
    bwd = [Segment("B1", "comm_local", 2, mem_delta=-5)]
    p15 = best_plan(fwd, bwd, oef, mem_budget=15, mem_start=10)
    assert p15.codes == ("pair",) and p15.peak_memory == 15
    # pairing may allocate before the backward frees (peak 15): run the backward first
    p14 = best_plan(fwd, bwd, oef, mem_budget=14, mem_start=10)
    assert p14.codes == ("bwd", "fwd") and p14.total_time == 4 and p14.peak_memory == 10
    with pytest.raises(InfeasiblePlanError, match=r"mem_budget=9.*least feasible budget is 10"):
        best_plan(fwd, bwd, oef, mem_budget=9, mem_start=10)


def test_plan_is_deterministic_and_independent_of_dict_order():
    rng = random.Random(7)
    items = list(zip(PAIRS, [0.1, 0.9, 0.9, 0.1, 0.8, 0.1], strict=True))
    fwd = _random_strand(rng, 5, "f", 1)
    bwd = _random_strand(rng, 5, "b", -1)
    plans = set()
    for k in range(10):
        shuffled = items[:]
        random.Random(k).shuffle(shuffled)
        # also give some pairs in the reversed key order
        mapping = {((b, a) if k % 2 else (a, b)): v for (a, b), v in shuffled}
        plans.add(best_plan(fwd, bwd, OEFTable.from_mapping(mapping), mem_budget=40, mem_start=5))
    assert len(plans) == 1


def test_ties_prefer_pairing_last():
    oef = OEFTable.from_mapping({p: 0.0 for p in PAIRS})  # no overlap: every plan costs the sum
    plan = best_plan([Segment("f", "compute", 1)], [Segment("b", "compute", 1)], oef)
    assert plan.total_time == 2 and plan.codes == ("pair",)


def test_legal_orders_and_search():
    # wgrad may run before or after the dgrad reduce-scatter
    ops = ["dgrad", "rs", "wgrad", "ag"]
    deps = {"rs": {"dgrad"}, "wgrad": ["dgrad"], "ag": ("rs", "wgrad")}
    assert legal_orders(ops, deps) == [("dgrad", "rs", "wgrad", "ag"), ("dgrad", "wgrad", "rs", "ag")]
    assert legal_orders(ops, dict(reversed(list(deps.items())))) == legal_orders(ops, deps)
    with pytest.raises(ValueError, match="cycle"):
        legal_orders(["a", "b"], {"a": ["b"], "b": ["a"]})
    with pytest.raises(ValueError, match="unknown ops"):
        legal_orders(["a"], {"a": ["zz"]})
    with pytest.raises(ValueError, match="limit=3"):
        legal_orders(list("abcd"), {}, limit=3)

    seg = {
        "dgrad": Segment("dgrad", "compute", 4, -1),
        "rs": Segment("rs", "comm_local", 3, 0),
        "wgrad": Segment("wgrad", "compute", 4, -1),
        "ag": Segment("ag", "comm_local", 2, 0),
    }
    bwd_cands = [[seg[o] for o in order] for order in legal_orders(ops, deps)]
    fwd = [
        Segment("ag_f", "comm_local", 2, 1),
        Segment("gemm_f", "compute", 4, 1),
        Segment("rs_f", "comm_local", 3, 1),
    ]
    res = search_plans([fwd], bwd_cands, default_oef())
    each = [best_plan(fwd, b, default_oef()).total_time for b in bwd_cands]
    assert res.plan.total_time == min(each)
    assert res.bwd_index == each.index(min(each))
    with pytest.raises(ValueError, match="non-empty"):
        search_plans([], bwd_cands, default_oef())


def test_merge_overlapping():
    oef = default_oef()
    segs = [
        Segment("a", "compute", 2, 1),
        Segment("w", "compute", 5, -2),
        Segment("r", "comm_cross", 3, 0),
        Segment("z", "comm_local", 1, 0),
    ]
    out = merge_overlapping(segs, [("r", "w")], oef)
    assert [s.name for s in out] == ["a", "w+r", "z"]
    m = out[1]
    assert m.kind == "compute" and m.mem_delta == -2
    assert m.duration == pytest.approx(pair_time("compute", 5, "comm_cross", 3, oef))
    with pytest.raises(ValueError, match="not contiguous"):
        merge_overlapping(segs, [("a", "r")], oef)
    with pytest.raises(ValueError, match="unknown segments"):
        merge_overlapping(segs, [("a", "q")], oef)


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="kind"):
        Segment("x", "gemm", 1)
    with pytest.raises(ValueError, match="duration"):
        Segment("x", "compute", -1)
    with pytest.raises(ValueError, match="mem_delta"):
        Segment("x", "compute", 1, float("nan"))
    with pytest.raises(ValueError, match="missing factors"):
        OEFTable.from_mapping({("compute", "compute"): 0.5})
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        OEFTable.from_mapping({p: 1.5 for p in PAIRS})
    with pytest.raises(ValueError, match="unique"):
        best_plan([Segment("x", "compute", 1), Segment("x", "compute", 1)], [], default_oef())
    with pytest.raises(ValueError, match="mem_budget"):
        best_plan([], [], default_oef(), mem_budget="10")
