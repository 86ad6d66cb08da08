"""Volume formulas (`commfuse.costmodel.volume`): Chimera Tables 1-2 exactly, and the thesis's
DP/TP/SP/EP models against `commfuse.analyze` on the example models' graphs (exact bytes)."""

from __future__ import annotations

import warnings

import pytest
import sympy
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse
from commfuse.costmodel import volume as V
from commfuse.costmodel.volume import B, H, N, N1, N2, S, k
from commfuse.ir import CollectiveIR
from commfuse.testing.fake_pg import fake_mesh, fake_process_group
from commfuse.testing.graphs import capture_aot_graphs

c10d = torch.ops._c10d_functional
F32 = 4


def _eq(a, b) -> bool:
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


# ------------------------------------------------------------------ Table 1
def test_table1_identities():
    t1 = V.table1()
    assert _eq(t1["TP all_reduce"], t1["reduce_scatter"] + t1["SP all_gather"])  # AR = RS + AG
    assert _eq(t1["EP all_to_all"], k * t1["SP all_gather"])
    assert _eq(t1["PP p2p"], t1["M2MS"]) and _eq(t1["PP p2p"], B * S * H)
    # logged vs wire: an all_gather logs BSH/N but sends (N-1)BSH/N; an all_reduce logs BSH, sends 2(N-1)BSH/N
    assert _eq(V.sp_all_gather_wire(B, S, H, N) / V.sp_all_gather_logged(B, S, H, N), N - 1)
    assert _eq(V.reduce_scatter_wire(B, S, H, N) / V.reduce_scatter_logged(B, S, H, N), N - 1)
    assert _eq(V.tp_all_reduce_wire(B, S, H, N) / V.tp_all_reduce_logged(B, S, H), 2 * (N - 1) / N)
    assert V.tp_all_reduce_wire(2, 16, 64, 8, elt=4) == 14336  # what analyze reports for llama TP below


# ------------------------------------------------------------------ Table 2
def test_table2_rows_are_exact():
    rows = {r.transition: r for r in V.table2()}
    assert list(rows) == ["TP+SP", "TP+PP", "TP+EP", "PP+EP", "SP+PP", "SP+EP"]
    assert rows["TP+SP"].ratio == sympy.Rational(1, 2)  # exactly, for symbolic B, S, H, N
    assert _eq(
        rows["TP+PP"].ratio,
        (B * S * H + (N2 - 1) * B * S * H / N2)
        / (2 * (N1 - 1) * B * S * H / N1 + B * S * H / N1 + (N2 - 1) * B * S * H / N2),
    )
    assert _eq(rows["TP+EP"].ratio.subs({N1: N, N2: N}), (1 + k) / (2 + k))
    assert _eq(rows["PP+EP"].ratio, 1 / (1 + (N - 1) * k / N))
    assert _eq(rows["SP+PP"].ratio, N / (2 * N - 1))
    assert _eq(rows["SP+EP"].ratio.subs({N1: N, N2: N}), k / (1 + k))
    for r in rows.values():
        assert not (r.ratio.free_symbols & {B, S, H}), r.transition  # ratios never depend on B, S, H


@pytest.mark.parametrize("row", V.table2(), ids=lambda r: r.transition)
def test_table2_ranges_reproduce_the_paper(row):
    """Endpoints at the documented points equal the paper's percentages exactly, and a grid of
    admissible N (and k) stays inside the range."""
    lo, hi = row.paper_ratio
    assert V.evaluate_point(row.ratio, row.low) == lo, (row.transition, row.low.note)
    assert V.evaluate_point(row.ratio, row.high) == hi, (row.transition, row.high.note)
    same_n = {N1: N, N2: N} if row.transition in ("TP+EP", "SP+EP") else {}
    r = row.ratio.subs(same_n)
    for n1 in (2, 3, 4, 8, 64):
        for n2 in (2, 3, 4, 8, 64):
            for kk in (1, 2, 4, 8):
                v = r.subs({N: n1, N1: n1, N2: n2, k: kk})
                assert lo <= v <= hi, (row.transition, n1, n2, kk, v)


