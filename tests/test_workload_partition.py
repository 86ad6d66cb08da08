"""Centauri workload partition: a collective chunked together with its compute chain.

Graph-level tests trace under the fake process group, check the chunked code with
FileCheck and every rewrite on the N-rank reference interpreter (`check_equivalent`);
refusals leave the graph unchanged and say why. The 4-rank gloo runs train the
SimpleFSDP (weight all_gather, gradient reduce_scatter / DP all_reduce) and TP
(all_gather -> matmul + GeLU) models compiled with the pass against eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

import commfuse
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.passmgr.context import PassContext
from commfuse.transforms.workload_partition import (
    WorkloadPlan,
    apply_workload_partition,
    plan_workload_partition,
)
from commfuse.testing.equivalence import check_equivalent
from commfuse.testing.fake_pg import fake_mesh, fake_process_group
from commfuse.testing.graphs import _copy, capture_aot_graphs

PASS = "workload_partition"
AG = "all_gather_into_tensor"
WAIT = "wait_tensor"


def _run(gm, **cfg):
    commfuse.optimize(gm, commfuse.Config(passes=[PASS], strict=True, **cfg))
    return next(p for p in commfuse.last_report(gm).passes if p.name == PASS)


def _plan(gm, chunks=None, **cfg) -> WorkloadPlan | str:
    ctx = PassContext(gm, commfuse.Config(**cfg))
    return plan_workload_partition(ctx, ctx.ir.collectives[0], chunks=chunks)


def _kinds(gm) -> list[str]:
    return [c.kind.value for c in CollectiveIR(gm).collectives]


# ---------------------------------------------------------------- the three target patterns
def _fsdp_linear(w_shard, x):
    """SimpleFSDP: the weight's dim-0 shard all_gathered right before its matmul."""
    w = funcol.all_gather_tensor(w_shard, 0, dist.group.WORLD)
    return torch.nn.functional.gelu(x @ w.t())


def test_fsdp_weight_gather_chunked_with_its_matmul():
    with fake_process_group(4):
        gm = make_fx(_fsdp_linear, tracing_mode="fake")(torch.randn(4, 16), torch.randn(8, 16))
        before = _copy(gm)
        plan = _plan(gm)
        # chunking the gather dim keeps mm + gelu in the chain (the weight's in-dim would be a
        # contraction, ending the chain at the mm): rank-interleaved output columns
        assert isinstance(plan, WorkloadPlan), plan
        assert (plan.direction, plan.dim, plan.interleaved, plan.reduction) == ("consumer", 0, True, False)
        assert [n.split("_")[0] for n in plan.chain] == ["t", "mm", "gelu"]
        rec = _run(gm)
        assert rec.counts["collectives_partitioned"] == 1 and rec.counts["chunk_collectives"] == 2
        # both chunks issued first, then chunk 0's wait -> mm -> gelu before chunk 1's wait
        (
            FileCheck()
            .check(AG)
            .check(AG)
            .check(WAIT)
            .check("aten.mm")
            .check("aten.gelu")
            .check(WAIT)
            .check("aten.mm")
            .check("aten.gelu")
            .check("aten.stack")
            .run(gm.code)
        )
        assert _kinds(gm) == ["all_gather", "all_gather"]
        check_equivalent(before, gm, 4)


def test_identity_slice_after_a_parameter_gather_stays_in_the_chain():
    """DTensor slices a gathered parameter to its logical size (at 16 ranks even when nothing
    was padded): that slice keeps the chunked dim; a real slice of dim 0 leaves only the
    other dim (here the matmul's contraction dim: partial sums)."""

    def f(w_shard, x, end):
        w = torch.ops.aten.slice.Tensor(funcol.all_gather_tensor(w_shard, 0, dist.group.WORLD), 0, 0, end)
        return x @ w.t()

    for end, dim in ((16, 0), (12, 1)):
        with fake_process_group(4):
            gm = make_fx(lambda w, x: f(w, x, end), tracing_mode="fake")(torch.randn(4, 8), torch.randn(6, 8))  # noqa: B023 - traced now
            before = _copy(gm)
            plan = _plan(gm)
            assert plan.chain[0].startswith("slice") and "mm" in plan.chain and plan.dim == dim, plan
            assert plan.reduction == (dim == 1)
            _run(gm)
            check_equivalent(before, gm, 4)


