"""commfuse's boundary ops (commfuse::m2ms, commfuse::stage_transfer) in the IR, the verifier, the
pass pipeline, the cost model / simulator, the volume formulas (Chimera Table 2's boundary rows)
and the reference interpreter (against real gloo ranks: multirank)."""

from __future__ import annotations

import copy
import warnings

import pytest
import sympy
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse
from commfuse.costmodel import AnalyticCostModel, CollectiveModel, CollectiveParams, Topology
from commfuse.costmodel import volume as V
from commfuse.ops.boundary.cost import transfer_time_us
from commfuse.costmodel.estimator import CollectiveEstimate
from commfuse.costmodel.simulator import simulate
from commfuse.costmodel.volume import B, H, N, N1, N2, S, k
from commfuse.ir import CollectiveIR, CollectiveKind, ParallelRole
from commfuse.ops.boundary.ir_view import boundary_op_names
from commfuse.ops import M2MS, STAGE_TRANSFER, m2ms, stage_transfer, trace_position
from commfuse.passmgr.verifier import verify_graph
from commfuse.reference import CollectiveMismatchError, run_reference
from commfuse.testing import crosscheck as cc
from commfuse.testing import assert_bitwise_equal_tree, assert_close_tree
from commfuse.testing.fake_pg import fake_process_group

K = CollectiveKind
W = torch.ops._c10d_functional.wait_tensor.default
F32 = 4

# src [0, 2] -> dst [1, 2, 3] over the world of 4, along dim 1 of [2, rows, 5] (40 bytes a slice);
# group rank 2 is in both sets (its piece to itself is 0 here), rank 1 and 3 only receive.
SRC, DST, SPLITS = [0, 2], [1, 2, 3], [[1, 2, 0], [3, 0, 1]]
FLAT = [v for r in SPLITS for v in r]
ROWS = {0: 3, 2: 4}  # row sums
COLS = {1: 4, 2: 2, 3: 1}  # column sums
SLICE = 2 * 5 * F32


def _trace(fn, *args, world=4, rank=0):
    with fake_process_group(world, rank=rank) as pg:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = make_fx(lambda *a: fn(pg, *a), tracing_mode="fake")(*args)
        return gm, CollectiveIR(gm), verify_graph(gm)


def _async_program(pg, x, y):
    a = W(M2MS(x, 1, FLAT, SRC, DST, 4, pg.group_name))
    b = W(STAGE_TRANSFER(y, [0, 1], [2, 3], 4, pg.group_name))
    return a * 2, b + 1


def _x(rank, requires_grad=False):
    return torch.randn(2, ROWS.get(rank, 0), 5, requires_grad=requires_grad)


# ----------------------------------------------------------------------------------- IR fields
@pytest.mark.parametrize("rank", range(4))
def test_ir_fields_of_m2ms_and_stage_transfer_on_every_rank(rank):
    gm, ir, ver = _trace(_async_program, _x(rank), torch.randn(3, 4), rank=rank)
    assert ver.ok, ver.problems
    m, p = ir.collectives
    # m2ms: rank-dependent shapes from the piece matrix; bytes sent = its row minus its own piece
    assert (m.kind, p.kind) == (K.M2MS, K.P2P)
    assert m.group.size == 4 and m.group.ranks == (0, 1, 2, 3)
    assert m.input_shapes == [(2, ROWS.get(rank, 0), 5)] and m.output_shapes == [(2, COLS.get(rank, 0), 5)]
    sent = {0: 3, 1: 0, 2: 4, 3: 0}[rank] * SLICE
    received = {0: 0, 1: 4, 2: 2, 3: 1}[rank] * SLICE
    assert m.logged_bytes == m.wire_bytes == sent
    assert m.extra["received_bytes"] == received and m.extra["self_bytes"] == 0
    assert m.extra["position"] == rank and m.extra["position_source"] == "process"
    assert m.logical_dim == m.logical_concat_dim == 1
    assert [w.target for w in m.waits] == [W] and m.logical_output is m.waits[0] and not m.synchronous
    assert m.role is ParallelRole.UNKNOWN  # overlapping, unequal rank sets: neither a stage boundary nor EP
    # stage_transfer [0, 1] -> [2, 3]: sources send x (48 bytes), destinations receive it
    assert p.input_shapes == p.output_shapes == [(3, 4)]
    assert p.logged_bytes == p.wire_bytes == (48 if rank in (0, 1) else 0)
    assert p.extra["received_bytes"] == (48 if rank in (2, 3) else 0)
    assert p.role is ParallelRole.PP and p.logical_dim is None
    row = next(r for r in commfuse.analyze(gm).collectives if r.kind == "many_to_many_scatter")
    assert row.received_bytes == received and "m2ms dim 1 src [0, 2] -> dst [1, 2, 3]" in row.transfers


