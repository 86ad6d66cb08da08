"""Centauri's operation-level rule (Algorithm 1, ``operation_level_plan``): the rule on numbers,
in_cost on a graph, and its use by workload_partition."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse
from commfuse.costmodel import Topology
from commfuse.ir import rewrite
from commfuse.analysis.chunking import GroupCosts, independent_compute_us, operation_level_plan, rounded_units
from commfuse.passmgr.context import PassContext
from commfuse.transforms.workload_partition import operation_level_chunks, plan_workload_partition
from commfuse.testing.fake_pg import fake_process_group


def test_hidden_collective_is_not_partitioned():
    p = operation_level_plan(comp_cost=10, comm_cost=5, in_cost=5, max_chunks=8)
    assert (p.num_chunks, p.granularity, p.first) == (1, (1.0,), None)


@pytest.mark.parametrize(
    "comm,inn,want", [(10, 5, 2), (10, 4, 3), (10, 1, 8), (100, 1, 8), (10, 0, 8), (10, 9.9, 2)]
)
def test_chunk_count_is_comm_over_independent_compute_rounded_up(comm, inn, want):
    p = operation_level_plan(comp_cost=50, comm_cost=comm, in_cost=inn, max_chunks=8)
    assert p.num_chunks == want and p.granularity == tuple([1 / want] * want)


def test_max_chunks_one_never_partitions():
    assert operation_level_plan(comp_cost=1, comm_cost=10, in_cost=1, max_chunks=1).num_chunks == 1


def test_group_partitioned_granularities_follow_the_three_branches():
    g = GroupCosts(cost_inter=4.0, cost_intra=1.0, inter_size=2, intra_size=8)  # world 16
    inter_first = operation_level_plan(comp_cost=10, comm_cost=20, in_cost=5, max_chunks=8, group=g)
    assert inter_first.first == "inter" and inter_first.granularity == (2 / 16, 1 - 2 / 16)
    intra_first = operation_level_plan(comp_cost=1000, comm_cost=20, in_cost=3, max_chunks=8, group=g)
    assert intra_first.first == "intra" and intra_first.granularity == (8 / 16, 1 - 8 / 16)
    finer = operation_level_plan(comp_cost=10, comm_cost=20, in_cost=3, max_chunks=8, group=g)
    assert finer.first == "intra" and finer.granularity == (8 / 16, 1 / 16, 1 - 9 / 16)
    assert sum(finer.granularity) == pytest.approx(1.0)


def test_granularities_become_integer_units_exact_first_then_coarser():
    # world 16, inter first: 2/16 : 14/16 = 1:7, then roundings to fewer units, all uneven
    assert rounded_units((2 / 16, 1 - 2 / 16)) == [(1, 7), (1, 6), (1, 5), (1, 4), (1, 3), (1, 2)]
    assert rounded_units((8 / 16, 1 / 16, 1 - 9 / 16))[:3] == [(8, 1, 7), (7, 2, 6), (7, 1, 6)]
    assert rounded_units((0.25, 0.75)) == [(1, 3), (1, 2)]
    assert rounded_units((0.5, 0.25, 0.25)) == [(2, 1, 1)]
    assert rounded_units((0.5, 0.5)) == []  # equal parts: the even cut
    assert rounded_units((1.0,)) == [] and rounded_units((0.0, 1.0)) == []


def _graph():
    def f(x, w, y, v):
        g = rewrite.all_gather(x, 0, 4, "0")  # weight gather feeding a matmul
        z = torch.mm(y, v)  # independent of the gather, between its start and its use
        out = torch.relu(torch.mm(g, w))
        return out, z

    with fake_process_group(4):
        gm = make_fx(f, tracing_mode="fake")(
            torch.randn(16, 64), torch.randn(64, 64), torch.randn(64, 64), torch.randn(64, 64)
        )
    return gm


def test_in_cost_counts_only_independent_compute_before_the_first_use():
    gm = _graph()
    topo = Topology.preset("dgx-h100", num_nodes=1)
    with fake_process_group(4):
        ctx = PassContext(gm, commfuse.Config(), topology=topo)
        (c,) = ctx.ir.collectives
        est = ctx.cost.model
        mm_indep = next(
            n
            for n in gm.graph.nodes
            if n.target is torch.ops.aten.mm.default and n.args[0].op == "placeholder"
        )
        got = independent_compute_us(ctx.gm, ctx.ir, c, est)
    assert got == pytest.approx(est.compute_time_us(mm_indep))


def test_workload_partition_takes_its_chunk_count_from_the_operation_level_plan():
    gm = _graph()
    topo = Topology.preset("dgx-h100", num_nodes=1)
    with fake_process_group(4):
        ctx = PassContext(gm, commfuse.Config(), topology=topo)
        (c,) = ctx.ir.collectives
        k, why = operation_level_chunks(ctx, c)
        plan = plan_workload_partition(ctx, c)
        fixed = plan_workload_partition(PassContext(gm, commfuse.Config(workload_chunks=2), topology=topo), c)
    assert k is not None and "chunks" in why
    assert not isinstance(plan, str) and plan.chunks <= k and plan.chunks >= 2
    assert not isinstance(fixed, str) and fixed.chunks == 2