def _tp_gather_mlp(x, w):
    """TP: the sequence shard gathered (along dim 1, DTensor's shuffle) before matmul + GeLU."""
    full = funcol.all_gather_tensor(x, 1, dist.group.WORLD)
    return torch.nn.functional.gelu(full @ w)


@pytest.mark.parametrize("chunks", [2, 4])
def test_tp_gather_feeding_matmul_gelu(chunks):
    with fake_process_group(4):
        gm = make_fx(_tp_gather_mlp, tracing_mode="fake")(torch.randn(2, 8, 16), torch.randn(16, 12))
        before = _copy(gm)
        rec = _run(gm, workload_chunks=chunks)
        assert rec.changed and rec.counts["chunk_collectives"] == chunks, rec
        colls = CollectiveIR(gm).collectives
        assert [c.kind.value for c in colls] == ["all_gather"] * chunks
        code = gm.code
        assert code.count("aten.gelu") == chunks and code.count("aten.mm") + code.count("aten.bmm") == chunks
        # all starts precede the first wait; each chunk's matmul sits between its wait and the next
        assert code.rindex(f"{AG}.default(") < code.index(f"{WAIT}.default(")
        check_equivalent(before, gm, 4)


def _dp_grad(g, x):
    """DP: a weight gradient (g^T x) all-reduced; the producer chain is the matmul."""
    return funcol.all_reduce(g.t() @ x, "avg", dist.group.WORLD)


def test_dp_gradient_all_reduce_chunked_with_its_producer():
    with fake_process_group(4):
        gm = make_fx(_dp_grad, tracing_mode="fake")(torch.randn(8, 12), torch.randn(8, 16))
        before = _copy(gm)
        plan = _plan(gm)
        assert isinstance(plan, WorkloadPlan) and plan.direction == "producer" and not plan.reduction, plan
        rec = _run(gm)
        assert rec.counts["producer_chains"] == 1
        # chunk 0 computed and issued before chunk 1 is computed; waits where the all_reduce was waited
        (
            FileCheck()
            .check("aten.mm")
            .check("all_reduce")
            .check("aten.mm")
            .check("all_reduce")
            .check(WAIT)
            .check(WAIT)
            .check("aten.cat")
            .run(gm.code)
        )
        check_equivalent(before, gm, 4)


def test_reduce_scatter_producer_along_its_scatter_dim_is_rank_interleaved():
    """Only the scatter dim divides: chunk i must hold, for every rank, that rank's i-th piece."""

    def f(x, w):
        return funcol.reduce_scatter_tensor(torch.relu(x @ w), "sum", 0, dist.group.WORLD)

    with fake_process_group(4):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(16, 8), torch.randn(8, 3))
        before = _copy(gm)
        plan = _plan(gm)
        assert isinstance(plan, WorkloadPlan) and (plan.direction, plan.dim, plan.interleaved) == (
            "producer",
            0,
            True,
        )
        _run(gm)
        assert _kinds(gm) == ["reduce_scatter", "reduce_scatter"]
        check_equivalent(before, gm, 4)


# ---------------------------------------------------------------- partial sums (CD splits)
def test_contraction_split_adds_the_chunk_results():
    """The gathered dim is the matmul's contraction dim (the other dim does not divide):
    each chunk gives a partial product, added after the chain."""

    def f(w_shard, x):
        return x @ funcol.all_gather_tensor(w_shard, 0, dist.group.WORLD)

    with fake_process_group(4):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 3), torch.randn(5, 8))
        before = _copy(gm)
        plan = _plan(gm)
        assert isinstance(plan, WorkloadPlan) and plan.reduction and plan.interleaved, plan
        _run(gm)
        FileCheck().check(WAIT).check("aten.mm").check(WAIT).check("aten.mm").check("aten.add").run(gm.code)
        check_equivalent(before, gm, 4)


def test_addmm_contraction_split_adds_the_bias_once():
    def f(w_shard, x, b):
        return torch.addmm(b, x, funcol.all_gather_tensor(w_shard, 0, dist.group.WORLD))

    with fake_process_group(2):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 3), torch.randn(5, 8), torch.randn(3))
        before = _copy(gm)
        _run(gm)
        assert gm.code.count("aten.addmm") == 1 and gm.code.count("aten.mm") == 1, gm.code
        check_equivalent(before, gm, 2)