def test_sequence_hashes_agree_across_ranks_and_see_the_splits():
    """The m2ms input is a different size on every rank: the hashed signature uses the piece matrix."""
    hashes = {_trace(_async_program, _x(r), torch.randn(3, 4), rank=r)[1].order_hash() for r in range(4)}
    assert len(hashes) == 1

    def other(pg, x, y):
        a = W(M2MS(x, 1, [1, 2, 0, 2, 1, 1], SRC, DST, 4, pg.group_name))  # same row sums, other pieces
        b = W(STAGE_TRANSFER(y, [0, 1], [2, 3], 4, pg.group_name))
        return a * 2, b + 1

    assert _trace(other, _x(0), torch.randn(3, 4))[1].order_hash() not in hashes


def test_roles_of_stage_boundary_and_uneven_all_to_all():
    def f(pg, x, y):
        a = W(M2MS(x, 0, [1, 2, 0, 3], [0, 1], [2, 3], 4, pg.group_name))  # disjoint: a stage boundary
        b = W(M2MS(y, 0, [0, 1, 1, 0], [0, 1], [1, 0], 4, pg.group_name))  # src == dst (as sets): all-to-all
        return a, b

    _, ir, ver = _trace(f, torch.randn(3, 2), torch.randn(1, 2))
    assert ver.ok, ver.problems
    assert [c.role for c in ir.collectives] == [ParallelRole.PP, ParallelRole.EP]
    # rank 0 sends 1 row to 2 and 2 rows to 3 (8 bytes a row); in the second it keeps its row
    assert [c.wire_bytes for c in ir.collectives] == [24, 0]
    assert ir.collectives[1].extra["self_bytes"] == 8


def test_position_from_the_shapes_when_traced_as_a_peer():
    """trace_position: rank 0 traces the m2ms as dst[1] (group rank 2): the IR takes the rank
    from the shapes and reports rank 2's bytes, not rank 0's."""

    def f(pg, x):
        with trace_position(pg.group_name, 1):
            return W(M2MS(x, 1, FLAT, SRC, DST, 4, pg.group_name))

    _, ir, _ = _trace(f, _x(2))
    (c,) = ir.collectives
    assert c.extra["position"] == 2 and c.extra["position_source"] == "shapes"
    assert c.wire_bytes == 4 * SLICE and c.extra["received_bytes"] == 2 * SLICE


def test_autograd_variants_are_synchronous_collectives_the_verifier_accepts():
    def f(pg, x, y):
        a = m2ms(x, 1, SPLITS, SRC, DST, pg)
        b = stage_transfer(y, [0, 1], [2, 3], pg)
        return torch.autograd.grad((a * a).sum() + (b * b).sum(), [x, y])

    gm, ir, ver = _trace(f, _x(0, True), torch.randn(3, 4, requires_grad=True))
    assert ver.ok, ver.problems
    names = [str(c.start.target) for c in ir.collectives]
    assert names == [
        "commfuse.m2ms_autograd.default",
        "commfuse.stage_transfer_autograd.default",
        "commfuse.stage_transfer_autograd.default",
        "commfuse.m2ms_autograd.default",
    ]
    assert all(c.synchronous and not c.waits and c.logical_output is c.start for c in ir.collectives)
    fwd, bwd = ir.collectives[0], ir.collectives[3]
    # the backward is the reverse scatter: rank 0 receives back what it sent
    assert (fwd.wire_bytes, fwd.extra["received_bytes"]) == (3 * SLICE, 0)
    assert (bwd.wire_bytes, bwd.extra["received_bytes"]) == (0, 3 * SLICE)
    # a wait on a synchronous op is a verifier problem (there is no work to wait for)
    node = ir.collectives[0].start
    with gm.graph.inserting_after(node):
        w = gm.graph.call_function(W, (node,))
    w.meta["val"] = node.meta["val"]
    node.replace_all_uses_with(w, delete_user_cb=lambda u: u is not w)
    problems = verify_graph(gm).problems
    assert any("synchronous many_to_many_scatter op is waited" in p for p in problems), problems


