"""centauri_partition: the scheme tree, scoring, determinism, budget, refusals, and numerics on 4 gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx

import commfuse
from commfuse.costmodel import Topology
from commfuse.costmodel.topology import PRESETS
from commfuse.transforms.partition_search import Scheme, chunk_candidates, leaves_for, predicted
from commfuse.passmgr.context import PassContext
from commfuse.testing.fake_pg import fake_mesh
from commfuse.testing.graphs import capture_aot_graphs

from _jobs_partition_search import small_gpu_topology

DGX2 = Topology.preset("dgx-h100", num_nodes=2)


def test_chunk_candidates_are_powers_of_two_up_to_the_bound():
    assert chunk_candidates(1) == [1]
    assert chunk_candidates(8) == [1, 2, 4, 8]
    assert chunk_candidates(6) == [1, 2, 4]


def test_scheme_description_names_each_level():
    assert Scheme().describe() == "unchanged"
    assert (
        Scheme("broadcast_roots", "inter_first", 4).describe() == "broadcast_roots+group:inter_first+chunks:4"
    )
    assert Scheme(chunks=2).complexity() < Scheme(chunks=4).complexity()


def test_without_topology_the_search_refuses_and_leaves_the_graph():
    with fake_mesh(4) as mesh:
        gm = _fsdp_graphs(mesh, dim=64)["forward"]
        before = gm.code
        commfuse.optimize(
            gm, commfuse.Config(passes=["centauri_partition"], strict=True), graph_kind="forward"
        )
        rec = commfuse.last_report(gm).passes[0]
    assert not rec.changed and gm.code == before
    assert "no topology" in rec.refusals[0]


@pytest.mark.parametrize("shape,changed", [((32, 4), True), ((8, 1), False)])
def test_forced_pass_cuts_in_algorithm1s_uneven_granularity_or_says_why_not(shape, changed):
    """2 nodes x 4 (the fuzz topology): Algorithm 1 gives the all_reduce 4:1:3, intra-node step
    first. [32, 4]: chunks of 16 / 4 / 12 rows, each a reduce_scatter / all_reduce / all_gather
    sequence. [8, 1]: the [1, 1] chunk has no dim the intra-node level (4) divides, so the
    leaf fails on a copy and the graph is left as it was (found by the fuzzer)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    from commfuse.ir.graph_ir import CollectiveIR
    from commfuse.testing.equivalence import check_equivalent
    from commfuse.testing.fake_pg import fake_process_group
    from commfuse.testing.graphs import _copy
    from commfuse.transforms.group_partition import GroupPartition

    topo = GroupPartition.fuzz.topology
    commfuse.session.reset()
    try:
        with fake_process_group(8):
            s = commfuse.setup(topology=topo)
            gm = make_fx(
                lambda x: torch.relu(funcol.all_reduce(x, "sum", dist.group.WORLD)), tracing_mode="fake"
            )(torch.randn(shape))
            before, code = _copy(gm), gm.code
            commfuse.optimize(
                gm, commfuse.Config(passes=["centauri_partition_forced"], strict=True, topology=topo)
            )
            rec = commfuse.last_report(gm).passes[0]
            assert rec.changed == changed, rec
            if changed:
                (d,) = rec.decisions
                assert (d["scheme"], d["chunk_sizes"]) == ("group:intra_first+chunks:3(4:1:3)", [16, 4, 12])
                assert "granularity 0.5, 0.125, 0.375" in d["granularity"]
                colls = CollectiveIR(gm).collectives
                assert [c.input_shapes[0][0] for c in colls if c.kind.value == "reduce_scatter"] == [
                    16,
                    4,
                    12,
                ]
                check_equivalent(before, gm, 8, groups={"0": "world", **s.reference_groups()})
            else:
                assert gm.code == code and "4:1:3) infeasible" in rec.refusals[0], rec.refusals
    finally:
        commfuse.session.reset()


@pytest.mark.parametrize(
    "topo,hierarchical",
    [
        # latency-bound 2 x 4 (the fuzz topology): one inter-node message per peer node, not per rank
        ("latency", True),
        # bandwidth-bound: the two-level exchange moves the buffer twice and pays two reorders
        ("bandwidth", False),
    ],
)
def test_search_picks_the_two_level_all_to_all_where_the_simulator_prefers_it(topo, hierarchical):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    from commfuse.ir.graph_ir import CollectiveIR
    from commfuse.testing.equivalence import check_equivalent
    from commfuse.testing.fake_pg import fake_process_group
    from commfuse.testing.graphs import _copy
    from commfuse.transforms.group_partition import GroupPartition

    latency = GroupPartition.fuzz.topology
    topology = (
        latency
        if topo == "latency"
        else latency.model_copy(
            update={
                "inter_node_bandwidth_GBps": 400.0,
                "intra_node_bandwidth_GBps": 400.0,
                "inter_node_latency_us": 0.1,
                "intra_node_latency_us": 0.1,
                "memory_bandwidth_GBps": 50.0,
            }
        )
    )
    rows = 8 if topo == "latency" else 8 * 4096
    with fake_process_group(8):
        s = commfuse.setup(topology=topology)
        try:
            gm = make_fx(
                lambda x: funcol.all_to_all_single(x.tanh(), None, None, dist.group.WORLD) * 2,
                tracing_mode="fake",
            )(torch.randn(rows, 64))
            before = _copy(gm)
            rec = _search(gm, topology)
            kinds = [(c.kind.value, c.group.size) for c in CollectiveIR(gm).collectives]
            if hierarchical:
                assert rec.changed and "group:" in rec.decisions[0]["scheme"], (rec.decisions, rec.refusals)
                assert sorted(kinds) == [("all_to_all", 2), ("all_to_all", 4)]
                check_equivalent(before, gm, 8, groups={"0": "world", **s.reference_groups()}, exact=True)
            else:
                assert not rec.changed and kinds == [("all_to_all", 8)], rec.decisions
                assert rec.refusals and "all_to_all" in rec.refusals[0]
        finally:
            commfuse.session.reset()