def test_mean_over_the_chunked_dim_divides_by_the_chunk_count():
    def f(x):
        return torch.relu(funcol.all_reduce(x, "sum", dist.group.WORLD)).mean(0)

    with fake_process_group(4):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(8, 3))
        before = _copy(gm)
        plan = _plan(gm)
        assert isinstance(plan, WorkloadPlan) and plan.reduction and plan.dim == 0
        _run(gm)
        FileCheck().check("aten.add").check("aten.div").run(gm.code)
        check_equivalent(before, gm, 4)


def test_reassembled_value_keeps_its_memory_layout():
    """sin of a transposed value is laid out transposed; the view after the chain relies on
    it (fuzzer seed 20240, program 176): the chunks are concatenated in that memory order."""

    def f(x):
        z = torch.sin(funcol.all_reduce(x, "sum", dist.group.WORLD).transpose(0, 1))
        return z.transpose(0, 1).view(-1)

    with fake_process_group(2):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 6, 8))
        before = _copy(gm)
        _run(gm)
        FileCheck().check("aten.permute").check("aten.cat").check("aten.permute").check("aten.view").run(
            gm.code
        )
        assert "aten.clone" not in gm.code  # concatenated in memory order: no extra copy
        check_equivalent(before, gm, 2)


# ---------------------------------------------------------------- real partitioned graphs
def test_simple_fsdp_forward_and_backward_graphs():
    import torch.nn as nn

    from commfuse.models import simple_fsdp

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(16, 32, bias=False)
            self.down = nn.Linear(32, 16, bias=False)

        def forward(self, x):
            return self.down(torch.nn.functional.gelu(self.up(x)))

    with fake_mesh(4, (4,), ("dp",)) as mesh:
        graphs = capture_aot_graphs(
            simple_fsdp.data_parallel(MLP(), mesh, "fully_shard"), torch.randn(2, 8, 16)
        )
        for kind, direction in (("forward", "consumer_chains"), ("backward", "producer_chains")):
            gm = graphs[kind]
            before = _copy(gm)
            rec = _run(gm)
            assert rec.counts[direction] == 2 and not rec.refusals, (kind, rec)
            check_equivalent(before, gm, 4)


# ---------------------------------------------------------------- refusals
def _softmax_after_all_reduce(x):
    return torch.softmax(funcol.all_reduce(x, "sum", dist.group.WORLD), dim=1)


def _relu_after_gather(x):
    return torch.relu(funcol.all_gather_tensor(x, 0, dist.group.WORLD))


def _gather_only(x):
    return funcol.all_gather_tensor(x, 0, dist.group.WORLD).t()  # a view: nothing to overlap


def _all_to_all(x):
    return torch.relu(funcol.all_to_all_single(x, None, None, dist.group.WORLD))


@pytest.mark.parametrize(
    "fn,shape,reason",
    [
        # the only divisible dim (8) is the one softmax normalises: ND
        (_softmax_after_all_reduce, (3, 8), "non-splittable"),
        (_relu_after_gather, (3, 5), "no dim of [12, 5] is divisible by 2 chunks"),
        (_gather_only, (4, 4), "no compute op"),
        (_all_to_all, (8, 4), "all_to_all: not implemented"),
    ],
)
def test_refusals_leave_the_graph_unchanged(fn, shape, reason):
    with fake_process_group(4):
        gm = make_fx(fn, tracing_mode="fake")(torch.randn(*shape))
        code = gm.code
        rec = _run(gm)
        assert not rec.changed and gm.code == code
        assert len(rec.refusals) == 1 and reason in rec.refusals[0], rec.refusals


def test_chain_stops_before_an_op_needing_a_later_collective():
    """Chunk i's compute must not wait on another collective: the add that needs the second
    gather stays outside the first gather's chain (it reads the reassembled value)."""

    def f(x, y, w):
        g = dist.group.WORLD
        a = torch.relu(funcol.all_gather_tensor(x, 0, g) @ w)
        return a + funcol.all_gather_tensor(y, 0, g)

    with fake_process_group(2):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 8), torch.randn(4, 6), torch.randn(8, 6))
        before = _copy(gm)
        plan = _plan(gm)
        assert isinstance(plan, WorkloadPlan) and not any(n.startswith("add") for n in plan.chain), plan
        _run(gm)
        check_equivalent(before, gm, 2)