# ----------------------------------------------------------------------- passes leave them alone
def _pipeline_program(pg, rows, x, y, w):
    """Boundary ops between the collectives the passes rewrite (gather, scatter, all_reduce)."""
    g = pg.group_name
    h = torch.relu(x @ w)
    a = W(torch.ops._c10d_functional.all_reduce.default(h, "sum", g))
    m = m2ms(a[:rows], 0, [[2, 1], [0, 3]], [0, 1], [2, 3], pg)
    s = stage_transfer(torch.tanh(y), [0, 1, 2], [1, 2, 3], pg)
    ag = W(torch.ops._c10d_functional.all_gather_into_tensor.default(s, 4, g))
    rs = W(torch.ops._c10d_functional.reduce_scatter_tensor.default(ag * 2, "sum", 4, g))
    loss = (m * m).sum() + (rs * torch.sin(rs)).sum()
    return [m, rs, *torch.autograd.grad(loss, [x, y, w])]


def test_default_pipeline_and_every_pass_keep_the_boundary_ops():
    """The default pipeline (strict) and each registered pass on joint graphs with m2ms and
    stage_transfer next to the collectives they rewrite: the verifier accepts the result, the
    boundary ops are kept as they were (same args, in the same order; except by the boundary
    fusion passes, whose job is to rewrite them) and the reference values are unchanged."""
    from commfuse.transforms.registry import available_passes

    rows = {0: 3, 1: 3, 2: 0, 3: 0}
    graphs, inputs = [], []
    for r in range(4):
        g = torch.Generator().manual_seed(r)
        ins = [torch.randn(4, 4, generator=g), torch.randn(8, 4, generator=g), torch.randn(4, 4, generator=g)]
        with fake_process_group(4, rank=r) as pg:
            graphs.append(
                make_fx(lambda *a: _pipeline_program(pg, rows[r], *a), tracing_mode="fake")(  # noqa: B023 - traced now
                    *[t.clone().requires_grad_() for t in ins]
                )
            )
        inputs.append(ins)
    expected = run_reference(graphs, inputs)

    def boundary(gm):
        return [
            (str(n.target), n.args[1:])
            for n in gm.graph.nodes
            if n.op == "call_function" and n.target in boundary_op_names()
        ]

    before = [boundary(g) for g in graphs]
    assert len(before[0]) == 4  # m2ms and stage_transfer, forward and backward
    for passes in [None, *([p] for p in sorted(available_passes()) if p != "moe_recognition")]:
        out = []
        for r in range(4):
            gm = copy.deepcopy(graphs[r])
            with fake_process_group(4, rank=r):
                commfuse.optimize(gm, commfuse.Config(passes=passes, strict=True))
                assert verify_graph(gm).ok, (passes, verify_graph(gm).problems)
            if not (passes and passes[0].startswith("boundary_")):  # boundary fusion rewrites them on purpose
                assert boundary(gm) == before[r], (passes, r)
            out.append(gm)
        assert_close_tree(run_reference(out, inputs), expected, msg=f"pipeline {passes}", summands=4)


# ------------------------------------------------------------------------------- cost model
TWO_NODES = Topology(
    name="t",
    num_nodes=2,
    ranks_per_node=2,
    intra_node_bandwidth_GBps=100.0,
    inter_node_bandwidth_GBps=10.0,
    intra_node_latency_us=2.0,
    inter_node_latency_us=7.0,
    collective_launch_us=5.0,
)


