"""The overlap-scheduler report: predicted makespan / exposed comm / peak memory before and after.

What it runs
    The SimpleFSDP (``fully_shard``) Llama-style decoder layer of ``partition_report`` on
    DGX-H100 x2 (16 ranks, two nodes of eight), traced on a ``fake`` process group. The
    forward and backward graphs are each scheduled twice, both judged by the same analytic
    DGX-H100 estimator (``costmodel.simulator``):

    * ``before``: ``sink_waits`` only (what commfuse's default pipeline does to their order);
    * ``after``: ``schedule_overlap`` (greedy list schedule + CP-SAT windows).

    It also reports the pass's compile time on a 32-layer SimpleFSDP graph (small widths,
    forward and backward, 8 fake ranks), and the whole default pipeline's
    (``commfuse.optimize`` with ``Config()``: chimera, schedule_overlap, bucket_collectives,
    sink_waits) on that model's forward, backward and joint forward+backward graph (the
    whole training step, every stage on one graph), against the project's compile-time goal
    (docs/benchmarks.md: the whole default pipeline on a 32-layer forward+backward graph in <= 5 s).

    python benchmarks/run.py --schedule-report [--json out.json]
"""

from __future__ import annotations

import copy
import time
from typing import Any

from benchmarks.partition_report import BATCH_PER_RANK, LAYER, SEQ, TOPOLOGY

DEEP = dict(n_layers=32, dim=256, n_heads=4, ffn_dim=1024)
DEEP_WORLD, DEEP_SEQ = 8, 64
COMPILE_GOAL_S = 5.0  # docs/benchmarks.md, "Compile-time scaling"

__all__ = ["run_schedule_report", "schedule_tables"]


def _scheduled(gm, passes, topo, **cfg):
    import torch.fx as fx

    import commfuse
    from commfuse.costmodel import AnalyticCostModel
    from commfuse.costmodel.simulator import simulate

    gm = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    t = time.perf_counter()
    commfuse.optimize(
        gm, commfuse.Config(passes=passes, topology=topo, strict=True, **cfg), graph_kind="graph"
    )
    seconds = time.perf_counter() - t
    rep = commfuse.last_report(gm)
    return rep, simulate(gm, AnalyticCostModel(topo, backend="nccl")), seconds


def _fsdp_graphs(mesh, cfg_kw: dict, batch: int, seq: int):
    from commfuse.models import llama, simple_fsdp
    from commfuse.testing.graphs import capture_aot_graphs

    world = mesh.size()
    cfg = llama.LlamaConfig(vocab=None, **cfg_kw)
    model = simple_fsdp.data_parallel(llama.build_llama(cfg, seed=0), mesh, "fully_shard")
    b = simple_fsdp.make_inputs(cfg, batch * world, seq, rank=0, world_size=world)
    return capture_aot_graphs(model, b.inputs, loss=lambda out: simple_fsdp.loss_fn(out, b))


def _default_pipeline(gm, kind: str) -> dict[str, Any]:
    """Wall time of ``commfuse.optimize(gm, Config())`` (every stage, as for a make_fx training step)."""
    import torch.fx as fx

    import commfuse

    gm = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    t = time.perf_counter()
    commfuse.optimize(gm, commfuse.Config(), graph_kind=kind)
    seconds = time.perf_counter() - t
    rep = commfuse.last_report(gm)
    return {
        "graph": kind,
        "nodes": len(gm.graph.nodes),
        "seconds": seconds,
        "passes": {p.name: round(p.seconds, 3) for p in rep.passes},
    }


