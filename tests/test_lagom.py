"""Lagom per-collective communicator settings: the search (costmodel/lagom.py), the pass
(transforms/lagom_tune.py) and the communicator pool of ``commfuse.setup``.

Graphs are traced with ``make_fx`` on the ``fake`` process group and judged on GPU topology
presets; the search is checked against brute force over the same ladders."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

import commfuse
from commfuse.costmodel import AnalyticCostModel, Topology
from commfuse.costmodel.lagom import (
    MAX_ROUNDS,
    NCCL_BUFFSIZE_LL,
    NCCL_BUFFSIZE_LL128,
    NCCL_BUFFSIZE_SIMPLE,
    NCCL_DEFAULT_CHUNK,
    CommunicatorPool,
    PoolGroupPlan,
    SettingTimeModel,
    brute_force,
    communicator_memory_bytes,
    default_setting,
    evaluate_settings,
    ladder_for,
    lagom_search,
    plan_communicator_pool,
    pool_alias,
    validate_communicator_ctas,
)
from commfuse.costmodel.topology import PRESETS
from commfuse.core.errors import ConfigError
from commfuse.ir import CollectiveIR
from commfuse.transforms.lagom_tune import SETTING_META
from commfuse.transforms.registry import DEFAULT_PIPELINE
from commfuse.testing.fake_pg import fake_mesh, fake_process_group

from _graphs import prefetch_graph

c10d = torch.ops._c10d_functional
H100 = Topology.preset("dgx-h100")


def _est(topo: Topology) -> AnalyticCostModel:
    return AnalyticCostModel(topo, backend="nccl" if topo.is_gpu else "gloo")


def _scheduled(gm, topo):
    commfuse.optimize(
        gm, commfuse.Config(passes=["schedule_overlap"], topology=topo, strict=True), graph_kind="forward"
    )
    return gm


def _chain(n_coll: int, world: int = 8, d: int = 1024):
    """n_coll collectives (all_gather of a weight, all_reduce and all_gather of activations, in
    turn), each next to matmuls that can hide it."""
    g = dist.group.WORLD.group_name

    def f(x, *ws):
        h = x
        for i, w in enumerate(ws):
            if i % 3 == 0:
                h = torch.tanh(h @ c10d.wait_tensor(c10d.all_gather_into_tensor(w, world, g)))
            elif i % 3 == 1:
                h = torch.tanh(h @ x)
                h = h + c10d.wait_tensor(c10d.all_reduce(h, "sum", g))
            else:
                h = torch.tanh(h @ x)
                h = h + c10d.wait_tensor(c10d.all_gather_into_tensor(h[: d // world], world, g))
        return h

    return make_fx(f, tracing_mode="fake")(
        torch.randn(d, d), *[torch.randn(d // world, d) for _ in range(n_coll)]
    )


def _two(kinds, n, sizes, ncomp, world):
    """Two collectives (ag / ar / rs) issued up front, ncomp[i] matmuls after each, both waited
    at the end after ncomp[2] more."""
    g = dist.group.WORLD.group_name

    def f(x, a, b):
        h, cs = x, []
        for i, (k, t) in enumerate(zip(kinds, (a, b), strict=True)):
            if k == "ag":
                cs.append(c10d.all_gather_into_tensor(t, world, g))
            elif k == "ar":
                cs.append(c10d.all_reduce(t, "sum", g))
            else:
                cs.append(c10d.reduce_scatter_tensor(t, "sum", world, g))
            for _ in range(ncomp[i]):
                h = torch.tanh(h @ x)
        for _ in range(ncomp[2]):
            h = torch.tanh(h @ x)
        w = [c10d.wait_tensor(c) for c in cs]
        return h, w[0].sum() + w[1].sum()

    rows = [s // (world if k == "ag" else 1) for k, s in zip(kinds, sizes, strict=True)]
    return make_fx(f, tracing_mode="fake")(
        torch.randn(n, n), torch.randn(rows[0], sizes[0]), torch.randn(rows[1], sizes[1])
    )


# ------------------------------------------------------------------ the time model
def test_time_model_fewer_resources_slower_collective_faster_compute():
    with fake_process_group(8):
        gm = _two(("ag", "ar"), 1024, (2048, 2048), (2, 0, 0), 8)
        ir = CollectiveIR(gm)
        est = _est(H100)
        model = SettingTimeModel(est)
        c = ir.collectives[0]
        assert model.comm_time_us(c, default_setting(16)) == pytest.approx(est.collective(c).time_us)
        lad = ladder_for(c, 16, H100.num_sms, None)
        times = [model.comm_time_us(c, s) for s in lad]
        assert [s.channels for s in lad] == [1, 2, 4, 8, 16, 32]
        assert all(
            a > b for a, b in zip(times, times[1:], strict=False)
        )  # more channels: faster, to the link's limit
        mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
        slow = [model.slowdown(mm, ((s.channels, s.chunk_bytes),)) for s in lad]
        assert all(a < b for a, b in zip(slow, slow[1:], strict=False)) and slow[0] > 1.0
        # the objective: the first collective at NC=1 runs longer but slows the matmuls less
        lo = evaluate_settings(gm, est, {c.name: lad[0]})
        hi = evaluate_settings(gm, est, {c.name: lad[-1]})
        assert lo.compute_us < hi.compute_us and lo.comm_us > hi.comm_us


def test_ladders_without_and_with_a_pool():
    with fake_process_group(8):
        c = CollectiveIR(_two(("ag", "ar"), 256, (256, 256), (0, 0, 1), 8)).collectives[0]
    a40 = ladder_for(c, 4, 84, None)
    assert [(s.channels, s.chunk_bytes >> 10) for s in a40] == [(1, 512), (2, 1024), (4, 2048), (8, 2048)]
    assert a40[2] == default_setting(4) and all(s.source == "advisory" for i, s in enumerate(a40) if i != 2)
    pool = CommunicatorPool(((1, 2), (4, 4), (16, 16), (8, 64)), frozenset({tuple(range(8))}))
    lad = ladder_for(c, 16, 132, pool)
    # (1,2) runs 2 channels, (4,4) 4, (16,16) equals the default (the graph's own group wins),
    # (8,64) runs NCCL's default 16 too: only the default is kept for 16
    assert [(s.channels, s.pool_group_alias) for s in lad] == [
        (2, "commfuse.cta1-2.0:8"),
        (4, "commfuse.cta4-4.0:8"),
        (16, None),
    ]
    assert all(s.chunk_bytes == NCCL_DEFAULT_CHUNK for s in lad)  # chunk is process-wide in NCCL
    other = CommunicatorPool(((1, 2),), frozenset({(0, 1)}))
    assert ladder_for(c, 16, 132, other) == [default_setting(16)]  # no pool group for this group


def test_reused_simulator_equals_a_fresh_one():
    """The search overwrites collective durations in one simulator between evaluations; the
    answer must equal a simulator built from scratch with those durations and that contention."""
    from commfuse.costmodel.estimator import CollectiveEstimate
    from commfuse.costmodel.lagom import _Judge
    from commfuse.costmodel.simulator import Simulator

    with fake_process_group(8):
        gm = _scheduled(_chain(5), H100)
        est, ir = _est(H100), CollectiveIR(gm)
        model = SettingTimeModel(est)
        judge = _Judge(gm, model, ir, ir.collectives)
        rng = random.Random(3)
        for _ in range(3):
            picks = {c.name: rng.choice(ladder_for(c, 16, 132, None)) for c in ir.collectives}
            got = judge.evaluate(picks)

            class Fixed:
                compute_time_us = staticmethod(est.compute_time_us)

                @staticmethod
                def collective(c, picks=picks):
                    e = est.collective(c)
                    return CollectiveEstimate(model.comm_time_us(c, picks[c.name]), e.wire_bytes, e.algorithm)

            def slow(node, conc, picks=picks):
                return model.slowdown(
                    node, tuple(sorted((picks[c.name].channels, picks[c.name].chunk_bytes) for c in conc))
                )

            ref = Simulator(gm, Fixed(), slowdown=slow, ir=ir).simulate()
            assert (got.makespan_us, got.compute_us, got.comm_us, got.exposed_comm_us) == (
                ref.makespan_us,
                ref.compute_us,
                ref.comm_us,
                ref.exposed_comm_us,
            )
        assert judge.evaluate({}) == evaluate_settings(gm, est, {})  # unnamed collectives: NCCL defaults


# ------------------------------------------------------------------ the search
@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_search_terminates_and_grows_linearly(n):
    with fake_process_group(8):
        gm = _scheduled(_chain(n), H100)
        r = lagom_search(gm, _est(H100))
    rungs = 6  # NC 1..32 on DGX-H100
    assert len(r.settings) == n and not r.budget_exhausted
    # the bound of the step rule: per round a raise and a give-back sweep, each <= rungs evaluations per collective
    assert r.evaluations <= 2 * MAX_ROUNDS * rungs * n + 2
    # what it actually costs on this chain: about one evaluation per rung per collective
    assert r.evaluations <= (rungs + 1) * n + 2
    assert r.brute_force_combinations == rungs**n
    if n >= 4:
        assert r.evaluations * 40 < r.brute_force_combinations
    assert r.makespan_us <= r.makespan_default_us
    assert len(r.trace) == r.evaluations - 2  # default + starting point, then one per step


def test_search_cost_per_collective_is_flat():
    counts = {}
    with fake_process_group(8):
        for n in (4, 8, 16):
            counts[n] = lagom_search(_scheduled(_chain(n), H100), _est(H100)).evaluations
    # linear, not growing with the square or the exponent: doubling n at most doubles (plus b)
    assert counts[8] <= 2 * counts[4] + 2 and counts[16] <= 2 * counts[8] + 2


BRUTE_CASES = [
    # (preset, nodes, kinds, n, sizes, ncomp, schedule)
    ("dgx-h100", 1, ("ag", "ag"), 1024, (1024, 1024), (1, 1, 1), True),
    ("dgx-h100", 1, ("ar", "rs"), 2048, (2048, 4096), (1, 2, 0), True),
    ("dgx-h100", 2, ("ag", "ar"), 1024, (2048, 1024), (2, 1, 1), True),
    ("dgx-a100", 1, ("rs", "ag"), 1024, (2048, 2048), (1, 1, 2), False),
    ("a40-pcie", 1, ("ar", "ag"), 1024, (1024, 2048), (2, 2, 1), True),
    ("pcie-8gpu", 1, ("ag", "rs"), 512, (512, 1024), (1, 0, 2), False),
]


@pytest.mark.parametrize("case", BRUTE_CASES, ids=lambda c: f"{c[0]}x{c[1]}-{'-'.join(c[2])}-{c[3]}")
def test_matches_brute_force_on_two_collectives(case):
    preset, nodes, kinds, n, sizes, ncomp, sched = case
    topo = Topology.preset(preset, num_nodes=nodes)
    with fake_process_group(topo.world_size):
        gm = _two(kinds, n, sizes, ncomp, topo.world_size)
        if sched:
            _scheduled(gm, topo)
        r, b = lagom_search(gm, _est(topo)), brute_force(gm, _est(topo))
    assert b.evaluations == b.brute_force_combinations + 1  # every combination + the default
    assert r.makespan_us == pytest.approx(b.makespan_us, rel=1e-9)
    assert r.makespan_us <= r.makespan_default_us
    assert r.evaluations < 3 * b.evaluations


def test_matches_brute_force_with_a_pool():
    pool = CommunicatorPool(((1, 1), (2, 2), (4, 4), (8, 8)), None)
    with fake_process_group(8):
        gm = _scheduled(_two(("ag", "rs"), 2048, (2048, 2048), (2, 1, 1), 8), H100)
        r, b = lagom_search(gm, _est(H100), pool=pool), brute_force(gm, _est(H100), pool=pool)
    assert r.makespan_us == pytest.approx(b.makespan_us, rel=1e-9)
    assert all(s.channels in (1, 2, 4, 8, 16) for s in r.settings.values())
    for s in r.settings.values():
        assert (s.pool_group_alias is None) == (s.channels == 16)
    assert r.extra_communicators == {
        s.pool_group_alias: communicator_memory_bytes(s.channels)
        for s in r.settings.values()
        if s.pool_group_alias
    }


def test_close_to_brute_force_on_random_two_collective_graphs():
    """Algorithms 1-2 are a heuristic: on random 2-collective graphs over five topologies they
    must hit the brute-force optimum most of the time, stay close always, never lose to NCCL's
    defaults, and cost at most a few brute-force runs' worth of evaluations."""
    rng = random.Random(7)
    presets = [("dgx-h100", 1), ("dgx-a100", 1), ("a40-pcie", 1), ("pcie-8gpu", 1), ("dgx-h100", 2)]
    exact, gaps = 0, []
    cases = 30
    for _ in range(cases):
        preset, nodes = rng.choice(presets)
        topo = Topology.preset(preset, num_nodes=nodes)
        kinds = tuple(rng.choice(["ag", "ar", "rs"]) for _ in range(2))
        n = rng.choice([256, 512, 1024, 2048])
        sizes = tuple(rng.choice([256, 512, 1024, 2048, 4096]) for _ in range(2))
        ncomp = tuple(rng.randint(0, 3) for _ in range(3))
        with fake_process_group(topo.world_size):
            gm = _two(kinds, n, sizes, ncomp, topo.world_size)
            if rng.random() < 0.5:
                _scheduled(gm, topo)
            r, b = lagom_search(gm, _est(topo)), brute_force(gm, _est(topo))
        assert r.makespan_us <= r.makespan_default_us * (1 + 1e-12)
        assert r.makespan_us >= b.makespan_us * (1 - 1e-9)  # brute force is the optimum
        gap = r.makespan_us / b.makespan_us - 1
        exact += gap <= 1e-9
        gaps.append(gap)
    assert exact >= 0.8 * cases, sorted(gaps)[-6:]
    assert max(gaps) < 0.05