def test_producer_chain_never_moves_past_a_write_to_its_input():
    """The matmul's input is updated in place after it (fuzzer seed 2, program 279): the
    chunked matmuls would run at the collective, after the update."""

    def f(a, w):
        y = a @ w
        a.add_(a)
        return funcol.all_reduce(y, "sum", dist.group.WORLD)

    with fake_process_group(2):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 6))
        code = gm.code
        rec = _run(gm)
        assert not rec.changed and gm.code == code
        assert "written in place" in rec.refusals[0], rec.refusals


# ---------------------------------------------------------------- the API the partition search uses
def test_plan_is_pure_and_apply_returns_the_chunk_starts():
    with fake_process_group(4):
        gm = make_fx(_fsdp_linear, tracing_mode="fake")(torch.randn(4, 16), torch.randn(8, 16))
        code = gm.code
        ctx = PassContext(gm, commfuse.Config(max_chunks=4))
        c = ctx.ir.collectives[0]
        assert plan_workload_partition(ctx, c, chunks=1) == "one chunk: nothing to partition"
        assert plan_workload_partition(ctx, c, chunks=8).chunks == 4  # clipped to max_chunks
        plan = plan_workload_partition(ctx, c, chunks=4)
        assert gm.code == code  # planning never mutates
        with pytest.raises(ValueError):
            apply_workload_partition(ctx, c, WorkloadPlan(**{**plan.__dict__, "chain": ("nope",)}))
        starts = apply_workload_partition(ctx, c, plan)
        gm.graph.lint()
        gm.recompile()
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        colls = CollectiveIR(gm).collectives
        assert starts == sorted(starts, key=order.__getitem__) == [x.start for x in colls]
        assert len(starts) == 4


def test_chain_choice_follows_the_centauri_rule(monkeypatch):
    """Prefer chains whose compute covers the collective, the longest of them; else the one
    with the most compute. Dim 0's chain: softmax(dim=1) + add; dim 1's: softmax(dim=0) + mul + sub."""

    def f(x):
        y = funcol.all_reduce(x, "sum", dist.group.WORLD)
        return torch.softmax(y, dim=1) + 1, torch.softmax(y, dim=0) * 3 - 1

    class Est:
        def __init__(self, comm_us):
            self.comm_us = comm_us

        def compute_time_us(self, node):
            if "softmax" in str(node.target):
                return 60.0 if node.args[1] == 1 else 20.0
            return 1.0

        def collective(self, c):
            from commfuse.costmodel.estimator import CollectiveEstimate

            return CollectiveEstimate(self.comm_us, 0, "test")

    from commfuse.passmgr.cost import CostPolicy

    with fake_process_group(4):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(8, 8))
        for comm_us, dim in ((10.0, 1), (50.0, 0), (1000.0, 0)):
            est = Est(comm_us)
            monkeypatch.setattr(CostPolicy, "model", property(lambda self, e=est: e))
            plan = _plan(gm)
            assert plan.dim == dim and plan.comm_us == comm_us, (comm_us, plan)
            assert plan.compute_us == (61.0 if dim == 0 else 22.0)


def test_cost_fields_with_a_topology():
    with fake_process_group(4):
        gm = make_fx(_fsdp_linear, tracing_mode="fake")(torch.randn(4, 16), torch.randn(8, 16))
        # the same batch on every rank: its compute is priced (by default it is not,
        # tests/test_same_decision.py)
        ctx = PassContext(
            gm,
            commfuse.Config(uniform_batches=True),
            topology=commfuse.Topology.preset("cpu-gloo", num_nodes=2),
        )
        plan = plan_workload_partition(ctx, ctx.ir.collectives[0])
        assert plan.compute_us > 0 and plan.comm_us > 0 and "us" in plan.describe()


# ---------------------------------------------------------------- uneven chunks (Algorithm 1's granularity)
def _shapes(gm) -> list[tuple[str, tuple, tuple]]:
    """(kind, input shape, output shape) of every collective, in graph order."""
    return [
        (c.kind.value, tuple(c.input_shapes[0]), tuple(c.output_shapes[0]))
        for c in CollectiveIR(gm).collectives
    ]


def _mean_after_all_reduce(x):
    return torch.relu(funcol.all_reduce(x, "sum", dist.group.WORLD)).mean(0)


