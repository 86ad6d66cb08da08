"""DHelix on a real layer graph: simulated step time with and without strand interleaving.

What it runs
    A Llama-style decoder layer with Megatron TP + SP over TP = 8 ranks (one node), traced
    forward + backward on a ``fake`` process group (nothing communicated; only the graphs
    matter) with ``commfuse.testing.graphs.capture_aot_graphs``. Each graph is cut into DHelix
    segments by ``commfuse.dhelix.from_graph.graph_segments`` and priced by the analytic cost
    model (``AnalyticCostModel``, backend nccl) on two presets, "dgx-a100" and "a40-pcie"
    (8 ranks each, so every TP collective is ``comm_local``). Per preset it prints

    * sequential: micro-batch alpha's backward of the layer, then beta's forward, back to back
      (sum of the segment times; what a non-interleaved step spends on this layer pair);
    * interleaved: the Eq. 2 plan time of ``search_plans`` over the forward in graph order and
      the backward in graph order / with the weight-gradient GEMMs deferred to the end
      (``defer_movable``), with ``default_oef()`` — ILLUSTRATIVE overlap factors after the
      paper's qualitative findings, NOT measured on either machine;
    * the speed-up sequential / interleaved, and DHelix's published gains next to it.

    The numbers are predictions of commfuse's analytic model under an assumed OEF table, for
    one layer pair; the paper's gains are end-to-end training throughput on 64 GPUs, so the
    two columns are context for each other, not a reproduction.

    Measured (unless ``timing=False``): the whole training step with and without interleaving on
    4 gloo ranks of this machine: ``compile_train_step`` of the 4-layer TP+SP Llama and the
    4-layer TP+EP MoE model (tests/_jobs_dhelix.py), 2 and 4 micro-batches: default pipeline
    ("plain"), the fused partition without the interleaving pass ("fused": every forward, then
    every backward — without interleaving, same graph) and ``Config(dhelix=True)``
    ("interleaved"), all eager inner compiler and commfuse lowering (async gloo handles),
    alternated step by step; per step the slowest rank, median and IQR over the timed steps; the largest difference of loss and gradients between the two; the
    interleaving pass's simulated peak memory (sequential vs interleaved order of the fused
    graph, and activation peaks) and whether all ranks chose the same plan (digest).

    python benchmarks/run.py --dhelix-report [--json out.json]
"""

from __future__ import annotations

import time
from typing import Any

PRESETS = ("dgx-a100", "a40-pcie")
TP = 8
# Llama-style layer, per micro-batch; fp32 traces (the paper trains in bf16)
FULL = dict(dim=4096, n_heads=32, ffn_dim=11008, batch=1, seq=4096)
SMALL = dict(dim=64, n_heads=8, ffn_dim=128, batch=1, seq=64)

# End-to-end throughput gains published in the DHelix paper (Wang et al., "Hiding Communication
# Cost in Distributed LLM Training via Micro-batch Co-execution"), Sec. 6 "Evaluation"
PUBLISHED = {
    "a40-pcie": "64 A40: +12-40% (dense, seq 8192: +27-40% vs Megatron-LM); ~83% of TP comm hidden",
    "dgx-a100": "64 A800 (A100-class, NVLink): +2-29%; smaller gains on fast interconnects",
}

__all__ = ["dhelix_tables", "layer_strands", "run_dhelix_report"]


def layer_strands(graphs: Any, topo: Any) -> dict[str, Any]:
    """Segments of one captured layer (forward, backward, backward with deferred wgrad GEMMs)."""
    from commfuse.costmodel import AnalyticCostModel
    from commfuse.dhelix.from_graph import defer_movable, graph_segments

    model = AnalyticCostModel(topo, backend="nccl")
    fwd = graph_segments(graphs.forward, model, topo, strand="forward")
    bwd = graph_segments(graphs.backward, model, topo, strand="backward")
    bwd_deferred = graph_segments(defer_movable(graphs.backward), model, topo, strand="backward")
    return {"forward": fwd, "backward": bwd, "backward_deferred": bwd_deferred}


