"""DHelix model folding and W-shaped schedule (commfuse.dhelix.folding): layer map, bubble slots
equal to 1F1B, doubled send/recv, dependencies respected. Single-process, pure Python."""

from __future__ import annotations

import random

import pytest

from commfuse.dhelix import (
    ChunkAction,
    PipelineSchedule,
    folded_layer_map,
    one_f_one_b,
    phase_durations,
    simulate,
    w_schedule,
)
from commfuse.dhelix.folding import Block, w_waves

CASES = [(2, 2), (2, 5), (3, 3), (3, 8), (4, 4), (4, 12), (5, 7)]


def test_folded_layer_map_is_u_shaped():
    # DHelix Sec. 4.1: 32 layers on 4 GPUs, G0 hosts L0-L3 and L28-L31
    m = folded_layer_map(32, 4)
    assert [layer for layer, s in enumerate(m) if s == 0] == [0, 1, 2, 3, 28, 29, 30, 31]
    assert [m.count(s) for s in range(4)] == [8] * 4
    assert m == tuple(reversed(m))
    with pytest.raises(ValueError, match="multiple of 2 \\* num_stages"):
        folded_layer_map(12, 4)
    with pytest.raises(ValueError, match="num_stages"):
        folded_layer_map(8, 0)


@pytest.mark.parametrize("stages,mbs", CASES)
def test_bubble_slots_equal_1f1b_and_transfers_double(stages, mbs):
    w = simulate(w_schedule(stages, mbs))
    o = simulate(one_f_one_b(stages, mbs))
    assert w.bubble == o.bubble == tuple([2.0 * (stages - 1)] * stages)
    assert o.transfers == 2 * (stages - 1) * mbs
    assert w.transfers == 2 * o.transfers


@pytest.mark.parametrize("stages,mbs", CASES + [(4, 2), (3, 1)])
def test_w_schedule_structure_and_slots(stages, mbs):
    sched = w_schedule(stages, mbs)
    # every action exactly once, on the folded device
    acts = [a for order in sched.orders for b in order for a in b.actions]
    want = {ChunkAction(p, i, v) for p in "FB" for i in range(mbs) for v in range(2 * stages)}
    assert len(acts) == len(want) and set(acts) == want
    for d, order in enumerate(sched.orders):
        for b in order:
            assert b.device == d and all(sched.device_of_vstage[a.vstage] == d for a in b.actions)
    # warm-up / steady / cool-down waves
    kinds = ["SI" if len(c) == 2 else c[0][0] for _, c in w_waves(stages, mbs)]
    w = min(stages, mbs)
    assert kinds == ["F"] * w + ["SI"] * (mbs - w) + ["B"] * w
    # the lockstep slots (wave step k at entry + k) are a feasible timing of these orders, so
    # the as-soon-as-possible unit-time simulation is never later, and ends with the last wave
    tl = simulate(sched)
    start = {a: s for b, s, _ in tl.blocks for a in b.actions}
    waves = w_waves(stages, mbs)
    for entry, contents in waves:
        for k in range(2 * stages):
            for p, mb in contents:
                assert start[ChunkAction(p, mb, k if p == "F" else 2 * stages - 1 - k)] <= entry + k
    assert tl.makespan == waves[-1][0] + 2 * stages


@pytest.mark.parametrize("make", [w_schedule, one_f_one_b])
def test_every_dependency_respected_with_random_durations(make):
    rng = random.Random(5)
    for stages, mbs in CASES:
        sched = make(stages, mbs)
        table = {}
        dur = lambda b, table=table: table.setdefault(b, rng.uniform(0.5, 3.0))  # noqa: E731
        lat = rng.uniform(0.0, 0.5)
        tl = simulate(sched, dur, latency=lat)
        end = tl.action_end
        for blk, s, e in tl.blocks:
            assert e - s == pytest.approx(table[blk])
            for a in blk.actions:
                for p in sched.deps(a):
                    if p in blk.actions:
                        continue
                    cross = sched.device_of_vstage[p.vstage] != blk.device
                    assert s >= end[p] + (lat if cross else 0.0) - 1e-12
        for d in range(stages):  # a device runs one block at a time, in its order
            spans = [(s, e) for b, s, e in tl.blocks if b.device == d]
            assert [b for b, _, _ in tl.blocks if b.device == d] == list(sched.orders[d])
            assert all(spans[k][1] <= spans[k + 1][0] + 1e-12 for k in range(len(spans) - 1))


def test_bubble_time_share_and_si_gain():
    s, m = 4, 12
    no_gain = simulate(w_schedule(s, m), phase_durations(1.0, 2.0, 3.0), latency=0.05)
    gain = simulate(w_schedule(s, m), phase_durations(1.0, 2.0, 2.2), latency=0.05)
    base = simulate(one_f_one_b(s, m), phase_durations(2.0, 4.0, 0.0), latency=0.05)  # same layers per stage
    assert gain.makespan < no_gain.makespan
    assert gain.makespan < base.makespan
    for tl in (no_gain, gain, base):
        assert 0.0 < tl.bubble_share < 1.0
        assert tl.bubble_share == pytest.approx(sum(tl.bubble) / (s * tl.makespan))


def test_deadlock_is_reported():
    a0, b0 = ChunkAction("F", 0, 0), ChunkAction("B", 0, 0)
    bad = PipelineSchedule("bad", 1, 1, 1, ((Block(0, (b0,)), Block(0, (a0,))),), (0,))
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(bad)
    with pytest.raises(ValueError, match="latency"):
        simulate(w_schedule(2, 2), latency=-1)
    with pytest.raises(ValueError, match="microbatches"):
        w_schedule(2, 0)
