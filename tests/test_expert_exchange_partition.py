"""Expert-exchange partition: dispatch all_to_all -> expert compute -> combine all_to_all cut
into chunks so one chunk's exchange runs under another chunk's expert compute.

Graph-level tests trace under the fake process group, check the chunked code with FileCheck
and every rewrite on the N-rank reference interpreter (`check_equivalent`); refusals leave
the graph unchanged and say why. The simulated comparison prices commfuse.models.moe's
forward and backward graphs (fake 8-rank mesh, DGX-H100): exposed communication with the
pass below the unpartitioned graph and not above graph_trainer's fixed two-chunk split (the
pass forced to ``workload_chunks=2``). The 4-rank gloo run trains the MoE block compiled with
the pass against eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

import commfuse
from commfuse.costmodel import Topology
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.passmgr.context import PassContext
from commfuse.testing.equivalence import check_equivalent
from commfuse.testing.fake_pg import fake_mesh, fake_process_group
from commfuse.testing.graphs import _copy, capture_aot_graphs
from commfuse.ops.moe_layer.comm_volume import chunks_of
from commfuse.ops.moe_layer.op import MOE_LAYER, MOE_LAYER_BACKWARD
from commfuse.ops.moe_layer import cost as moe_cost
from commfuse.transforms.expert_exchange_partition import (
    DROPLESS,
    TokenChunkPlan,
    plan_exchange_partition,
    plan_token_chunks,
)
from commfuse.transforms.partition_search import score_graph

PASS = "expert_exchange_partition"
A2A = "all_to_all_single"
WAIT = "wait_tensor"
N, C, D, H = 4, 4, 16, 32  # ranks, capacity slots per expert, hidden, ffn


def _run(gm, **cfg):
    commfuse.optimize(gm, commfuse.Config(passes=[PASS], strict=True, **cfg))
    return next(p for p in commfuse.last_report(gm).passes if p.name == PASS)


def _a2a_starts(gm):
    return [c for c in CollectiveIR(gm).collectives if c.kind.value == "all_to_all"]


def _exchange(experts: int, mid=None, C: int = C, D: int = D):
    """The EP MoE exchange of commfuse.models.moe: ``x`` [experts, C, D] slots, dim 0 split over
    the ranks; each rank runs its local experts (bmm -> gelu -> bmm) on the slots of every rank;
    the combine sends them back. ``mid``: applied to the ffn activations."""
    local = experts // N

    def f(x, w1, w2):
        g = dist.group.WORLD
        recv = funcol.all_to_all_single(x.reshape(experts * C, D), None, None, g)
        h = recv.view(N, local, C, D).transpose(0, 1).reshape(local, N * C, D)
        a = F.gelu(torch.bmm(h, w1))
        if mid is not None:
            a = mid(a)
        y = torch.bmm(a, w2)
        back = y.view(local, N, C, D).transpose(0, 1).reshape(experts * C, D)
        return funcol.all_to_all_single(back, None, None, g)

    return f


def _trace(fn, experts: int, C: int = C, D: int = D, H: int = H):
    local = experts // N
    return make_fx(fn, tracing_mode="fake")(
        torch.randn(experts, C, D), torch.randn(local, D, H), torch.randn(local, H, D)
    )


def test_exchange_cut_into_chunks_that_overlap_expert_compute():
    with fake_process_group(N):
        gm = _trace(_exchange(8), 8)
        before = _copy(gm)
        rec = _run(gm)
        assert rec.changed and rec.counts["exchanges_partitioned"] == 1, rec.refusals
        (d,) = rec.decisions
        # the capacity slots of every expert are cut (16 blocks along the flat [E*C] dim: the
        # expert weights stay whole); no topology: graph_trainer's two chunks
        assert (d["chunks"], d["blocks"], d["sizes"]) == (2, 8, [16, 16]), d
        starts = _a2a_starts(gm)
        assert len(starts) == 4 and {c.group.name for c in starts} == {"0"}
        assert all(tuple(c.input_shapes[0]) == (16, D) for c in starts)
        # dispatch 0, dispatch 1, then chunk 0's wait before chunk 0's compute and combine,
        # chunk 1's wait after chunk 0's combine is issued: the exchange overlaps compute; the
        # combine's chunks interleave back per expert (a stack of the per-expert slot halves)
        (
            FileCheck()
            .check(A2A)
            .check(A2A)
            .check(WAIT)
            .check("aten.bmm")
            .check("aten.gelu")
            .check("aten.bmm")
            .check(A2A)
            .check(WAIT)
            .check("aten.bmm")
            .check("aten.gelu")
            .check("aten.bmm")
            .check(A2A)
            .check(WAIT)
            .check(WAIT)
            .check("aten.stack")
            .run(gm.code)
        )
        check_equivalent(before, gm, N)


def test_chunk_count_from_algorithm_1_and_forced_two():
    topo = Topology.preset("dgx-h100", num_nodes=1)
    # uniform_batches: every rank routes the same number of tokens here, so the expert compute
    # the exchange overlaps is priced (by default it is not, tests/test_same_decision.py)
    with fake_process_group(N):
        # a latency-bound exchange (16 KiB): every count is predicted slower than the whole
        gm = _trace(_exchange(8), 8)
        ctx = PassContext(gm, commfuse.Config(topology=topo, uniform_batches=True), topology=topo)
        why = plan_exchange_partition(ctx, _a2a_starts(gm)[0])
        assert isinstance(why, str) and "predicted slower than the whole exchange" in why, why
        # forced to graph_trainer's two chunks it cuts anyway
        cfg = commfuse.Config(topology=topo, workload_chunks=2, uniform_batches=True)
        ctx = PassContext(gm, cfg, topology=topo)
        assert plan_exchange_partition(ctx, _a2a_starts(gm)[0])[0].chunks == 2
        # a bandwidth-bound one (8 MiB): no independent compute, Algorithm 1 allows max_chunks,
        # the pipeline model picks more than two
        gm = make_fx(_exchange(8, C=256, D=1024), tracing_mode="fake")(
            torch.randn(8, 256, 1024), torch.randn(2, 1024, 4096), torch.randn(2, 4096, 1024)
        )
        ctx = PassContext(gm, commfuse.Config(topology=topo, uniform_batches=True), topology=topo)
        plan = plan_exchange_partition(ctx, _a2a_starts(gm)[0])
        assert not isinstance(plan, str), plan
        assert 2 < plan[0].chunks <= 8 and "Algorithm 1" in plan[0].why and "predicted fastest" in plan[0].why
        # values: the test above (the reference run of 8 MiB is slow)
        rec = _run(gm, topology=topo, uniform_batches=True)
        assert rec.counts["chunk_collectives"] == 2 * plan[0].chunks


def test_unequal_splits_refused():
    def f(x):
        g = dist.group.WORLD
        y = funcol.all_to_all_single(x, [2, 6, 4, 4], [2, 6, 4, 4], g)
        y = torch.relu(y @ torch.ones(D, D))
        return funcol.all_to_all_single(y, [2, 6, 4, 4], [2, 6, 4, 4], g)

    with fake_process_group(N):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(16, D))
        code = gm.code
        rec = _run(gm)
        assert not rec.changed and gm.code == code
        assert len(rec.refusals) == 2 and all(DROPLESS in r for r in rec.refusals), rec.refusals


# ---------------------------------------------------------------- dropless: commfuse::moe_layer
def _moe_op(capacity_factor: float, backward: bool = False):
    """One commfuse::moe_layer call (top-2, E = 2 per rank) on the world, or its backward."""
    g = dist.group.WORLD.group_name
    if backward:
        return lambda go, x, rw, w1, w3, w2: list(
            MOE_LAYER_BACKWARD(
                go, torch.zeros(2 * N), torch.zeros(()), x, rw, w1, w3, w2, 2, capacity_factor, 1, g, 1.0
            )
        )
    return lambda x, rw, w1, w3, w2: list(MOE_LAYER(x, rw, w1, w3, w2, 2, capacity_factor, 1, g))


def _moe_trace(capacity_factor: float, backward: bool = False, tokens: int = 12, h: int = 8, f: int = 16):
    e = 2 * N
    ins = [
        torch.randn(tokens, h),
        torch.randn(e, h) * h**-0.5,
        torch.randn(2, h, f) * h**-0.5,
        torch.randn(2, h, f) * h**-0.5,
        torch.randn(2, f, h) * f**-0.5,
    ]
    if backward:
        ins.insert(0, torch.randn(tokens, h))
    return make_fx(_moe_op(capacity_factor, backward), tracing_mode="fake")(*ins)


def _moe_chunks(gm) -> list[int]:
    return [chunks_of(n) for n in gm.graph.nodes if n.target in (MOE_LAYER, MOE_LAYER_BACKWARD)]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_dropless_moe_op_exchange_cut_into_token_chunks(backward):
    """Data-dependent split sizes live inside the op: the pass sets its token chunks (no
    topology: graph_trainer's two), and the N-rank reference run of the chunked op, with its
    own routing per rank, equals the whole one."""
    with fake_process_group(N):
        gm = _moe_trace(0.0, backward)
        before = _copy(gm)
        rec = _run(gm)
        assert rec.changed and rec.counts["moe_ops_chunked"] == 1, rec.refusals
        assert _moe_chunks(gm) == [2] and "2 token chunks" in rec.decisions[0]["decision"], rec.decisions
        check_equivalent(before, gm, N)
        # forced to more chunks than some rank has tokens for: empty chunks exchange empty buffers
        gm = _moe_trace(0.0, backward, tokens=3)
        before = _copy(gm)
        _run(gm, workload_chunks=5, max_chunks=8)
        assert _moe_chunks(gm) == [5]
        check_equivalent(before, gm, N)


def test_chunked_moe_op_equals_the_whole_one_on_one_rank():
    """The op's own contract, without a group: forward values and every gradient of a chunked
    call equal the whole call's (float64: only the summation order of weight gradients differs)."""
    torch.manual_seed(0)
    t, h, f, e = 13, 8, 16, 4
    ins = [
        torch.randn(t, h, dtype=torch.float64),
        torch.randn(e, h, dtype=torch.float64),
        *(torch.randn(e, h, f, dtype=torch.float64) for _ in range(2)),
        torch.randn(e, f, h, dtype=torch.float64),
    ]

    def run(chunks):
        params = [p.detach().requires_grad_() for p in ins]
        out, ps, t1, z = MOE_LAYER(*params, 2, 0.0, 1, "", chunks)
        loss = (out * out).sum() + (ps * ps).sum() + z
        return [out, ps, t1, z, *torch.autograd.grad(loss, params)]

    whole = run(1)
    for chunks in (2, 3, 13, 20):
        for a, b in zip(whole, run(chunks), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_capacity_moe_op_and_no_group_refused():
    with fake_process_group(N):
        gm = _moe_trace(1.0)
        rec = _run(gm)
        assert not rec.changed and _moe_chunks(gm) == [1]
        assert any("token chunks would change which rows are dropped" in r for r in rec.refusals), (
            rec.refusals
        )
        x = torch.randn(12, 8)
        gm = make_fx(
            lambda x, rw, w1, w3, w2: list(MOE_LAYER(x, rw, w1, w3, w2, 1, 0.0, 1, "")), tracing_mode="fake"
        )(x, torch.randn(4, 8), *(torch.randn(4, 8, 16) for _ in range(2)), torch.randn(4, 16, 8))
        rec = _run(gm)
        assert not rec.changed and any("no expert-parallel group" in r for r in rec.refusals), rec.refusals


def test_dropless_token_chunks_from_the_cost_model():
    """With a topology: a latency-bound exchange stays whole; a bandwidth-bound forward exchange
    is cut into the count predicted fastest, faster than the whole op and than graph_trainer's
    two chunks (which the slowdown of the experts beside the transfers makes slower than whole). The backward's experts compute three times as long beside the transfers, slowed
    by the contention model (NCCL's channels): no count is predicted faster, it stays whole.
    The simulator, and so the step-time gate, prices the op as the pass does; on gloo
    (``1 + kappa`` beside its threads) a small forward stays whole too."""
    topo = Topology.preset("dgx-h100", num_nodes=1)
    with fake_process_group(N):
        small = _moe_trace(0.0)
        ctx = PassContext(small, commfuse.Config(topology=topo), topology=topo)
        (node,) = [n for n in small.graph.nodes if n.target is MOE_LAYER]
        why = plan_token_chunks(ctx, node)
        assert isinstance(why, str) and "predicted slower than the whole exchange" in why, why
        big = _moe_trace(0.0, tokens=8192, h=2048, f=1024)
        ctx = PassContext(big, commfuse.Config(topology=topo), topology=topo)
        (node,) = [n for n in big.graph.nodes if n.target is MOE_LAYER]
        plan = plan_token_chunks(ctx, node)
        assert not isinstance(plan, str) and plan.chunks > 2 and "predicted fastest" in plan.why, plan
        est = ctx.cost.model
        # graph_trainer's two chunks: the slowdown outweighs the overlap (3787 vs 3652 us whole); 8: 3583 us
        assert moe_cost.time_us(est, node, plan.chunks) < min(moe_cost.time_us(est, node, k) for k in (1, 2))
        before = est.compute_time_us(node)
        _run(big, topology=topo)
        assert est.compute_time_us(node) == moe_cost.time_us(est, node, plan.chunks) < before
        big = _moe_trace(0.0, backward=True, tokens=8192, h=2048, f=1024)
        ctx = PassContext(big, commfuse.Config(topology=topo), topology=topo)
        (node,) = [n for n in big.graph.nodes if n.target is MOE_LAYER_BACKWARD]
        why = plan_token_chunks(ctx, node)
        assert isinstance(why, str) and "predicted slower than the whole exchange" in why, why
        gloo = Topology.preset("cpu-gloo")
        mid = _moe_trace(0.0, tokens=128, h=128, f=128)
        ctx = PassContext(mid, commfuse.Config(topology=gloo), topology=gloo)
        (node,) = [n for n in mid.graph.nodes if n.target is MOE_LAYER]
        why = plan_token_chunks(ctx, node)
        assert isinstance(why, str) and "predicted slower than the whole exchange" in why, why


@pytest.mark.parametrize("mix", ["softmax", "sum"])
def test_chain_that_mixes_tokens_refused(mix):
    """One local expert per rank: every cut of the exchange cuts the token (slot) dim, and a
    softmax / sum over the tokens mixes the chunks (the hidden dim is contracted by the bmm)."""
    mid = (lambda a: torch.softmax(a, dim=1)) if mix == "softmax" else (lambda a: a - a.sum(1, keepdim=True))
    with fake_process_group(N):
        gm = _trace(_exchange(N, mid), N)
        code = gm.code
        rec = _run(gm)
        assert not rec.changed and gm.code == code
        assert any("no cuttable chain to a combine all_to_all" in r for r in rec.refusals), rec.refusals


def test_in_place_op_in_the_chain_refused():
    def mid(a):
        return a.mul_(2.0)

    with fake_process_group(N):
        gm = _trace(_exchange(N, mid), N)
        rec = _run(gm)
        assert not rec.changed
        assert any("no cuttable chain" in r for r in rec.refusals), rec.refusals


# ---------------------------------------------------------------- simulated comparison
@pytest.fixture(scope="module")
def moe_graphs():
    from commfuse.models import moe

    with fake_mesh(8) as mesh:
        # large enough that the exchange is bandwidth-bound on DGX-H100 (at dim 64 it is all
        # launch latency and the pass, rightly, predicts no gain and refuses)
        m = moe.parallelize_moe(moe.build_moe(dim=512, num_experts=16, ffn_dim=2048, seed=0), mesh)
        x = moe.make_inputs(16, 256, 512, rank=0, world_size=8)
        return capture_aot_graphs(m, x.inputs, loss=lambda o: moe.loss_fn(o[0], o[1], x))


def _scored(gm, topo, passes, **cfg):
    gm = _copy(gm)
    # every rank routes the same tokens: the expert compute is priced (by default it is not,
    # tests/test_same_decision.py)
    config = commfuse.Config(passes=passes, topology=topo, strict=True, uniform_batches=True, **cfg)
    commfuse.optimize(gm, config)
    return score_graph(PassContext(gm, config, topology=topo))


@pytest.mark.slow(
    reason="runs a dim-512 MoE block's forward and backward under AOTAutograd and simulates 6 graphs"
)
def test_partition_predicted_no_slower_than_unpartitioned_and_two_chunk_baseline(moe_graphs):
    """DGX-H100, 8 EP ranks. Forward: the pass's cut exposes less communication than the
    unpartitioned graph and graph_trainer's two chunks, and the step is predicted faster.
    Backward: cutting the tokens makes the expert weight gradients partial sums added per
    chunk, which costs more than the exchange it hides; the pass prices that and keeps the
    exchange whole, while two chunks are predicted slower."""
    topo = Topology.preset("dgx-h100", num_nodes=1)
    with fake_mesh(8):
        got = {}
        for kind in ("forward", "backward"):
            gm = getattr(moe_graphs, kind)
            plain = _scored(gm, topo, ["sink_waits"])
            # graph_trainer's split (ep_chunk_pass + ep_overlap_pass): two even chunks, chunk 0's
            # exchange under chunk 1's compute -- this pass with the count forced to 2
            two = _scored(gm, topo, [PASS, "sink_waits"], workload_chunks=2)
            ours = _scored(gm, topo, [PASS, "sink_waits"])
            got[kind] = (plain, two, ours)
            assert ours.makespan_us <= min(plain.makespan_us, two.makespan_us) + 1e-6, (
                kind,
                plain,
                two,
                ours,
            )
    plain, two, ours = got["forward"]
    assert ours.exposed_comm_us < two.exposed_comm_us < plain.exposed_comm_us
    assert ours.makespan_us < plain.makespan_us
    plain, two, ours = got["backward"]
    assert two.makespan_us > plain.makespan_us and ours.makespan_us == plain.makespan_us


# ---------------------------------------------------------------- 4 gloo ranks
@pytest.mark.slow(reason="trains the MoE block eagerly and compiled on 4 gloo ranks")
@pytest.mark.multirank
def test_moe_training_matches_eager_on_4_ranks(rank_pool_4):
    import _jobs_expert_exchange_partition as jobs

    results = rank_pool_4.run(jobs.moe_matches_eager, timeout=300)
    got = results[0]
    assert all(r == got for r in results)  # every rank decided the same
    for graph in ("forward", "backward"):
        assert got[graph]["changed"] and got[graph]["counts"]["exchanges_partitioned"] == 1, got[graph]
        assert got[graph]["kinds"]["all_to_all"] == 4


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["tp_ep", "sp_ep_sp"])
def test_dropless_moe_under_tensor_parallelism_trains_like_eager(rank_pool_2, layout):
    """The dropless MoE op inside a tensor-parallel (or sequence-parallel) block, experts over
    the same 2 gloo ranks (graph_trainer's EP chunking refuses TP > 1): forward and backward
    exchanges cut into token chunks, losses, gradients and parameters equal to eager."""
    import _jobs_expert_exchange_partition as jobs

    results = rank_pool_2.run(jobs.moe_tp_matches_eager, layout, timeout=300)
    got = results[0]
    assert all(r == got for r in results)  # every rank decided the same
    for graph in ("forward", "backward"):
        assert got[graph]["counts"].get("moe_ops_chunked") == 1, got[graph]
        assert "2 token chunks" in got[graph]["decisions"][0], got[graph]


def test_token_chunks_are_not_priced_from_sizes_ranks_may_not_share():
    """The count is priced from this rank's tokens, and ranks that chose different counts would
    mismatch the op's count exchange: symbolic token counts (rank-local hints) are refused with
    the reason and the op is priced as an unknown op without crashing; a count never exceeds
    the tokens, and an empty chunk exchange is priced at its latency, not free."""
    topo = Topology.preset("dgx-h100", num_nodes=1)
    g = None
    with fake_process_group(N):
        g = dist.group.WORLD.group_name
        ins = [
            torch.randn(12, 8),
            torch.randn(2 * N, 8),
            *(torch.randn(2, 8, 16) for _ in range(2)),
            torch.randn(2, 16, 8),
        ]
        gm = make_fx(
            lambda x, rw, w1, w3, w2: list(MOE_LAYER(x, rw, w1, w3, w2, 2, 0.0, 1, g)),
            tracing_mode="symbolic",
        )(*ins)
        ctx = PassContext(gm, commfuse.Config(topology=topo), topology=topo)
        (node,) = [n for n in gm.graph.nodes if n.target is MOE_LAYER]
        assert ctx.cost.model.compute_time_us(node) > 0
        assert isinstance(plan_token_chunks(ctx, node), str)

        def uneven_then_moe(x, rw, w1, w3, w2):  # tokens arrive with per-rank split sizes
            y = funcol.all_to_all_single(x, [2, 6, 4, 4], [2, 6, 4, 4], dist.group.WORLD)
            return list(MOE_LAYER(y, rw, w1, w3, w2, 2, 0.0, 1, g))

        gm = make_fx(uneven_then_moe, tracing_mode="fake")(torch.randn(16, 8), *ins[1:])
        ctx = PassContext(gm, commfuse.Config(topology=topo), topology=topo)
        (node,) = [n for n in gm.graph.nodes if n.target is MOE_LAYER]
        why = plan_token_chunks(ctx, node)
        assert isinstance(why, str) and "sizes that may differ between ranks" in why, why
        one = _moe_trace(0.0, tokens=1)
        ctx = PassContext(one, commfuse.Config(topology=topo), topology=topo)
        (node,) = [n for n in one.graph.nodes if n.target is MOE_LAYER]
        assert not isinstance(plan_token_chunks(ctx, node), TokenChunkPlan)
        est = ctx.cost.model
        assert moe_cost.time_us(est, node, 3) > moe_cost.time_us(est, node, 1)


# ---------------------------------------------------------------- uneven chunks (Algorithm 1's granularity)
def _exchange_on(n: int, experts: int, C: int, D: int = D, H: int = H):
    """``_exchange`` on ``n`` ranks, traced."""
    local = experts // n

    def f(x, w1, w2):
        g = dist.group.WORLD
        recv = funcol.all_to_all_single(x.reshape(experts * C, D), None, None, g)
        h = recv.view(n, local, C, D).transpose(0, 1).reshape(local, n * C, D)
        y = torch.bmm(F.gelu(torch.bmm(h, w1)), w2)
        back = y.view(local, n, C, D).transpose(0, 1).reshape(experts * C, D)
        return funcol.all_to_all_single(back, None, None, g)

    return make_fx(f, tracing_mode="fake")(
        torch.randn(experts, C, D), torch.randn(local, D, H), torch.randn(local, H, D)
    )


def _chunk_rows(gm) -> list[int]:
    return [c.input_shapes[0][0] for c in _a2a_starts(gm)]


def _uneven_priced_fastest(monkeypatch) -> None:
    """Make the pipeline model price Algorithm 1's uneven cut below any even one (1 us), so the
    pass takes it: what a cost model that saw the gain would decide."""
    from commfuse.transforms import expert_exchange_partition as xp

    monkeypatch.setattr(xp, "_uneven_span", lambda *a, **k: 1.0)


@pytest.fixture
def two_nodes():
    """A session with the 2 nodes x 2 (4 ranks) or 2 x 4 (8 ranks) sub-groups set up, as
    ``commfuse.setup(topology=...)`` on every rank; yields (world size -> (topology, session))."""
    from commfuse.session import reset
    from commfuse.transforms.group_partition import GroupPartition
    from _jobs_group_partition import TOPO_2x2

    reset()
    topos = {4: TOPO_2x2, 8: GroupPartition.fuzz.topology}

    def make(n: int):
        topo = topos[n]
        return topo, commfuse.setup(topology=topo)

    try:
        yield make
    finally:
        reset()


def test_chunk_pipeline_of_uneven_chunks():
    from commfuse.costmodel.pipeline import chunk_pipeline_us, pipeline_us

    for k in (1, 2, 3, 5):
        assert chunk_pipeline_us([4.0] * k, [9.0 / k] * k, [2.0] * k, 1.5) == pipeline_us(
            4.0, 9.0, 2.0, k, 1.5
        )
    # 2:1:1: dispatches arrive at 2, 3, 4; compute 4, 2, 2 ends at 6, 8, 10; combines 2, 1, 1
    # end at 8, 9, 11
    assert chunk_pipeline_us([2.0, 1.0, 1.0], [4.0, 2.0, 2.0], [2.0, 1.0, 1.0]) == 11.0


def test_algorithm1_uneven_sizes_cut_into_the_chunk_exchanges(two_nodes, monkeypatch):
    """4 ranks as 2 nodes x 2, slow inter-node links, little expert compute: Algorithm 1 on the
    two-level exchange picks its third branch (intra-node step first, 2:1:1). The pipeline
    model prices the uneven cut above the best even one, so the pass keeps the even cut and
    says why; priced below it, the pass cuts 2:1:1: the chunk all_to_alls carry 32 / 16 / 16 of
    the 64 capacity rows (every expert's 8 slots cut 4 / 2 / 2), each still an equal split on
    the world, and the values equal the unpartitioned program's on every rank."""
    from commfuse.transforms.expert_exchange_partition import two_level_granularity

    with fake_process_group(N):
        topo, s = two_nodes(N)
        gm = _exchange_on(N, 8, C=8)
        # every rank routes the same number of tokens: the expert compute is priced
        ctx = PassContext(gm, commfuse.Config(topology=topo, uniform_batches=True), topology=topo, session=s)
        c = _a2a_starts(gm)[0]
        _, chain, c2, _ = plan_exchange_partition(ctx, c, chunks=2)
        granularity, why = two_level_granularity(ctx, c, c2, chain)
        assert granularity == (0.5, 0.25, 0.25) and "intra-node step first" in why, why
        # the real pipeline model on this latency-bound exchange: no cut pays, the uneven one
        # (a third chunk's launch and latency) least of all
        why = plan_exchange_partition(ctx, c)
        assert isinstance(why, str) and "predicted slower than the whole exchange" in why, why
        assert "uneven 2:1:1 not taken" in why and "slower than 2 even chunks'" in why, why
        # a bandwidth-bound one: two even chunks pay, the uneven cut is predicted slower than them
        big = _exchange_on(N, 8, C=32, D=256, H=1024)
        ctx = PassContext(big, commfuse.Config(topology=topo, uniform_batches=True), topology=topo, session=s)
        plan = plan_exchange_partition(ctx, _a2a_starts(big)[0])[0]
        assert (plan.units, plan.granularity, plan.chunks) == (None, "even", 2), plan
        assert "uneven 2:1:1 not taken" in plan.why and "slower than 2 even chunks'" in plan.why, plan.why
        # without the sub-groups there are no level times: the same even plan, no uneven note
        bare = PassContext(big, commfuse.Config(topology=topo, uniform_batches=True), topology=topo)
        flat = plan_exchange_partition(bare, _a2a_starts(big)[0])[0]
        assert (flat.chunks, flat.sizes) == (plan.chunks, plan.sizes) and "two-level" not in flat.why

        before = _copy(gm)
        _uneven_priced_fastest(monkeypatch)
        rec = _run(gm, topology=topo)
        (d,) = rec.decisions
        assert (d["chunks"], d["granularity"], d["sizes"], d["blocks"]) == (3, "2:1:1", [32, 16, 16], 8), d
        assert "(uneven, 2:1:1)" in d["decision"] and "uneven 2:1:1 taken" in d["decision"], d
        starts = _a2a_starts(gm)
        assert _chunk_rows(gm) == [32, 16, 16, 32, 16, 16]
        assert all(c.extra.get("equal_splits") and c.group.name == "0" for c in starts)
        # dispatches first, then per chunk: wait, expert compute, combine issued
        (
            FileCheck()
            .check(A2A)
            .check(A2A)
            .check(A2A)
            .check(WAIT)
            .check("aten.bmm")
            .check(A2A)
            .check(WAIT)
            .check("aten.bmm")
            .check(A2A)
            .check(WAIT)
            .check("aten.bmm")
            .check(A2A)
            .run(gm.code)
        )
        check_equivalent(before, gm, N, groups={"0": "world", **s.reference_groups()})


def test_uneven_granularity_rounded_or_left_even_with_the_reason(two_nodes, monkeypatch):
    """8 ranks as 2 nodes x 4: Algorithm 1 picks 4:1:3 (8 units of every expert's slots). Four
    slots per expert take no 8 units: rounded to fewer, the decision says so and the graph
    carries the rounded sizes; two slots per expert take no uneven rounding: the even cut,
    with the reason."""
    _uneven_priced_fastest(monkeypatch)
    with fake_process_group(8):
        topo, s = two_nodes(8)
        gm = _exchange_on(8, 8, C=4)
        before = _copy(gm)
        rec = _run(gm, topology=topo)
        (d,) = rec.decisions
        assert "granularity 0.5, 0.125, 0.375" in d["decision"], d
        assert "granularity 4:1:3 rounded to" in d["decision"] and "(8 units: " in d["decision"], d
        units = [int(u) for u in d["granularity"].split(":")]
        assert len(units) == 3 and len(set(units)) > 1 and sum(units) < 8, d
        assert d["sizes"] == [32 // sum(units) * u for u in units] and _chunk_rows(gm) == d["sizes"] * 2, d
        check_equivalent(before, gm, 8, groups={"0": "world", **s.reference_groups()})

        gm = _exchange_on(8, 8, C=2)
        ctx = PassContext(gm, commfuse.Config(topology=topo), topology=topo, session=s)
        got = plan_exchange_partition(ctx, _a2a_starts(gm)[0])
        why = got if isinstance(got, str) else got[0].why
        assert "uneven granularity not applied (granularity 4:1:3" in why, why
        assert isinstance(got, str) or got[0].units is None


@pytest.mark.slow(reason="trains the MoE block eagerly and compiled on 4 gloo ranks")
@pytest.mark.multirank
def test_uneven_exchange_trains_like_eager_on_4_ranks(rank_pool_4):
    """4 gloo ranks as 2 nodes x 2, the uneven cut forced: Algorithm 1 picks 2:1:1 for
    the forward and the backward exchange (20 capacity slots per expert cut 10 / 5 / 5), the
    chunk all_to_alls run on real process groups, and losses, gradients and parameters equal
    eager's on every rank (asserted in the job)."""
    import _jobs_expert_exchange_partition as jobs

    # 64 tokens per rank: 20 capacity slots per expert (top-2 of 8, factor 1.25), which the 4
    # units of 2:1:1 divide; the forced pass takes Algorithm 1's cut (the pass itself keeps the
    # even one on this pipeline model)
    results = rank_pool_4.run(
        jobs.moe_matches_eager, ("expert_exchange_partition_forced",), seq=32, two_nodes=True, timeout=300
    )
    got = results[0]
    assert all(r == got for r in results)  # every rank decided the same
    for graph in ("forward", "backward"):  # the backward's weight gradients: uneven partial sums
        (d,) = got[graph]["decisions"]
        assert "3 chunks of sizes [80, 40, 40] (uneven, 2:1:1)" in d, (graph, d)
        assert got[graph]["kinds"]["all_to_all"] == 6, got[graph]


def test_forced_pass_cuts_wherever_algorithm1_is_uneven(two_nodes):
    """``expert_exchange_partition_forced`` (what the fuzzer checks the uneven rewrite with)
    takes Algorithm 1's 2:1:1 where the pass itself keeps the even cut, without any pricing
    patched: the chunk exchanges carry 32 / 16 / 16 rows and the values are unchanged."""
    with fake_process_group(N):
        topo, _ = two_nodes(N)
        gm = _exchange_on(N, 8, C=8)
        before = _copy(gm)
        commfuse.optimize(
            gm, commfuse.Config(passes=["expert_exchange_partition_forced"], topology=topo, strict=True)
        )
        rec = commfuse.last_report(gm).passes[-1]
        assert rec.counts["exchanges_cut_unevenly"] == 1, rec.refusals
        assert rec.decisions[0]["sizes"] == [32, 16, 16]
        assert _chunk_rows(gm) == [32, 16, 16] * 2
        check_equivalent(before, gm, N)
