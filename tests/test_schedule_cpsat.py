"""CP-SAT windows of schedule_overlap: the cumulative memory constraint, never worse than greedy, determinism."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from commfuse.costmodel import AnalyticCostModel, Topology
from commfuse.costmodel.simulator import Simulator
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.schedule.cpsat import liveness, refine_windows, window_memory
from commfuse.schedule.list_scheduler import Priority, build_problem, list_schedule, live_profile
from commfuse.testing.fake_pg import fake_mesh, fake_process_group
from commfuse.testing.graphs import capture_aot_graphs

from _graphs import prefetch_graph

DGX = Topology.preset("dgx-h100", num_nodes=1)
N = 256  # prefetch graph width: one gathered weight is N * N * 4 bytes


def _anything(order, r) -> bool:
    """Accept every improving window: what the memory model alone guarantees is under test."""
    return True


@pytest.fixture(scope="module")
def prefetch():
    with fake_process_group(8):
        gm = prefetch_graph(N, 8)
    sim = Simulator(gm, AnalyticCostModel(DGX, backend="nccl"))
    p = build_problem(gm, sim, CollectiveIR(gm))
    order = list(range(p.size))
    return p, sim, order, sim.simulate([p.nodes[i] for i in order], record=False)


def _refine(p, sim, order, r, limit, det=2.0):
    return refine_windows(
        p, sim, order, r, max_nodes=60, det_time_s=det, acceptable=_anything, memory_limit=limit
    )


def test_memory_constraint_keeps_the_window_within_the_limit(prefetch):
    p, sim, order, r_in = prefetch
    limit = r_in.peak_memory_bytes  # no byte more than the input order
    free_order, free, _ = _refine(p, sim, order, r_in, None)
    # unconstrained, CP-SAT prefetches every gather up front: faster, over the limit
    assert free.makespan_us < r_in.makespan_us and free.peak_memory_bytes > limit
    got_order, got, info = _refine(p, sim, order, r_in, limit)
    assert got.peak_memory_bytes <= limit
    assert info["memory_limit_bytes"] == limit
    assert all(w["peak_memory_bytes"] <= limit for w in info["windows"] if "peak_memory_bytes" in w)
    # still better than the input order (a gather moves up where a buffer was freed), and
    # proven optimal for the window within the budget
    assert got.makespan_us < r_in.makespan_us and info["windows"][0]["status"] == "OPTIMAL"
    assert free.makespan_us < got.makespan_us
    names = [p.nodes[i].name for i in got_order]
    assert names.index("all_gather_into_tensor_1") > names.index("mm")  # not all prefetched at the top

    # one more gathered weight allowed: the constrained solve reaches the unconstrained makespan
    _, roomy, _ = _refine(p, sim, order, r_in, limit + N * N * 4)
    assert roomy.makespan_us == free.makespan_us and roomy.peak_memory_bytes <= limit + N * N * 4


def test_window_accounting_matches_the_simulator(prefetch):
    p, sim, order, r_in = prefetch
    names = [p.nodes[i].name for i in order]
    lo, hi = len(p.head), names.index("mm_2")  # mm, tanh, gather 0, its wait, mm_1
    mem = window_memory(p, order, lo, hi, liveness(p, order), r_in.peak_memory_bytes)
    # x, w2 and w3 are allocated before the window and read after it: live throughout
    assert mem.live_through == N * N * 4 + 2 * (N // 8) * N * 4
    assert mem.capacity == r_in.peak_memory_bytes - mem.live_through
    by_name = {p.nodes[b.owner].name: b for b in mem.buffers}
    assert set(by_name) == {"w1_1", "mm", "tanh", "all_gather_into_tensor", "mm_1"}
    assert not by_name["w1_1"].allocated_inside and not by_name["w1_1"].used_after  # freed at its gather
    assert by_name["mm"].allocated_inside and not by_name["mm"].used_after  # read by tanh only
    assert by_name["mm_1"].used_after and not by_name["tanh"].used_after
    # the gathered weight is also touched by its wait and read by mm_1
    assert [p.nodes[i].name for i in by_name["all_gather_into_tensor"].touchers] == [
        "all_gather_into_tensor",
        "wait_tensor",
        "mm_1",
    ]
    # the simulator's live bytes anywhere in the window are covered: through + the intervals
    prof = live_profile(p, order)
    assert max(prof[i] for i in order[lo:hi]) <= mem.live_through + sum(b.bytes for b in mem.buffers)


def test_unreachable_limit_leaves_the_order(prefetch):
    p, sim, order, r_in = prefetch
    # the whole graph is one window: the solver proves no order fits one byte
    got_order, got, info = _refine(p, sim, order, r_in, 1.0)
    assert got_order == order and got is r_in
    assert info["windows"] and all(w["status"] == "INFEASIBLE" and not w["kept"] for w in info["windows"])
    # small windows: where the bytes living across one alone pass the limit, it is not solved
    got_order, _, info = refine_windows(
        p, sim, order, r_in, max_nodes=6, det_time_s=2.0, acceptable=_anything, memory_limit=1.0
    )
    assert got_order == order and not any(w["kept"] for w in info["windows"])
    statuses = [w["status"] for w in info["windows"]]
    assert "OVER_MEMORY_LIMIT" in statuses and set(statuses) <= {"OVER_MEMORY_LIMIT", "INFEASIBLE"}, statuses


def _symmetric_fn(x, w):
    """Zero-time getitems of one split, all alike (fuzz program 8:62, shrunk)."""
    h = torch.log_softmax((x.view(8, 4) @ w).view(1, 8, 4), 0)
    return funcol.reduce_scatter_tensor(torch.cat(torch.split(h, 1, 2)), "avg", 0, dist.group.WORLD)


def test_symmetric_window_with_a_hint_is_solved():
    # OR-Tools' presolve symmetry detection raised IndexError (absl::btree_map::at) on this
    # window once the current order was given as a hint; the fuzzer found it
    with fake_process_group(4):
        gm = make_fx(_symmetric_fn, tracing_mode="fake")(
            torch.randn(2, 4, 4).to(torch.bfloat16), torch.randn(4, 4).to(torch.bfloat16)
        )
    sim = Simulator(gm, AnalyticCostModel(DGX, backend="nccl"))
    p = build_problem(gm, sim, CollectiveIR(gm))
    assert sum(n.target is operator.getitem for n in p.nodes) == 4
    order = list(range(p.size))
    r = sim.simulate([p.nodes[i] for i in order], record=False)
    _, _, info = _refine(p, sim, order, r, 1.05 * r.peak_memory_bytes)
    assert info["windows"] and all(w["status"] in ("OPTIMAL", "FEASIBLE") for w in info["windows"]), info


# --- the examples: TP+SP Llama, SimpleFSDP, MoE (8 fake ranks, DGX-H100) ---------------------------------


@pytest.fixture(scope="module")
def example_graphs():
    from commfuse.models import llama, moe, simple_fsdp

    out = {}
    with fake_mesh(8) as mesh:
        cfg = llama.LlamaConfig(n_layers=2, dim=256, n_heads=8, ffn_dim=1024)
        m = llama.parallelize_llama(llama.build_llama(cfg, seed=0), mesh, sequence_parallel=True)
        d = llama.make_inputs(cfg, 2, 128, rank=0, world_size=8, sequence_parallel=True, seed=1)
        out["tp_sp"] = capture_aot_graphs(m, d.inputs, loss=lambda o: llama.loss_fn(o, d))
        cfg = llama.LlamaConfig(vocab=None, n_layers=2, dim=256, n_heads=4, ffn_dim=1024)
        m = simple_fsdp.data_parallel(llama.build_llama(cfg, seed=0), mesh, "fully_shard")
        b = simple_fsdp.make_inputs(cfg, 8, 128, rank=0, world_size=8)
        out["simple_fsdp"] = capture_aot_graphs(m, b.inputs, loss=lambda o: simple_fsdp.loss_fn(o, b))
        m = moe.parallelize_moe(moe.build_moe(dim=64, num_experts=16, ffn_dim=128, seed=0), mesh)
        x = moe.make_inputs(16, 32, 64, rank=0, world_size=8)
        out["moe"] = capture_aot_graphs(m, x.inputs, loss=lambda o: moe.loss_fn(o[0], o[1], x))
    return out


def _greedy(gm):
    ir = CollectiveIR(gm)
    sim = Simulator(gm, AnalyticCostModel(DGX, backend="nccl"), ir=ir)
    p = build_problem(gm, sim, ir)
    limit = (
        1.05 * sim.simulate(record=False).peak_memory_bytes
    )  # tighter than the default 1.10: work left for CP-SAT
    order = list_schedule(p, Priority(True, True), max_inflight_bytes=None, memory_limit=limit).order
    r = sim.simulate([p.nodes[i] for i in order], record=False)
    # The pass refines only a greedy order within its budget (it retries over-budget ones with a
    # smaller in-flight cap); where this first variant is over, the limit is its peak.
    return p, sim, order, r, max(limit, r.peak_memory_bytes)


@pytest.mark.slow(reason="CP-SAT on every window of three example models (module fixture)")
@pytest.mark.parametrize("kind", ["forward", "backward"])
@pytest.mark.parametrize("example", ["tp_sp", "simple_fsdp", "moe"])
def test_cpsat_never_worse_than_greedy_and_within_memory(example_graphs, example, kind):
    p, sim, order, r, limit = _greedy(example_graphs[example][kind])
    assert p.collectives
    got_order, got, info = _refine(p, sim, order, r, limit)
    solved = [w for w in info["windows"] if w["status"] in ("OPTIMAL", "FEASIBLE")]
    assert solved, info
    assert got.makespan_us <= r.makespan_us
    assert got.peak_memory_bytes <= limit
    # every window CP-SAT returned, kept or not, met the limit by its model alone
    assert all(w["peak_memory_bytes"] <= limit for w in solved), info
    assert sorted(got_order) == list(range(p.size))


@pytest.mark.slow(reason="CP-SAT on every window of three example models (module fixture)")
def test_same_order_twice(example_graphs):
    p, sim, order, r, limit = _greedy(example_graphs["moe"]["backward"])
    a = _refine(p, sim, order, r, limit)
    b = _refine(p, sim, order, r, limit)
    assert a[0] == b[0] and a[2] == b[2]
    assert any(w["kept"] for w in a[2]["windows"])  # a window the memory-aware model improved


def test_without_or_tools_the_pass_keeps_the_greedy_order_and_says_why(monkeypatch):
    """An image without OR-Tools (a CUDA machine nothing can be installed on) loses only the
    CP-SAT refinement: schedule_overlap still schedules, and its decision names what is missing."""
    import importlib.util

    import commfuse
    from commfuse.schedule import cpsat

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ortools" else real(name, *a)
    )
    assert "OR-Tools is not installed" in cpsat.solver_missing()
    with fake_process_group(8):
        gm = prefetch_graph(64, 8)
    commfuse.optimize(
        gm, commfuse.Config(passes=["schedule_overlap"], strict=True, topology=DGX), graph_kind="forward"
    )
    (rec,) = commfuse.last_report(gm).passes
    assert rec.error is None
    (decision,) = rec.decisions[:1]
    assert decision["cpsat"]["enabled"] is False and "OR-Tools is not installed" in decision["cpsat"]["why"]