def _plan_row(preset: str, strands: dict[str, Any]) -> dict[str, Any]:
    from commfuse.dhelix import default_oef, search_plans

    fwd, bwd, bwd_d = strands["forward"], strands["backward"], strands["backward_deferred"]
    sequential = fwd.total_time + bwd.total_time
    res = search_plans([fwd.segments], [bwd.segments, bwd_d.segments], default_oef())
    plan = res.plan

    def comm(g) -> float:
        return sum(s.duration for s in g.segments if s.kind != "compute")

    return {
        "preset": preset,
        "forward": {
            "segments": len(fwd.segments),
            "kinds": list(fwd.kinds()),
            "time_us": fwd.total_time,
            "comm_us": comm(fwd),
        },
        "backward": {
            "segments": len(bwd.segments),
            "kinds": list(bwd.kinds()),
            "time_us": bwd.total_time,
            "comm_us": comm(bwd),
            "movable": list(bwd.movable),
        },
        "sequential_us": sequential,
        "interleaved_us": plan.total_time,
        "speedup": sequential / plan.total_time if plan.total_time > 0 else 1.0,
        "backward_order": ["graph order", "wgrad GEMMs deferred"][res.bwd_index],
        "plan": {
            "steps": len(plan.steps),
            "pairs": plan.codes.count("pair"),
            "peak_memory_bytes": plan.peak_memory,
            "codes": list(plan.codes),
        },
        "published": PUBLISHED[preset],
    }


def _iqr(xs: list[float]) -> float:
    import statistics

    if len(xs) < 4:
        return max(xs) - min(xs) if xs else 0.0
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def measured_row(pool: Any, layout: str, microbatches: int, steps: int) -> dict[str, Any]:
    """One measured row: plain vs interleaved step on the pool's gloo ranks (module docstring)."""
    import statistics
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import _jobs_dhelix as jobs

    res = pool.run(jobs.step_times, layout, microbatches, steps, timeout=900)
    row: dict[str, Any] = {"model": layout, "microbatches": microbatches, "steps": steps, "ranks": len(res)}
    for kind in ("plain", "fused", "interleaved"):
        per_step = [max(r[kind]["times"][i] for r in res) for i in range(steps)]
        row[f"{kind}_median_ms"] = statistics.median(per_step) * 1e3
        row[f"{kind}_iqr_ms"] = _iqr(per_step) * 1e3
    row["speedup"] = row["fused_median_ms"] / row["interleaved_median_ms"]  # interleaving alone
    row["speedup_vs_plain"] = row["plain_median_ms"] / row["interleaved_median_ms"]
    diffs = []
    for r in res:
        p = r["plain"]
        for q in (r["fused"], r["interleaved"]):
            diffs.append(float((p["loss"] - q["loss"]).abs()))
            diffs += [
                float((p["grads"][k] - q["grads"][k]).abs().max())
                for k in p["grads"]
                if p["grads"][k] is not None
            ]
    row["max_abs_diff"] = max(diffs)
    d = res[0]["interleaved"]["decision"] or {}
    row["kept"] = d.get("kept")
    row["same_plan_on_all_ranks"] = (
        len({(r["interleaved"]["decision"] or {}).get("plan", {}).get("digest") for r in res}) == 1
    )
    row["peak_sequential_bytes"] = d.get("sequential", {}).get("peak_memory_bytes")
    row["peak_interleaved_bytes"] = d.get("interleaved", {}).get("peak_memory_bytes")
    row["activation_peak_bytes"] = d.get("activation_peak_bytes")
    row["pairs"] = d.get("plan", {}).get("pairs")
    return row


def run_dhelix_report(small: bool = False, timing: bool = True, steps: int = 10) -> dict[str, Any]:
    """Capture the TP layer once (fake group of 8), then cut, price and plan it per preset; then
    (``timing``) measure the interleaved training step on 4 gloo ranks."""
    import commfuse
    from commfuse.costmodel import Topology
    from commfuse.models import llama
    from commfuse.testing.fake_pg import fake_mesh
    from commfuse.testing.graphs import capture_aot_graphs

    s = SMALL if small else FULL
    rows = []
    # one capture: the graphs do not depend on the preset (8 ranks on one node in both)
    with fake_mesh(TP, (TP,), ("tp",)) as mesh:
        commfuse.setup(topology=Topology.preset(PRESETS[0], num_nodes=1), mesh=mesh)
        try:
            t = time.perf_counter()
            cfg = llama.LlamaConfig(n_layers=1, dim=s["dim"], n_heads=s["n_heads"], ffn_dim=s["ffn_dim"])
            model = llama.parallelize_llama(
                llama.build_llama(cfg, seed=0), mesh["tp"], sequence_parallel=True
            )
            data = llama.make_inputs(cfg, s["batch"], s["seq"], rank=0, world_size=TP, sequence_parallel=True)
            graphs = capture_aot_graphs(model, data.inputs, loss=lambda out: llama.loss_fn(out, data))
            capture_s = time.perf_counter() - t
            for preset in PRESETS:
                rows.append(_plan_row(preset, layer_strands(graphs, Topology.preset(preset, num_nodes=1))))
        finally:
            commfuse.session.reset()
    measured: list[dict[str, Any]] = []
    if timing:
        from commfuse.tools.rank_pool import get_pool

        pool = get_pool(4)
        try:
            measured = [measured_row(pool, layout, m, steps) for layout in ("tp_sp", "moe") for m in (2, 4)]
        finally:
            pool.shutdown()
    return {
        "measured": measured,
        "measured_setup": (
            "4 gloo ranks on this machine (2 cores), compile_train_step, 4-layer models (dim 32), "
            "eager inner compiler + commfuse lowering; alternated per step, slowest rank, first step "
            "excluded"
        ),
        "workload": (
            f"Llama-style layer, TP+SP over {TP} ranks (one node); dim {s['dim']}, heads {s['n_heads']}, "
            f"ffn {s['ffn_dim']}, batch {s['batch']}, seq {s['seq']}, fp32; fake process group"
        ),
        "model": "AnalyticCostModel (roofline compute, NCCL collective model), backend nccl",
        "oef": "default_oef() -- illustrative factors after the paper's qualitative findings, NOT measured",
        "source": "DHelix (Wang et al., 'Hiding Communication Cost in Distributed LLM Training via "
        "Micro-batch Co-execution'), Sec. 6 'Evaluation'",
        "capture_s": capture_s,
        "rows": rows,
    }