def _fsdp_graphs(mesh, dim: int = 256, seq: int = 64, ffn: int | None = None):
    from commfuse.models import llama, simple_fsdp

    world = mesh.size()
    cfg = llama.LlamaConfig(n_layers=1, dim=dim, n_heads=4, ffn_dim=ffn or 4 * dim, vocab=None)
    model = simple_fsdp.data_parallel(llama.build_llama(cfg, seed=0), mesh, "fully_shard")
    batch = simple_fsdp.make_inputs(cfg, world, seq, rank=0, world_size=world)
    return capture_aot_graphs(model, batch.inputs, loss=lambda out: simple_fsdp.loss_fn(out, batch))


def _search(gm: fx.GraphModule, topo: Topology, **cfg) -> commfuse.passmgr.report.PassRecord:
    commfuse.optimize(
        gm,
        commfuse.Config(passes=["centauri_partition"], topology=topo, strict=True, **cfg),
        graph_kind="forward",
    )
    return commfuse.last_report(gm).passes[0]


@pytest.fixture(scope="module")
def dgx2_graphs():
    # Module scope: one capture (~3 s) for the tests below; the fake world stays up
    # until the module ends, so tests that start their own world come before this one.
    with fake_mesh(DGX2.world_size) as mesh:
        commfuse.setup(topology=DGX2)
        try:
            yield _fsdp_graphs(mesh, dim=1024, seq=512)
        finally:
            commfuse.session.reset()


@pytest.fixture
def dgx2_fsdp(dgx2_graphs):
    """Fresh copies of the captured forward/backward graphs (the search rewrites in place)."""
    return {
        k: fx.GraphModule(dgx2_graphs[k], copy.deepcopy(dgx2_graphs[k].graph))
        for k in ("forward", "backward")
    }


@pytest.mark.slow(reason="runs the partition search on a traced model")
def test_search_lowers_the_predicted_makespan_and_records_each_decision(dgx2_fsdp):
    # The backward's last gradient reduce_scatter has nothing left to hide under: the
    # search splits it over the two levels of the topology.
    gm = dgx2_fsdp["backward"]
    ctx = PassContext(gm, commfuse.Config(), topology=DGX2)
    before = predicted(ctx)
    rec = _search(gm, DGX2)
    after = predicted(PassContext(gm, commfuse.Config(), topology=DGX2))
    assert rec.changed and rec.decisions
    assert after.makespan_us < before.makespan_us
    for d in rec.decisions:
        assert d["makespan_after_us"] < d["makespan_before_us"]
        assert d["scheme"] != "unchanged"
    # the last decision's prediction is the graph's prediction (decisions chain)
    assert rec.decisions[-1]["makespan_after_us"] == pytest.approx(after.makespan_us, rel=1e-6)


@pytest.mark.slow(reason="runs the partition search twice on a traced model")
def test_search_is_deterministic(dgx2_fsdp):
    a = dgx2_fsdp["backward"]
    b = fx.GraphModule(a, copy.deepcopy(a.graph))
    ra, rb = _search(a, DGX2), _search(b, DGX2)
    assert ra.decisions == rb.decisions
    assert a.code == b.code


def test_budget_bounds_the_search_and_is_reported(dgx2_fsdp):
    gm = dgx2_fsdp["backward"]
    rec = _search(gm, DGX2, partition_search_budget=1)
    assert rec.counts["leaves_scored"] <= 1
    assert any("budget" in r for r in rec.refusals)


def test_leaves_include_every_level_for_a_spanning_all_gather(dgx2_fsdp):
    gm = dgx2_fsdp["forward"]
    ctx = PassContext(gm, commfuse.Config(), topology=DGX2, session=commfuse.session.current_session())
    ag = next(c for c in ctx.ir.collectives if c.kind.value == "all_gather")
    leaves = leaves_for(ctx, ag)
    assert Scheme() in leaves
    assert {s.group for s in leaves} >= {"flat", "inter_first"}
    assert any(s.chunks > 1 for s in leaves)
    assert any(s.primitive != "keep" for s in leaves)


@pytest.mark.slow(reason="trains on real gloo ranks against eager, forward and backward compiled per rank")
@pytest.mark.multirank
def test_search_matches_eager_on_4_gloo_ranks(rank_pool_4):
    from _jobs_partition_search import partition_search_matches_eager

    results = rank_pool_4.run(partition_search_matches_eager)
    assert all(r["changed"] for r in results), results
    assert len({tuple(r["schemes"]) for r in results}) == 1  # same decisions on every rank


def test_small_gpu_topology_is_two_nodes_of_two():
    topo = small_gpu_topology()
    assert (topo.num_nodes, topo.ranks_per_node, topo.is_gpu) == (2, 2, True)
    assert topo.intra_node_bandwidth_GBps == PRESETS["dgx-h100"]["intra_node_bandwidth_GBps"]