def test_transfer_time_by_hand():
    """t_g = launch + latency x max(send peers, receive peers) + max(bytes / link), max over ranks."""
    m = CollectiveModel(TWO_NODES)
    # rank 0 sends 1 MB to 1 (same node) and 1 MB to 2 (other node); rank 3 sends 2 MB to 1
    pieces = [(0, 1, 10**6), (0, 2, 10**6), (3, 1, 2 * 10**6)]
    time, max_sent, per = transfer_time_us(m, K.M2MS, pieces)
    r0 = 5 + (2 + 7) + max(1e6 / 1e5, 1e6 / 1e4)  # 114: inter-node link is the bottleneck
    r1 = 5 + (2 + 7) + max(1e6 / 1e5, 2e6 / 1e4)  # receives 1 MB intra and 2 MB inter: 214
    r3 = 5 + 7 + 2e6 / 1e4
    assert per[1].received == 3 * 10**6 and per[1].recv_peers_inter == 1 and per[0].send_peers_intra == 1
    assert time == pytest.approx(max(r0, r1, r3)) and max_sent == 2 * 10**6
    assert transfer_time_us(m, K.M2MS, [(1, 1, 10**9)])[0] == 0  # a piece to oneself is a local copy
    slow = CollectiveModel(TWO_NODES, params=CollectiveParams(bandwidth_multiplier={K.M2MS: 0.5}))
    assert transfer_time_us(slow, K.M2MS, pieces)[0] == pytest.approx(5 + 9 + 400)


def test_estimate_is_the_same_on_every_rank():
    """Every rank prices the m2ms from the whole piece matrix: one answer, the slowest rank's."""
    model = AnalyticCostModel(TWO_NODES)
    ests = []
    for r in range(4):
        _, ir, _ = _trace(_async_program, _x(r), torch.randn(3, 4), rank=r)
        ests.append([model.collective(c) for c in ir.collectives])
    assert all(e == ests[0] for e in ests)
    m2, p2 = ests[0]
    assert m2.algorithm == "m2ms" and p2.algorithm == "p2p"
    # m2ms: rank 2 sends 3 slices to rank 1 (other node) and 1 to rank 3 (same node): 2 peers;
    # rank 1 receives 1 slice from 0 (same node) and 3 from 2 (other node)
    r2 = 5 + 2 + 7 + 3 * SLICE / 1e4
    assert m2.time_us == pytest.approx(r2) and m2.wire_bytes == 4 * SLICE
    # stage_transfer 0 -> 2 and 1 -> 3: both pairs cross nodes
    assert p2.time_us == pytest.approx(5 + 7 + 48 / 1e4) and p2.wire_bytes == 48


def test_simulator_blocks_on_synchronous_ops_and_overlaps_async_ones():
    class Fixed:
        def compute_time_us(self, node):
            return 10.0 if node.op == "call_function" and "mm" in str(node.target) else 0.0

        def collective(self, c):
            return CollectiveEstimate(30.0, 0, "fixed")

    def overlapped(pg, x, w):
        h = STAGE_TRANSFER(x, [0], [1], 4, pg.group_name)
        y = w @ w  # independent compute while the transfer is in flight
        return W(h) + 1, y

    def blocking(pg, x, w):
        h = stage_transfer(x, [0], [1], pg)  # the autograd variant: waits inside
        return h + 1, w @ w

    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)
    a = simulate(_trace(overlapped, x, w)[0], Fixed())
    b = simulate(_trace(blocking, x, w)[0], Fixed())
    assert (a.exposed_comm_us, a.makespan_us) == (20.0, 30.0)  # 10 us of compute hide a third
    assert (b.exposed_comm_us, b.makespan_us) == (30.0, 40.0)  # nothing runs under it


def test_kinds_have_models_for_raw_sizes():
    m = CollectiveModel(TWO_NODES)
    assert m.time(K.P2P, 10**6, 4).algorithm == "p2p" and m.time(K.P2P, 10**6, 4).wire_bytes == 10**6
    assert m.time(K.P2P, 10**6, 2).time_us < m.time(K.P2P, 10**6, 4).time_us  # the 4-rank group spans nodes


# ------------------------------------------------------------------ Chimera Table 2, boundary rows
def _eq(a, b) -> bool:
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


