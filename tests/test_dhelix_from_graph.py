"""DHelix segments cut from a traced Llama TP+SP layer (commfuse.dhelix.from_graph) and the report.

Single process, fake process group of 8 (TP = 8 on one DGX-A100 node), tiny shapes."""

from __future__ import annotations

import pytest

from benchmarks.dhelix_report import SMALL, _plan_row, layer_strands


@pytest.fixture(scope="module")
def strands():
    import commfuse
    from commfuse.costmodel import Topology
    from commfuse.models import llama
    from commfuse.testing.fake_pg import fake_mesh
    from commfuse.testing.graphs import capture_aot_graphs

    topo = Topology.preset("dgx-a100", num_nodes=1)
    s = SMALL
    with fake_mesh(8, (8,), ("tp",)) as mesh:
        commfuse.setup(topology=topo, mesh=mesh)
        try:
            cfg = llama.LlamaConfig(n_layers=1, dim=s["dim"], n_heads=s["n_heads"], ffn_dim=s["ffn_dim"])
            model = llama.parallelize_llama(
                llama.build_llama(cfg, seed=0), mesh["tp"], sequence_parallel=True
            )
            data = llama.make_inputs(cfg, s["batch"], s["seq"], rank=0, world_size=8, sequence_parallel=True)
            graphs = capture_aot_graphs(model, data.inputs, loss=lambda out: llama.loss_fn(out, data))
            yield graphs, topo, layer_strands(graphs, topo)
        finally:
            commfuse.session.reset()


def test_forward_segments_alternate_compute_and_sp_collectives(strands):
    _, _, st = strands
    fwd = st["forward"]
    # SP layer: norm, all_gather, attention, reduce_scatter, norm, all_gather, MLP, reduce_scatter, tail
    assert fwd.kinds() == ("compute", "comm_local") * 4 + ("compute",)
    comm = [s.name.split(".", 1)[1].split(":")[0] for s in fwd.segments if s.kind != "compute"]
    assert comm == ["all_gather", "reduce_scatter", "all_gather", "reduce_scatter"]
    assert all(s.duration > 0 for s in fwd.segments)
    assert fwd.movable == ()
    assert sum(s.mem_delta for s in fwd.segments) > 0  # the forward keeps its saved activations


def test_backward_segments_and_weight_gradient_gemms(strands):
    graphs, _, st = strands
    bwd, deferred = st["backward"], st["backward_deferred"]
    assert len(bwd.movable) == 7  # wq, wk, wv, wo, w1, w2, w3
    assert sum(s.kind == "comm_local" for s in bwd.segments) == 4
    assert sum(s.name.split(".", 1)[1].startswith("wgrad:") for s in bwd.segments) == 7
    assert all(s.duration > 0 for s in bwd.segments)
    # every node of the graph lands in exactly one segment
    names = [n for seg in bwd.nodes for n in seg]
    assert sorted(names) == sorted(n.name for n in graphs.backward.graph.nodes)
    # deferring moves the 7 GEMMs to the end, costs the same time in total
    assert [s.name.split(".", 1)[1] for s in deferred.segments[-7:]] == [f"wgrad:{m}" for m in bwd.movable]
    assert deferred.total_time == pytest.approx(bwd.total_time)
    assert sum(s.mem_delta for s in bwd.segments) < 0  # the backward frees saved activations


def test_movable_rule_rejects_activation_gradients(strands):
    import torch

    from commfuse.dhelix.from_graph import movable_ops

    graphs, _, _ = strands
    mms = [
        n
        for n in graphs.backward.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.aten.mm.default
    ]
    movable = set(movable_ops(graphs.backward))
    assert movable and len(movable) < len(mms)  # the data-gradient GEMMs feed further compute
    for n in mms:
        if n.name not in movable:
            assert any(u.op != "output" for u in n.users)


def test_report_plan_not_slower_than_sequential(strands):
    _, _, st = strands
    row = _plan_row("dgx-a100", st)
    assert row["interleaved_us"] <= row["sequential_us"]
    assert row["sequential_us"] == pytest.approx(st["forward"].total_time + st["backward"].total_time)
    assert row["plan"]["pairs"] > 0


def test_bad_strand_named():
    import torch.fx as fx

    from commfuse.costmodel import AnalyticCostModel, Topology
    from commfuse.dhelix.from_graph import graph_segments

    topo = Topology.preset("dgx-a100")
    with pytest.raises(ValueError, match="strand"):
        graph_segments(fx.symbolic_trace(lambda x: x + 1), AnalyticCostModel(topo), topo, strand="sideways")


def test_runner_flag_registered(strands, monkeypatch, capsys):
    import benchmarks.dhelix_report as rep
    from benchmarks import run

    assert run._REPORTS["dhelix_report"][:4] == (
        "benchmarks.dhelix_report",
        "run_dhelix_report",
        "dhelix_tables",
        "dhelix",
    )
    _, _, st = strands
    canned = {
        "workload": "tiny",
        "model": "analytic",
        "oef": "default",
        "source": "dhelix.md",
        "capture_s": 0.0,
        "rows": [_plan_row("dgx-a100", st)],
    }
    monkeypatch.setattr(rep, "run_dhelix_report", lambda: canned)  # the flag dispatches; no re-capture
    assert run.main(["--dhelix-report"]) == 0
    out = capsys.readouterr().out
    assert "DHelix strand interleaving" in out and "dgx-a100" in out