def _rs_producer(x, w):
    return funcol.reduce_scatter_tensor(torch.relu(x @ w), "sum", 0, dist.group.WORLD)


@pytest.mark.parametrize(
    "fn,shapes,chunks",
    [
        # all_gather along its gather dim: each rank's shard cut 1:3, the output rank-interleaved
        (
            _fsdp_linear,
            [(8, 16), (8, 16)],
            [("all_gather", (2, 16), (8, 16)), ("all_gather", (6, 16), (24, 16))],
        ),
        # DTensor's dim-1 gather (shuffle per chunk)
        (
            _tp_gather_mlp,
            [(2, 8, 16), (16, 12)],
            [("all_gather", (2, 2, 16), (8, 2, 16)), ("all_gather", (2, 6, 16), (8, 6, 16))],
        ),
        # reduce_scatter along its scatter dim: every chunk keeps a whole piece per rank (divisible by 4)
        (
            _rs_producer,
            [(32, 8), (8, 3)],
            [("reduce_scatter", (8, 3), (2, 3)), ("reduce_scatter", (24, 3), (6, 3))],
        ),
        # all_reduce with a mean over the cut dim: chunk means weighted by their share
        (
            _mean_after_all_reduce,
            [(16, 3)],
            [("all_reduce", (4, 3), (4, 3)), ("all_reduce", (12, 3), (12, 3))],
        ),
    ],
)
def test_uneven_granularity_is_carried_by_the_chunk_collectives(fn, shapes, chunks):
    with fake_process_group(4):
        gm = make_fx(fn, tracing_mode="fake")(*[torch.randn(s) for s in shapes])
        before = _copy(gm)
        ctx = PassContext(gm, commfuse.Config())
        c = ctx.ir.collectives[0]
        plan = plan_workload_partition(ctx, c, granularity=(0.25, 0.75))
        assert (
            isinstance(plan, WorkloadPlan) and plan.sizes == (1, 3) and plan.chunks == 2 and not plan.note
        ), plan
        assert "uneven, 1:3" in plan.describe()
        apply_workload_partition(ctx, c, plan)
        gm.graph.lint()
        gm.recompile()
        assert _shapes(gm) == chunks
        check_equivalent(before, gm, 4)


def test_uneven_granularity_rounded_or_even_with_the_reason():
    def f(x):
        return torch.relu(funcol.all_reduce(x, "sum", dist.group.WORLD))

    with fake_process_group(2):
        # 1:3 needs 4 units; 6 rows take 3: rounded to 1:2
        gm = make_fx(f, tracing_mode="fake")(torch.randn(6, 5))
        ctx = PassContext(gm, commfuse.Config())
        plan = plan_workload_partition(ctx, ctx.ir.collectives[0], granularity=(0.25, 0.75))
        assert plan.sizes == (1, 2) and plan.extents == (2, 4), plan
        assert "granularity 1:3 rounded to 1:2 (4 units: no dim of [6, 5] is divisible by 4" in plan.note
        # no dim divides into any uneven units: even chunks, and why
        gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 5))
        ctx = PassContext(gm, commfuse.Config())
        plan = plan_workload_partition(ctx, ctx.ir.collectives[0], granularity=(0.25, 0.75))
        assert plan.sizes is None and plan.extents == (1, 1), plan
        assert "granularity 1:3 not applied" in plan.note and "2 even chunks" in plan.note
        # equal parts are the even cut
        plan = plan_workload_partition(ctx, ctx.ir.collectives[0], granularity=(0.5, 0.5))
        assert plan.sizes is None and not plan.note