def test_table2_tp_pp_monotone():
    r = next(x for x in V.table2() if x.transition == "TP+PP").ratio
    d1, d2 = sympy.diff(r, N1), sympy.diff(r, N2)
    for n1 in range(2, 20):
        for n2 in range(2, 20):
            assert d1.subs({N1: n1, N2: n2}) < 0 < d2.subs({N1: n1, N2: n2})
    # with N1 = N2 the paper's 60-80% would shrink to 66.7-75%
    same = sympy.simplify(r.subs({N1: N, N2: N}))
    assert same.subs(N, 2) == sympy.Rational(3, 4) and sympy.limit(same, N, sympy.oo) == sympy.Rational(2, 3)


def test_table2_ratios_through_the_ir():
    """Each transition traced with symbolic B, S, H (N = N1 = N2 = 4, k = 2): the IR's wire bytes of the
    fused collectives over the unfused ones equal the row's ratio exactly."""
    n, kk = 4, 2
    with fake_process_group(n) as pg:
        g = pg.group_name

        def f(x):
            xs = x.narrow(0, 0, x.shape[0] // n)  # one rank's shard of the [B, S, H] activation
            e = torch.cat([x] * kk)  # EP dispatch buffer: B·S·k tokens
            sp = [e.shape[0] // n] * n
            w = c10d.wait_tensor
            return (
                w(c10d.all_reduce(x, "sum", g)),
                w(c10d.reduce_scatter_tensor(x, "sum", n, g)),
                w(c10d.all_gather_into_tensor(xs, n, g)),
                w(c10d.all_to_all_single(e, sp, sp, g)),
                w(c10d.isend(x, 1, 0, g)),
                w(c10d.isend(xs, 1, 0, g)),
            )

        gm = make_fx(f, tracing_mode="symbolic")(torch.randn(8, 6, 4))
        colls = CollectiveIR(gm).collectives
        wire = [c.wire_bytes for c in colls]
        batch = colls[0].input_shapes[0][0]  # the symbol of B
    AR, RS, AG, A2A, P2P, M2MS_SHARD = wire
    current_fused = {
        "TP+SP": ([AR], [RS]),
        "TP+PP": ([AR, M2MS_SHARD, AG], [P2P, AG]),  # Alpa's resharding: M2MS of BSH/N1 + all_gather
        "TP+EP": ([AR, A2A], [RS, A2A]),
        "PP+EP": ([P2P, A2A], [P2P]),
        "SP+PP": ([AG, P2P], [P2P]),
        "SP+EP": ([AG, A2A], [A2A]),
    }
    assert isinstance(batch, sympy.Symbol)
    q = sympy.Symbol("q", positive=True, integer=True)  # B = 4q: the shard floor(B/4) is exactly B/4
    for row in V.table2():
        cur, fused = current_fused[row.transition]
        ir_ratio = sympy.simplify((sum(fused) / sum(cur)).subs(batch, n * q))
        expected = row.ratio.subs({N: n, N1: n, N2: n, k: kk})
        assert _eq(ir_ratio, expected), (row.transition, ir_ratio, expected)


def test_table2_ratios_through_the_simulator():
    """The same transitions simulated with a bandwidth-only estimator (time = wire bytes / β, exact
    Fractions): communication time of the fused collectives over the unfused ones = the row's ratio."""
    from fractions import Fraction

    from commfuse.costmodel.estimator import CollectiveEstimate
    from commfuse.costmodel.simulator import simulate

    class WireTime:
        def compute_time_us(self, node):
            return 0

        def collective(self, c):
            return CollectiveEstimate(Fraction(int(c.wire_bytes), 25), int(c.wire_bytes), "ring")

    n, kk, (b, s, h) = 4, 2, (8, 6, 4)
    with fake_process_group(n) as pg:
        g = pg.group_name

        def f(x):
            xs = x.narrow(0, 0, b // n)
            e = torch.cat([x] * kk)
            sp = [e.shape[0] // n] * n
            w = c10d.wait_tensor
            return (
                w(c10d.all_reduce(x, "sum", g)),
                w(c10d.reduce_scatter_tensor(x, "sum", n, g)),
                w(c10d.all_gather_into_tensor(xs, n, g)),
                w(c10d.all_to_all_single(e, sp, sp, g)),
                w(c10d.isend(x, 1, 0, g)),
                w(c10d.isend(xs, 1, 0, g)),
            )

        r = simulate(make_fx(f, tracing_mode="fake")(torch.randn(b, s, h)), WireTime())
    AR, RS, AG, A2A, P2P, M2MS_SHARD = [c.duration_us for c in r.collectives]
    assert r.comm_us == AR + RS + AG + A2A + P2P + M2MS_SHARD
    current_fused = {
        "TP+SP": ([AR], [RS]),
        "TP+PP": ([AR, M2MS_SHARD, AG], [P2P, AG]),
        "TP+EP": ([AR, A2A], [RS, A2A]),
        "PP+EP": ([P2P, A2A], [P2P]),
        "SP+PP": ([AG, P2P], [P2P]),
        "SP+EP": ([AG, A2A], [A2A]),
    }
    for row in V.table2():
        cur, fused = current_fused[row.transition]
        assert Fraction(sum(fused) / sum(cur)) == row.ratio.subs({N: n, N1: n, N2: n, k: kk}), row.transition


# ------------------------------------------------------------------ thesis models: symbolic checks
def test_thesis_models_symbolic():
    b, s, h, n, m, L, P = sympy.symbols("b s h n m L P", positive=True)
    # TP: the thesis's L·8·b·s·h·(n-1)/n·β per micro-batch is 4 all_reduces per layer
    assert _eq(V.tp_wire(L, b, s, h, n, elt=2), L * 8 * b * s * h * (n - 1) / n * 2)
    assert _eq(V.tp_wire(L, b, s, h, n, micro_batches=m), m * V.tp_wire(L, b, s, h, n))
    # SP moves the same wire bytes as TP, but logs only 2/n of TP's counts
    assert _eq(V.sp_wire(L, b, s, h, n), V.tp_wire(L, b, s, h, n))
    assert _eq(V.sp_logged(L, b, s, h, n) / V.tp_logged(L, b, s, h), 2 / n)
    # DP ring all_reduce vs FSDP all_gather + reduce_scatter: same wire, logged counts 2/n of DP's
    assert _eq(V.dp_all_reduce_wire(P, n), V.fsdp_wire(P, n))
    assert _eq(V.dp_all_reduce_wire(P, n, 2, 4), 2 * (n - 1) / n * P / 8)
    assert _eq(V.fsdp_logged(P, n) / V.dp_all_reduce_logged(P, n), 2 / n)
    # EP: 4·B·S·k·h·(1 - 1/n) per MoE layer; counts from the run, not a factor
    assert _eq(V.ep_wire(b, s, h, n, k), 4 * b * s * k * h * (1 - 1 / n))
    assert _eq(V.ep_wire(b, s, h, n, 2, moe_layers=8) / V.ep_wire(b, s, h, n, 1, moe_layers=4), 4)
    # PP: edge stages send m·bsh one way, middle stages both ways; with TP each rank bsh/n_TP
    assert _eq(V.pp_stage_send_wire(0, 4, b, s, h, micro_batches=m), m * b * s * h)
    assert _eq(V.pp_stage_send_wire(1, 4, b, s, h, micro_batches=m), 2 * m * b * s * h)
    assert _eq(V.pp_stage_send_wire(3, 4, b, s, h, micro_batches=m, n_tp=n), m * b * s * h / n)
    assert V.pp_bubble_fraction(4, 16) == sympy.Rational(3, 16)
    with pytest.raises(ValueError):
        V.pp_stage_send_wire(4, 4, b, s, h)
    # parameter counts
    assert V.megatron_param_count(1, 12, 0, 0) == 12 * 144 + 13 * 12
    assert V.llama_param_count(2, 32, 64) == 2 * (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32)
    assert V.moe_dispatch_slots(16, 8, 2) == 32 and V.moe_dispatch_slots(16, 8, 2, sympy.Rational(5, 4)) == 40


# ------------------------------------------------------------------ thesis models vs analyze
LAYERS, DIM, FFN, BATCH, SEQ, WORLD = 2, 32, 64, 2, 8, 4


def _quiet_capture(model, inputs, loss):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture_aot_graphs(model, *inputs, loss=loss)


def _kind(report, kind):
    t = report.by_kind.get(kind)
    return (0, 0, 0) if t is None else (t.count, t.logged_bytes, t.wire_bytes)


@pytest.fixture(scope="module")
def llama_reports():
    from commfuse.models import llama

    cfg = llama.LlamaConfig(n_layers=LAYERS, dim=DIM, n_heads=4, ffn_dim=FFN)
    out = {}
    for sp in (False, True):
        with fake_mesh(WORLD) as mesh:
            m = llama.parallelize_llama(llama.build_llama(cfg), mesh, sequence_parallel=sp)
            data = llama.make_inputs(cfg, BATCH, SEQ, rank=0, world_size=WORLD, sequence_parallel=sp)
            g = _quiet_capture(m, (data.inputs,), lambda o, d=data: llama.loss_fn(o, d))
            out[sp] = {k: commfuse.analyze(g[k]) for k in ("forward", "backward")}
    return out


@pytest.mark.slow(reason="compiles Llama TP/SP variants (module fixture)")
def test_llama_tp_all_reduces_match(llama_reports):
    fw, bw = llama_reports[False]["forward"], llama_reports[False]["backward"]
    b, s, h, n = BATCH, SEQ, DIM, WORLD
    # forward: 2 all_reduces of [B, S, H] per layer (after wo and w2)
    assert _kind(fw, "all_reduce") == (
        2 * LAYERS,
        2 * LAYERS * V.tp_all_reduce_logged(b, s, h, elt=F32),
        2 * LAYERS * V.tp_all_reduce_wire(b, s, h, n, F32),
    )
    # backward: one per column-parallel input gradient, 5 per layer (wq, wk, wv each; w1 and w3 summed)
    assert _kind(bw, "all_reduce") == (
        5 * LAYERS,
        5 * LAYERS * V.tp_all_reduce_logged(b, s, h, elt=F32),
        5 * LAYERS * V.tp_all_reduce_wire(b, s, h, n, F32),
    )
    total_wire = fw.total.wire_bytes + bw.total.wire_bytes
    total_logged = fw.total.logged_bytes + bw.total.logged_bytes
    assert total_wire == V.tp_wire(LAYERS, b, s, h, n, F32, forward_all_reduces=2, backward_all_reduces=5)
    assert total_logged == V.tp_logged(LAYERS, b, s, h, n, F32, forward_all_reduces=2, backward_all_reduces=5)


@pytest.mark.slow(reason="compiles Llama TP/SP variants (module fixture)")
def test_llama_sp_gathers_and_scatters_match(llama_reports):
    fw, bw = llama_reports[True]["forward"], llama_reports[True]["backward"]
    b, s, h, n = BATCH, SEQ, DIM, WORLD  # s: the full sequence (each rank holds s/n)
    for r in (fw, bw):
        assert _kind(r, "all_gather") == (
            2 * LAYERS,
            2 * LAYERS * V.sp_all_gather_logged(b, s, h, n, F32),
            2 * LAYERS * V.sp_all_gather_wire(b, s, h, n, F32),
        )
        assert _kind(r, "reduce_scatter") == (
            2 * LAYERS,
            2 * LAYERS * V.reduce_scatter_logged(b, s, h, n, F32),
            2 * LAYERS * V.reduce_scatter_wire(b, s, h, n, F32),
        )
        assert _kind(r, "all_reduce")[0] == 0
    wire = fw.total.wire_bytes + bw.total.wire_bytes
    logged = fw.total.logged_bytes + bw.total.logged_bytes
    assert wire == V.sp_wire(LAYERS, b, s, h, n, F32) == V.tp_wire(LAYERS, b, s, h, n, F32)  # Megatron 2+2
    assert logged == V.sp_logged(LAYERS, b, s, h, n, F32)


@pytest.mark.parametrize("mode", ["fully_shard", "replicate"])
def test_simple_fsdp_matches_dp_models(mode):
    from commfuse.models import llama, simple_fsdp

    cfg = llama.LlamaConfig(n_layers=LAYERS, dim=DIM, n_heads=4, ffn_dim=FFN)
    with fake_mesh(WORLD) as mesh:
        m = simple_fsdp.data_parallel(llama.build_llama(cfg), mesh, mode)
        data = simple_fsdp.make_inputs(cfg, 4 * BATCH, SEQ, rank=0, world_size=WORLD)
        g = _quiet_capture(m, (data.inputs,), lambda o: simple_fsdp.loss_fn(o, data))
        fw, bw = commfuse.analyze(g["forward"]), commfuse.analyze(g["backward"])
    P = V.llama_param_count(LAYERS, DIM, FFN)
    n_params = LAYERS * 9  # 7 linears + 2 norms per block, one collective each
    if mode == "fully_shard":
        per = V.fsdp_logged(P, WORLD, F32) / 2, V.fsdp_wire(P, WORLD, F32) / 2
        assert _kind(fw, "all_gather") == (n_params, *per)
        assert _kind(bw, "reduce_scatter") == (n_params, *per)
        assert (
            fw.total.wire_bytes + bw.total.wire_bytes
            == V.fsdp_wire(P, WORLD, F32)
            == V.dp_all_reduce_wire(P, WORLD, elt=F32)
        )
    else:
        assert fw.total.count == 0
        assert _kind(bw, "all_reduce") == (
            n_params,
            V.dp_all_reduce_logged(P, WORLD, elt=F32),
            V.dp_all_reduce_wire(P, WORLD, elt=F32),
        )


def test_moe_ep_all_to_all_matches():
    from commfuse.models import moe

    E, K = 8, 2
    with fake_mesh(WORLD) as mesh:
        m = moe.parallelize_moe(
            moe.build_moe(dim=DIM, num_experts=E, ffn_dim=FFN, top_k=K, capacity_factor=1.0), mesh
        )
        data = moe.make_inputs(WORLD * BATCH, SEQ, DIM, rank=0, world_size=WORLD)
        g = _quiet_capture(m, (data.inputs,), lambda o: moe.loss_fn(o[0], o[1], data))
        fw, bw = commfuse.analyze(g["forward"]), commfuse.analyze(g["backward"])
    b, s, h = BATCH, SEQ, DIM  # this rank's tokens
    assert V.moe_dispatch_slots(b * s, E, K) == K * b * s  # capacity factor 1: the buffer is B·S·k slots
    per = V.ep_all_to_all_logged(b, s, h, WORLD, K, F32), V.ep_all_to_all_wire(b, s, h, WORLD, K, F32)
    assert _kind(fw, "all_to_all") == (2, 2 * per[0], 2 * per[1])  # dispatch + combine
    assert _kind(bw, "all_to_all") == (2, 2 * per[0], 2 * per[1])  # their transposes
    wire = _kind(fw, "all_to_all")[2] + _kind(bw, "all_to_all")[2]
    logged = _kind(fw, "all_to_all")[1] + _kind(bw, "all_to_all")[1]
    assert wire == V.ep_wire(b, s, h, WORLD, K, F32) and logged == V.ep_logged(b, s, h, WORLD, K, F32)
    # the replicated norm + router gradients: a DP all_reduce of their parameters
    assert _kind(bw, "all_reduce") == (
        2,
        V.dp_all_reduce_logged(E * DIM + DIM, WORLD, elt=F32),
        V.dp_all_reduce_wire(E * DIM + DIM, WORLD, elt=F32),
    )


def test_pp_send_matches():
    with fake_process_group(2) as pg:

        def f(x):
            return c10d.wait_tensor(c10d.isend(x, 1, 0, pg.group_name))

        r = commfuse.analyze(make_fx(f, tracing_mode="fake")(torch.randn(BATCH, SEQ, DIM)))
    assert _kind(r, "send") == (1, V.pp_p2p_logged(BATCH, SEQ, DIM, F32), V.pp_p2p_wire(BATCH, SEQ, DIM, F32))
    assert V.pp_stage_send_wire(0, 2, BATCH, SEQ, DIM, F32) == r.total.wire_bytes