def run_schedule_report(deep: bool = True) -> dict[str, Any]:
    from commfuse.costmodel import Topology
    from commfuse.testing.fake_pg import fake_mesh

    preset, nodes = TOPOLOGY
    topo = Topology.preset(preset, num_nodes=nodes)
    rows = []
    with fake_mesh(topo.world_size) as mesh:
        graphs = _fsdp_graphs(mesh, LAYER, BATCH_PER_RANK, SEQ)
        for kind in ("forward", "backward"):
            _, sim_b, _ = _scheduled(graphs[kind], ["sink_waits"], topo)
            rep, sim_a, secs = _scheduled(graphs[kind], ["schedule_overlap"], topo)
            rec = rep.passes[0]
            d = rec.decisions[0]
            rows.append(
                {
                    "graph": kind,
                    "collectives": d["collectives"],
                    "nodes": d["nodes"],
                    "before": sim_b.summary(),
                    "after": sim_a.summary(),
                    "kept": d["kept"],
                    "greedy": d["greedy"],
                    "cpsat": d["cpsat"],
                    "counts": rec.counts,
                    "seconds": secs,
                }
            )
    deep_rows = []
    if deep:
        deep_topo = Topology.preset(preset, num_nodes=1)
        with fake_mesh(DEEP_WORLD) as mesh:
            graphs = _fsdp_graphs(mesh, DEEP, 1, DEEP_SEQ)
            for kind in ("forward", "backward"):
                for cps in (0, 60):
                    rep, sim_a, secs = _scheduled(
                        graphs[kind], ["schedule_overlap"], deep_topo, schedule_cpsat_max_nodes=cps
                    )
                    deep_rows.append(
                        {
                            "graph": kind,
                            "nodes": len(graphs[kind].graph.nodes),
                            "cpsat_max_nodes": cps,
                            "pass_seconds": rep.passes[0].seconds,
                            "optimize_seconds": secs,
                            "changed": rep.passes[0].changed,
                        }
                    )
            pipeline_rows = [
                _default_pipeline(graphs[kind], kind) for kind in ("forward", "backward", "joint")
            ]
    return {
        "workload": f"SimpleFSDP Llama layer (dim {LAYER['dim']}, ffn {LAYER['ffn_dim']}, {LAYER['n_heads']} heads, "
        f"batch {BATCH_PER_RANK}/rank, seq {SEQ}, fp32)",
        "topology": f"{preset} x{nodes} ({topo.world_size} ranks)",
        "graphs": rows,
        "deep": {
            "workload": f"SimpleFSDP Llama {DEEP} on {DEEP_WORLD} fake ranks, seq {DEEP_SEQ}",
            "rows": deep_rows,
            "pipeline": pipeline_rows if deep else [],
            "goal_s": COMPILE_GOAL_S,
        },
    }


def schedule_tables(doc: dict[str, Any]) -> str:
    lines = [
        f"Overlap scheduler — {doc['workload']} on {doc['topology']} (predicted, analytic model)",
        "before = sink_waits only, after = schedule_overlap",
    ]
    lines.append(
        f"{'graph':<9}{'colls':>6}{'makespan us':>24}{'exposed comm us':>24}{'peak MiB':>22}"
        f"{'kept':>28}{'pass s':>8}"
    )
    for g in doc["graphs"]:
        b, a = g["before"], g["after"]
        lines.append(
            f"{g['graph']:<9}{g['collectives']:>6}"
            f"{b['makespan_us']:>11.1f} -> {a['makespan_us']:<9.1f}"
            f"{b['exposed_comm_us']:>11.1f} -> {a['exposed_comm_us']:<9.1f}"
            f"{b['peak_memory_bytes'] / 2**20:>9.1f} -> {a['peak_memory_bytes'] / 2**20:<9.1f}"
            f"{g['kept']:>28}{g['seconds']:>8.2f}"
        )
    for g in doc["graphs"]:
        c = g["cpsat"]
        lines.append(
            f"  {g['graph']}: greedy variants "
            + "; ".join(f"{v['priority']} {v['makespan_us']:.1f} us" for v in g["greedy"])
            + f"; CP-SAT {c.get('makespan_us', '-')} us vs greedy {c.get('greedy_makespan_us', '-')} us "
            f"({len(c.get('windows', []))} windows, {c.get('deterministic_time_s', 0)} det-s)"
        )
    deep = doc.get("deep", {})
    if deep.get("rows"):
        lines.append(f"\nCompile time of schedule_overlap — {deep['workload']}")
        for r in deep["rows"]:
            lines.append(
                f"  {r['graph']:<9}{r['nodes']:>6} nodes  cpsat_max_nodes={r['cpsat_max_nodes']:<3}"
                f" pass {r['pass_seconds']:.2f} s (optimize incl. verifier {r['optimize_seconds']:.2f} s)"
            )
    if deep.get("pipeline"):
        goal = deep["goal_s"]
        lines.append(
            f"Whole default pipeline (commfuse.optimize, Config()) — goal <= {goal:.0f} s on a 32-layer "
            "forward+backward graph"
        )
        for r in deep["pipeline"]:
            passes = ", ".join(f"{k} {v:.2f}" for k, v in r["passes"].items())
            verdict = "within goal" if r["seconds"] <= goal else "OVER GOAL"
            lines.append(
                f"  {r['graph']:<9}{r['nodes']:>6} nodes  {r['seconds']:.2f} s  {verdict}  ({passes})"
            )
        split = sum(r["seconds"] for r in deep["pipeline"] if r["graph"] in ("forward", "backward"))
        lines.append(
            f"  forward + backward graphs together: {split:.2f} s "
            f"({'within goal' if split <= goal else 'OVER GOAL'})"
        )
    return "\n".join(lines)