def test_algorithm1_picks_uneven_sizes_for_a_group_partitioned_collective_and_the_graph_carries_them():
    """4 ranks as 2 nodes x 2 with slow inter-node links and little compute: Algorithm 1's
    third branch (intra-node step first, granularity intra/w, (inter-1)/w, rest = 2:1:1). The
    partition search offers that leaf; applied, the chunk collectives carry the sizes, each
    chunk then group-partitioned, and the values equal the unpartitioned program's."""
    from _jobs_group_partition import TOPO_2x2

    from commfuse.session import reset
    from commfuse.transforms.partition_search import apply_scheme, group_granularity, leaves_for, work_plan

    reset()
    try:
        with fake_process_group(4):
            s = commfuse.setup(topology=TOPO_2x2)
            gm = make_fx(_fsdp_linear, tracing_mode="fake")(torch.randn(16, 64), torch.randn(32, 64))
            before = _copy(gm)
            ctx = PassContext(gm, commfuse.Config(), topology=TOPO_2x2, session=s)
            c = ctx.ir.collectives[0]
            scheme, why = group_granularity(ctx, c)
            assert (scheme.group, scheme.chunks, scheme.sizes) == ("intra_first", 3, (2, 1, 1)), why
            assert "intra-node step first" in why and "granularity 0.5, 0.25, 0.25" in why
            assert scheme in leaves_for(ctx, c)
            assert scheme.describe() == "group:intra_first+chunks:3(2:1:1)"
            assert work_plan(ctx, c, scheme).extents == (32, 16, 16)  # rows of the gathered weight
            apply_scheme(ctx, c, scheme)
            gm.recompile()
            # per chunk: the intra-node gather, then the inter-node one, of 8 / 4 / 4 of the 16 shard rows
            assert [(k, i[0], o[0]) for k, i, o in _shapes(gm)] == [
                ("all_gather", 8, 16),
                ("all_gather", 16, 32),
                ("all_gather", 4, 8),
                ("all_gather", 8, 16),
                ("all_gather", 4, 8),
                ("all_gather", 8, 16),
            ]
            check_equivalent(before, gm, 4, groups={"0": "world", **s.reference_groups()})
    finally:
        reset()


def test_pass_decisions_report_the_chunk_sizes():
    with fake_process_group(4):
        gm = make_fx(_fsdp_linear, tracing_mode="fake")(torch.randn(4, 16), torch.randn(8, 16))
        rec = _run(gm)
        (d,) = rec.decisions
        assert (d["kind"], d["chunks"], d["sizes"], d["granularity"]) == ("all_gather", 2, [8, 8], "even")
        assert "2 chunks of sizes [8, 8]" in d["decision"]


# ---------------------------------------------------------------- 4 gloo ranks
@pytest.mark.multirank
@pytest.mark.parametrize("case", ["fsdp", "dp", "tp"])
def test_training_matches_eager_on_4_ranks(rank_pool_4, case):
    import _jobs_workload_partition as jobs

    if case == "tp":
        results = rank_pool_4.run(jobs.tp_gather_matmul_gelu_matches_eager, timeout=300)
    else:
        results = rank_pool_4.run(
            jobs.simple_fsdp_matches_eager, "fully_shard" if case == "fsdp" else "replicate", timeout=300
        )
    got = results[0]
    assert all(r == got for r in results)  # every rank decided the same
    if case == "fsdp":
        assert got["forward"]["changed"] and got["forward"]["kinds"] == {"all_gather": 4}
        assert got["backward"]["counts"]["producer_chains"] == 2 and got["backward"]["kinds"] == {
            "reduce_scatter": 4
        }
    elif case == "dp":
        assert got["backward"]["counts"]["producer_chains"] == 2 and got["backward"]["kinds"] == {
            "all_reduce": 4
        }
    else:
        assert got["forward"]["counts"]["consumer_chains"] == 1 and got["forward"]["kinds"]["all_gather"] == 2


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["tp", "fsdp"])
def test_uneven_chunks_match_eager_on_4_ranks(rank_pool_4, case):
    """Algorithm 1's uneven granularity (2:1:1 on 2 nodes x 2) applied to every collective it
    picks: outputs, losses, gradients and parameters equal eager's on every rank (asserted in
    the job)."""
    import _jobs_workload_partition as jobs

    results = rank_pool_4.run(jobs.uneven_chunks_match_eager, case, timeout=300)
    got = results[0]
    assert all(r == got for r in results)  # every rank decided the same
    kinds = {g: sorted({d["kind"] for d in ds}) for g, ds in got.items()}
    # tp: the backward's gather is the reduce_scatter's gradient; its reduce_scatters read a
    # reassembled value (no producer chain). fsdp: the backward holds the gradient reduce_scatters.
    assert kinds == {
        "joint": [],
        "forward": ["all_gather"],
        "backward": ["all_gather" if case == "tp" else "reduce_scatter"],
    }, got
    for ds in got.values():
        for d in ds:
            assert "chunks:3(2:1:1)" in d["scheme"] and len(set(d["chunk_sizes"])) > 1, d