def test_budget_and_determinism():
    with fake_process_group(8):
        gm = _scheduled(_chain(6), H100)
        short = lagom_search(gm, _est(H100), max_evaluations=5)
        a, b = lagom_search(gm, _est(H100)), lagom_search(gm, _est(H100))
    assert short.evaluations == 5 and short.budget_exhausted
    assert any("budget" in n for n in short.notes)
    assert short.makespan_us <= short.makespan_default_us
    # collectives the search never reached are on NCCL's default, not on their minimal starting rung
    reached = {s.collective for s in short.trace}
    assert reached and len(reached) < 6
    assert all(s == default_setting(16) for k, s in short.settings.items() if k not in reached)
    assert a.settings == b.settings and a.trace == b.trace and a.evaluations == b.evaluations
    with pytest.raises(ConfigError, match="max_evaluations"):
        lagom_search(gm, _est(H100), max_evaluations=1)
    with pytest.raises(ValueError, match="lagom_max_evaluations"):
        commfuse.Config(lagom_max_evaluations=1)
    assert commfuse.Config().cache_key() != commfuse.Config(lagom_max_evaluations=10).cache_key()


def test_gloo_topology_returns_empty_result_with_note():
    cpu = Topology.preset("cpu-gloo", num_nodes=4)
    with fake_process_group(8):
        gm = _chain(3)
        r = lagom_search(gm, _est(cpu))
    assert r.settings == {} and r.evaluations == 0 and not r.tuned
    assert "gloo has no per-collective communicator knobs" in r.notes[0]