def test_boundary_transitions_reproduce_table2():
    """SP+PP, TP+PP and PP+EP with their boundary ops as piece matrices: the volumes the IR's byte
    rule gives equal Table 2's real demand and ratio at every admissible size, inside the paper's range."""
    rows = {r.transition: r for r in V.table2()}
    for n in range(2, 9):
        t = V.sp_pp_transition(n)
        assert _eq(t.real_demand, rows["SP+PP"].real_demand) and _eq(t.ratio, rows["SP+PP"].ratio.subs(N, n))
        assert _eq(
            t.plans["m2ms"].max_received(), B * S * H
        )  # every stage-2 rank gets the gathered activation
        lo, hi = rows["SP+PP"].paper_ratio
        assert lo <= t.ratio <= hi
        p = V.pp_ep_transition(n)
        assert _eq(p.real_demand, B * S * H) and _eq(p.ratio, rows["PP+EP"].ratio.subs({N: n, k: 1}))
        assert rows["PP+EP"].paper_ratio[0] <= p.ratio <= rows["PP+EP"].paper_ratio[1]
    for n1 in range(2, 7):
        for n2 in range(2, 7):
            t = V.tp_pp_transition(n1, n2)
            row = rows["TP+PP"]
            assert _eq(t.real_demand, row.real_demand.subs({N1: n1, N2: n2}))
            assert _eq(t.current_volume, (row.size1 + row.size2).subs({N1: n1, N2: n2}))
            assert row.paper_ratio[0] <= t.ratio <= row.paper_ratio[1]
            # the resharding m2ms moves each element once: every sender BSH/n1, every receiver BSH/n2
            assert _eq(t.plans["m2ms"].max_sent(), B * S * H / n1)
            assert _eq(t.plans["m2ms"].max_received(), B * S * H / n2)


def test_pp_ep_with_top_k_above_one_moves_k_copies():
    """Table 2's PP+EP real demand (BSH) assumes every token travels once; routed to k ranks it
    travels k times, and the fused m2ms only pays while k < n."""
    for n, kk in [(2, 2), (4, 2), (4, 4), (8, 2)]:
        t = V.pp_ep_transition(n, kk)
        assert _eq(t.real_demand, kk * B * S * H)
        assert _eq(t.ratio, sympy.Rational(kk * n, n + (n - 1) * kk))
        assert (t.ratio < 1) == (kk < n)