def dhelix_tables(doc: dict[str, Any]) -> str:
    lines = [
        f"DHelix strand interleaving, predicted — {doc['workload']}",
        f"cost model: {doc['model']}; OEF: {doc['oef']}",
        "sequential = alpha backward then beta forward of the layer; interleaved = Eq. 2 plan (search_plans)",
        f"{'preset':<10}{'fwd us':>10}{'bwd us':>10}{'comm us':>10}{'sequential us':>15}{'interleaved us':>16}"
        f"{'speed-up':>10}{'pairs':>7}  backward order / published (end-to-end)",
    ]
    for r in doc["rows"]:
        comm = r["forward"]["comm_us"] + r["backward"]["comm_us"]
        lines.append(
            f"{r['preset']:<10}{r['forward']['time_us']:>10.1f}{r['backward']['time_us']:>10.1f}{comm:>10.1f}"
            f"{r['sequential_us']:>15.1f}{r['interleaved_us']:>16.1f}{r['speedup']:>9.3f}x"
            f"{r['plan']['pairs']:>7}  {r['backward_order']} / {r['published']}"
        )
    for r in doc["rows"]:
        lines.append(
            f"  {r['preset']}: forward {r['forward']['segments']} segments, backward "
            f"{r['backward']['segments']} segments, movable wgrad GEMMs {len(r['backward']['movable'])}"
        )
    lines.append(f"source of the published gains: {doc['source']}")
    if doc.get("measured"):
        lines += [
            "",
            f"DHelix interleaved training step, MEASURED — {doc['measured_setup']}",
            "plain = default pipeline; fused = same graph as interleaved, not interleaved (every forward, "
            "then every backward); speed-up = fused / interleaved (the interleaving alone)",
            f"{'model':<7}{'M':>3}{'plain ms':>10}{'IQR':>7}{'fused ms':>10}{'IQR':>7}{'interleaved ms':>16}"
            f"{'IQR':>7}{'speed-up':>10}{'vs plain':>10}"
            f"{'max |diff|':>12}{'peak seq B':>12}{'peak il B':>11}{'act seq B':>11}{'act il B':>10}  same plan",
        ]
        for r in doc["measured"]:
            act = r["activation_peak_bytes"] or {}
            lines.append(
                f"{r['model']:<7}{r['microbatches']:>3}{r['plain_median_ms']:>10.1f}{r['plain_iqr_ms']:>7.1f}"
                f"{r['fused_median_ms']:>10.1f}{r['fused_iqr_ms']:>7.1f}"
                f"{r['interleaved_median_ms']:>16.1f}{r['interleaved_iqr_ms']:>7.1f}{r['speedup']:>9.3f}x"
                f"{r['speedup_vs_plain']:>9.3f}x"
                f"{r['max_abs_diff']:>12.2e}{r['peak_sequential_bytes'] or 0:>12}"
                f"{r['peak_interleaved_bytes'] or 0:>11}{act.get('sequential', 0):>11}"
                f"{act.get('interleaved', 0):>10}  {r['same_plan_on_all_ranks']}"
            )
        lines.append(
            "peaks: the dhelix pass's simulated peak memory of the fused graph, non-interleaved order vs "
            "interleaved (no allocator statistics on CPU); act = peak minus the returned gradients"
        )
    return "\n".join(lines)