# ------------------------------------------------------------------ the pass
def _run_pass(gm, topo, tmp_path=None, **cfg):
    cfg.setdefault("passes", ["schedule_overlap", "lagom_tune"])
    commfuse.optimize(
        gm,
        commfuse.Config(topology=topo, strict=True, dump_dir=str(tmp_path) if tmp_path else None, **cfg),
        graph_kind="forward",
    )
    rep = commfuse.last_report(gm)
    return rep, next(p for p in rep.passes if p.name == "lagom_tune")


def test_pass_writes_meta_and_report_decisions(tmp_path):
    with fake_process_group(8):
        ref = _scheduled(_chain(4), H100)
        gm = _chain(4)
        rep, rec = _run_pass(gm, H100, tmp_path)
        ir = CollectiveIR(gm)
        direct = lagom_search(ref, _est(H100))
    assert rec.error is None and not rec.changed
    assert gm.code == ref.code  # only meta written: the same ops in the same order
    FileCheck().check("all_gather_into_tensor").check("all_reduce").check("all_gather_into_tensor").run(
        gm.code
    )
    assert rep.analysis.sequence_hashes == commfuse.analyze(ref).sequence_hashes
    for c in ir.collectives:
        meta = c.start.meta[SETTING_META]
        assert set(meta) >= {"min_ctas", "max_ctas", "chunk_bytes", "nthreads", "pool_group_alias"}
        assert meta == direct.settings[c.name].to_meta()  # what the search chose, written as is
        assert meta["pool_group_alias"] is None  # no pool in this process: advisory
    summary = rec.decisions[0]
    assert summary["summary"] == "lagom" and summary["evaluations"] == direct.evaluations
    assert summary["predicted_makespan_us"] <= summary["predicted_makespan_default_us"]
    assert len(summary["trace"]) == direct.evaluations - 2
    assert {d["collective"] for d in rec.decisions[1:]} == {c.name for c in ir.collectives}
    assert rec.counts["settings_written"] == 4 and rec.counts["collectives_tuned"] >= 1
    # the decisions land in the dumps
    dumped = json.loads(next(tmp_path.glob("rank0/forward_*/pipeline.json")).read_text())
    lagom = next(p for p in dumped["passes"] if p["name"] == "lagom_tune")
    assert lagom["decisions"][0]["summary"] == "lagom"
    assert any("no communicator pool" in n for n in summary["notes"])