def test_ir_bytes_of_a_traced_resharding_m2ms_equal_the_plan():
    """Alpa's resharding (4 TP ranks -> 2 ranks of the next stage) traced as a real m2ms: the IR's
    per-rank bytes are the plan's, BSH/N1 per sender, BSH/N2 per receiver (B=2, S=8, H=3, fp32)."""
    plan = V.resharding_plan(4, 2, length=8, unit=2 * 3)
    splits = [[int(v) for v in row] for row in plan.splits]
    for r in range(6):
        x = torch.randn(2, 2 if r < 4 else 0, 3)

        def f(pg, x):
            return m2ms(x, 1, splits, list(plan.src), list(plan.dst), pg)

        _, ir, _ = _trace(f, x, world=6, rank=r)
        (c,) = ir.collectives
        assert c.wire_bytes == (2 * 8 * 3 * F32 // 4 if r < 4 else 0)
        assert c.extra["received_bytes"] == (2 * 8 * 3 * F32 // 2 if r >= 4 else 0)


# ------------------------------------------------------------------------- reference interpreter
def test_reference_semantics_by_hand_and_errors():
    graphs, inputs = [], []
    for r in range(4):
        x = _x(r)
        graphs.append(_trace(_async_program, x, torch.randn(3, 4), rank=r)[0])
        inputs.append([x, torch.randn(3, 4)])
    outs = run_reference(graphs, inputs)
    xs = [i[0] for i in inputs]
    assert torch.equal(outs[1][0], 2 * torch.cat([xs[0][:, 0:1], xs[2][:, 0:3]], 1))
    assert torch.equal(outs[2][0], 2 * xs[0][:, 1:3]) and torch.equal(outs[3][0], 2 * xs[2][:, 3:4])
    assert outs[0][0].shape == (2, 0, 5)
    assert torch.equal(outs[2][1], inputs[0][1] + 1) and torch.equal(outs[0][1], torch.ones(3, 4))
    # an input of the wrong size along dim (rank 0 must send 3 slices)
    bad = [list(i) for i in inputs]
    bad[0][0] = torch.randn(2, 2, 5)
    with pytest.raises(CollectiveMismatchError, match=r"rank 0 node m2ms .*size 2 along dim 1.*sends 3"):
        run_reference(graphs, bad)

    # ranks that disagree on the piece matrix: the receiver expects another piece than was sent
    def other(pg, x, y):
        return W(M2MS(x, 1, [2, 1, 0, 3, 0, 1], SRC, DST, 4, pg.group_name)), y

    g1 = list(graphs)
    g1[1] = _trace(other, _x(1), torch.randn(3, 4), rank=1)[0]
    with pytest.raises(CollectiveMismatchError, match="receives .* from rank 0"):
        run_reference(g1, inputs)


def test_input_changed_after_issue_is_no_race():
    """The boundary ops copy what they send when issued: changing x before the wait is allowed."""

    def f(pg, x, y):
        t = STAGE_TRANSFER(x, [0, 1], [2, 3], 4, pg.group_name)
        x.add_(y)
        return W(t) * 1, x

    gm = _trace(f, torch.randn(3), torch.randn(3))[0]
    ins = [[torch.full((3,), float(r)), torch.ones(3)] for r in range(4)]
    outs = run_reference(gm, ins)
    assert torch.equal(outs[2][0], torch.zeros(3)) and torch.equal(outs[3][0], torch.ones(3))
    assert torch.equal(outs[0][1], torch.ones(3))


@pytest.mark.parametrize("case", sorted(cc.BOUNDARY_CASES))
def test_boundary_cases_run_on_reference(case):
    graphs, groups, inputs = cc.trace_case(case)
    outs = run_reference(graphs, inputs, groups=groups)
    assert len(outs) == cc.WORLD_SIZE and all(isinstance(o, list) and o for o in outs)


@pytest.fixture(scope="module")
def gloo_boundary(rank_pool_4):
    from _jobs_boundary_ir import boundary_cases_on_gloo

    return rank_pool_4.run(boundary_cases_on_gloo, 0, timeout=180)


_GLOO_PARAMS = [
    pytest.param(case, per_rank, id=f"{case}-{'graph_per_rank' if per_rank else 'one_graph'}")
    for case in sorted(cc.BOUNDARY_CASES)
    for per_rank in (False, True)
    if per_rank or not cc.BOUNDARY_CASES[case].per_rank
]


@pytest.mark.multirank
@pytest.mark.parametrize("case, per_rank", _GLOO_PARAMS)
def test_reference_matches_gloo(gloo_boundary, case, per_rank):
    """The interpreter's m2ms / stage_transfer (async and autograd variants) against the ops run on
    4 real gloo ranks: bitwise for pure data movement, the tolerance policy where compute is traced."""
    spec = cc.BOUNDARY_CASES[case]
    graphs, groups, inputs = cc.trace_case(case, per_rank=per_rank)
    outs = run_reference(graphs, inputs, groups=groups)
    for r in range(cc.WORLD_SIZE):
        if spec.exact:
            assert_bitwise_equal_tree(outs[r], gloo_boundary[r][case], msg=f"{case} on rank {r}")
        else:
            assert_close_tree(
                outs[r], gloo_boundary[r][case], msg=f"{case} on rank {r}", summands=cc.WORLD_SIZE
            )


def test_reference_max_min_of_signed_zeros_do_not_depend_on_layout():
    """torch.maximum returns either operand for +0.0 vs -0.0 depending on the kernel path; the
    reference follows IEEE 754-2019 (+0 > -0) for every layout (fuzz regression
    primitive_substitution_forced-mismatch-edbdbaaa9f: zero-padded m2ms outputs through matmuls)."""
    from commfuse.reference import reduce_tensors

    pos, neg = torch.zeros(64, 2), torch.full((64, 2), -0.0)
    for a, b in [(pos, neg), (neg, pos), (pos[:, 0], neg[:, 0]), (neg[:1, 0], pos[:1, 0])]:
        assert torch.equal(reduce_tensors([a, b], "max").signbit(), torch.zeros(a.shape, dtype=torch.bool))
        assert torch.equal(reduce_tensors([a, b], "min").signbit(), torch.ones(a.shape, dtype=torch.bool))
    x = torch.tensor([1.0, float("nan"), -2.0])
    assert torch.equal(reduce_tensors([x, -x], "max")[[0, 2]], torch.tensor([1.0, 2.0]))
    assert reduce_tensors([x, -x], "max")[1].isnan()