def test_pass_uses_the_session_pool(monkeypatch):
    from commfuse import session as S

    plan = plan_communicator_pool([tuple(range(8))], [(1, 2), (4, 4)])
    monkeypatch.setattr(
        S,
        "_SESSION",
        S.Session(topology=H100, communicator_ctas=((1, 2), (4, 4)), communicator_pool_plan=plan),
    )
    with fake_process_group(8):
        gm = prefetch_graph(2048, 8)  # three weight gathers hidden under matmuls
        # the same batch on every rank: the matmuls are priced (by default they are not,
        # tests/test_same_decision.py)
        _, rec = _run_pass(gm, H100, uniform_batches=True)
        ir = CollectiveIR(gm)
    metas = [c.start.meta[SETTING_META] for c in ir.collectives]
    assert len(metas) == 3 and {m["channels"] for m in metas} <= {2, 4, 16}
    for m in metas:
        if m["channels"] == 16:
            assert m["pool_group_alias"] is None and m["source"] == "default"
        else:
            assert m["pool_group_alias"] == f"commfuse.cta{m['min_ctas']}-{m['max_ctas']}.0:8"
            assert m["source"] == "pool" and m["chunk_bytes"] == NCCL_DEFAULT_CHUNK
    summary = rec.decisions[0]
    assert summary["pool"] == [[1, 2], [4, 4]]
    assert rec.counts["pool_group_settings"] == sum(m["pool_group_alias"] is not None for m in metas) >= 1
    assert summary["extra_memory_bytes_estimate"] == sum(
        communicator_memory_bytes(m["channels"])
        for m in {m["pool_group_alias"]: m for m in metas if m["pool_group_alias"]}.values()
    )


def test_pass_is_a_noop_with_a_note_on_gloo():
    with fake_process_group(8):
        gm = _chain(3)
        _, rec = _run_pass(gm, Topology.preset("cpu-gloo", num_nodes=4), passes=["lagom_tune"])
        assert all(SETTING_META not in n.meta for n in gm.graph.nodes)
    assert not rec.changed and rec.counts == {"collectives_tuned": 0}
    assert "gloo has no per-collective communicator settings" in rec.decisions[0]["note"]


def test_pass_without_topology_refuses():
    with fake_process_group(8):
        gm = _chain(2)
        commfuse.optimize(gm, commfuse.Config(passes=["lagom_tune"], strict=True), graph_kind="forward")
    rec = commfuse.last_report(gm).passes[0]
    assert not rec.changed and "no topology" in rec.refusals[0]


def test_setting_meta_key_is_the_lowerings():
    plan = pytest.importorskip("commfuse.lowering.plan")
    assert plan.SETTING_META == SETTING_META


# ------------------------------------------------------------------ the pool at set-up
@pytest.mark.parametrize(
    "bad, match",
    [
        ([(4, 2)], r"communicator_ctas\[0\]: min_ctas 4 > max_ctas 2"),
        ([(1, 2), (0, 4)], r"communicator_ctas\[1\]\.min_ctas: must be >= 1"),
        ([(1, -3)], r"communicator_ctas\[0\]\.max_ctas: must be >= 1"),
        ([(1,)], r"communicator_ctas\[0\]: expected a \(min_ctas, max_ctas\) pair"),
        ([(True, 2)], r"communicator_ctas\[0\]\.min_ctas: expected an int"),
        ("1-2", r"communicator_ctas: expected a list"),
    ],
)
def test_setup_rejects_bad_communicator_ctas(bad, match):
    try:
        with pytest.raises(ConfigError, match=match):
            commfuse.setup(communicator_ctas=bad)
    finally:
        commfuse.session.reset()


def test_validate_drops_duplicates():
    assert validate_communicator_ctas([(1, 2), [1, 2], (4, 4)]) == ((1, 2), (4, 4))
    assert validate_communicator_ctas(None) == ()


def test_pool_plan_configs_ranks_names_and_order():
    with fake_mesh(8, (2, 4), ("dp", "tp")) as mesh:
        plan = commfuse.session.communicator_pool_plan(
            8, [(1, 2), (4, 4)], mesh=mesh, groups=[[[0, 1, 2, 3], [4, 5, 6, 7]], [[3]]]
        )
    got = [(p.ranks, p.min_ctas, p.max_ctas, p.alias) for p in plan]
    world = tuple(range(8))
    dp = [(0, 4), (1, 5), (2, 6), (3, 7)]
    tp = [(0, 1, 2, 3), (4, 5, 6, 7)]
    # world, then mesh dims in order (dp blocks, tp blocks), then `groups` (already seen: skipped;
    # single ranks: skipped); per parent every CTA pair in the order given
    want = [(r, mn, mx, pool_alias(mn, mx, r)) for r in [world, *dp, *tp] for mn, mx in [(1, 2), (4, 4)]]
    assert got == want
    assert got[0][3] == "commfuse.cta1-2.0:8" and got[2][3] == "commfuse.cta1-2.0:5:4"
    assert pool_alias(4, 4, (1, 3, 5, 7)) == "commfuse.cta4-4.1:8:2"
    with pytest.raises(ConfigError, match="outside the world"):
        commfuse.session.communicator_pool_plan(4, [(1, 2)], groups=[[[0, 5]]])


def test_setup_on_fake_backend_ignores_pool_with_warning():
    try:
        with fake_process_group(4):
            with pytest.warns(UserWarning, match="communicator_ctas is ignored on backend 'fake'"):
                s = commfuse.setup(communicator_ctas=[(1, 2)])
            assert (
                s.communicator_ctas == ((1, 2),)
                and s.communicator_pool_plan == []
                and not s.communicator_pool
            )
            assert not any(a.startswith("commfuse.cta") for a in s.alias_blocks)
    finally:
        commfuse.session.reset()


def test_communicator_memory_estimate():
    per_channel = 2 * (NCCL_BUFFSIZE_SIMPLE + NCCL_BUFFSIZE_LL128 + NCCL_BUFFSIZE_LL)
    assert per_channel == 2 * (4 * 2**20 + 4_915_200 + 524_288)
    assert communicator_memory_bytes(8) == 8 * per_channel
    assert 70 * 2**20 < communicator_memory_bytes(4) < 80 * 2**20  # ~9.2 MiB per channel and connection


@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA + NCCL")
def test_nccl_pool_group_created_with_cta_bounds(tmp_path):
    """World size 1 NCCL: the creation path (ProcessGroupNCCL.Options, new_group, alias) for a
    one-rank pool group (the planner skips those in real jobs; here it exercises the calls)."""
    from commfuse import session as S

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        sess = S.Session()
        alias = pool_alias(1, 2, (0,))
        S._create_communicator_pool(sess, [PoolGroupPlan((0,), 1, 2, alias)])
        pg = sess.communicator_pool[alias]
        from commfuse.core.torch_private import resolve_process_group

        assert resolve_process_group(alias) is pg
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t, group=pg)
        assert torch.equal(t.cpu(), torch.ones(4))
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.min_ctas, opts.config.max_ctas = 1, 2  # the names setup sets exist in this torch
        assert (opts.config.min_ctas, opts.config.max_ctas) == (1, 2)
    finally:
        dist.destroy_process_group()
        S._POOL_CREATED.clear()


def test_lagom_report_small(monkeypatch):
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1]))  # the repo: `benchmarks`
    from benchmarks.lagom_report import lagom_tables, run_lagom_report

    doc = run_lagom_report(small=True, blocks=("simple_fsdp",))
    (block,) = doc["blocks"]
    assert doc["predicted"] and [g["graph"] for g in block["graphs"]] == ["forward", "backward"]
    for g in block["graphs"]:
        for mode in ("advisory", "pool"):
            r = g[mode]
            assert r["makespan_us"] <= r["makespan_default_us"] and r["evaluations"] >= 2
    # SimpleFSDP over 16 ranks: the world is the only group, 4 CTA configurations
    assert block["pool_memory"]["groups_total"] == 4 == block["pool_memory"]["groups_on_rank"]
    text = lagom_tables(doc)
    assert "PREDICTED" in text and "communicator pool: 4 groups" in text


# ------------------------------------------------------------------ real gloo ranks
def lagom_pipeline_matches_eager() -> dict:
    """Rank job: the default pipeline + lagom_tune under a 2-rank GPU topology runs on gloo and
    matches eager (outputs, grads, params); returns the lagom_tune records."""
    import _multirank_jobs as J

    topo = Topology(**{**PRESETS["dgx-h100"], "name": "gpu-1x2", "ranks_per_node": 2})
    commfuse.setup(topology=topo)
    try:
        out = J.compiled_matches_eager("llama_tp_sp", "float32", passes=[*DEFAULT_PIPELINE, "lagom_tune"])
    finally:
        commfuse.session.reset()
    return {"lagom": [p for p in out["passes"] if p["name"] == "lagom_tune"], "graphs": out["graphs"]}


@pytest.mark.slow(reason="trains on real gloo ranks against eager, forward and backward compiled per rank")
@pytest.mark.multirank
def test_lagom_pipeline_on_gloo_ranks_matches_eager(rank_pool_2):
    res = rank_pool_2.run(lagom_pipeline_matches_eager)
    for r in res:
        recs = r["lagom"]
        assert {"forward", "backward"} <= set(r["graphs"]) and len(recs) >= 2
        assert all(p["error"] is None and not p["changed"] for p in recs)
        assert all(p["counts"]["settings_written"] >= 1 for p in recs)
    # the same decisions on both ranks
    assert [p["decisions"][1:] for p in res[0]["lagom"]] == [p["decisions"][1:] for p in res[1]["lagom"]]
