"""The Centauri partition report: which scheme the search chose per collective, and the predicted gain.

What it runs
    A SimpleFSDP (``fully_shard``) Llama-style decoder layer on a DGX-H100 x2
    topology (16 ranks, two nodes of eight), traced on a ``fake`` process group
    (graphs for 16 ranks from one process, nothing communicated). ``commfuse.setup``
    creates the topology's intra-/inter-node sub-groups first, as a job would.
    The forward and backward graphs are each optimised twice with the analytic
    DGX-H100 cost model as the judge:

    * ``before``: ``sink_waits`` only (the schedule commfuse produces without
      partitioning);
    * ``after``: ``centauri_partition`` then ``sink_waits``.

    and both are simulated by the same estimator (``costmodel.simulator``). The
    table lists, per collective the search looked at, the scheme it chose (or
    "kept"), and per graph the predicted makespan, exposed communication and
    peak memory before/after.

    python benchmarks/run.py --partition-report [--json out.json]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TOPOLOGY = ("dgx-h100", 2)
LAYER = dict(n_layers=1, dim=2048, n_heads=16, ffn_dim=8192)
BATCH_PER_RANK, SEQ = 1, 2048

__all__ = ["run_partition_report", "partition_tables"]


@dataclass
class _GraphRow:
    graph: str
    collectives: int
    before: dict[str, float]
    after: dict[str, float]
    decisions: list[dict[str, Any]]
    refusals: list[str]
    seconds: float


def _optimise(gm, passes, topo):
    import commfuse
    from commfuse.costmodel import AnalyticCostModel
    from commfuse.costmodel.simulator import simulate

    commfuse.optimize(gm, commfuse.Config(passes=passes, topology=topo, strict=True), graph_kind="graph")
    rep = commfuse.last_report(gm)
    sim = simulate(gm, AnalyticCostModel(topo, backend="nccl"))
    return rep, sim


def run_partition_report() -> dict[str, Any]:
    import copy

    import torch.fx as fx

    import commfuse
    from commfuse.costmodel import Topology
    from commfuse.models import llama, simple_fsdp
    from commfuse.testing.fake_pg import fake_mesh
    from commfuse.testing.graphs import capture_aot_graphs

    preset, nodes = TOPOLOGY
    topo = Topology.preset(preset, num_nodes=nodes)
    world = topo.world_size
    rows: list[_GraphRow] = []
    with fake_mesh(world) as mesh:
        commfuse.setup(topology=topo)
        try:
            cfg = llama.LlamaConfig(vocab=None, **LAYER)
            model = simple_fsdp.data_parallel(llama.build_llama(cfg, seed=0), mesh, "fully_shard")
            batch = simple_fsdp.make_inputs(cfg, BATCH_PER_RANK * world, SEQ, rank=0, world_size=world)
            graphs = capture_aot_graphs(model, batch.inputs, loss=lambda out: simple_fsdp.loss_fn(out, batch))
            for kind in ("forward", "backward"):
                base = graphs[kind]
                before_gm = fx.GraphModule(base, copy.deepcopy(base.graph))
                after_gm = fx.GraphModule(base, copy.deepcopy(base.graph))
                _, sim_before = _optimise(before_gm, ["sink_waits"], topo)
                rep, sim_after = _optimise(after_gm, ["centauri_partition", "sink_waits"], topo)
                search = next(p for p in rep.passes if p.name == "centauri_partition")
                rows.append(
                    _GraphRow(
                        kind,
                        search.counts.get("collectives_searched", 0),
                        sim_before.summary(),
                        sim_after.summary(),
                        search.decisions,
                        search.refusals,
                        search.seconds,
                    )
                )
        finally:
            commfuse.session.reset()
    return {
        "workload": f"SimpleFSDP Llama layer (dim {LAYER['dim']}, ffn {LAYER['ffn_dim']}, {LAYER['n_heads']} heads, "
        f"batch {BATCH_PER_RANK}/rank, seq {SEQ}, fp32)",
        "topology": f"{preset} x{nodes} ({world} ranks)",
        "graphs": [row.__dict__ for row in rows],
    }


def partition_tables(doc: dict[str, Any]) -> str:
    lines = [
        f"Centauri partition search — {doc['workload']} on {doc['topology']} (predicted, analytic model)"
    ]
    lines.append(
        f"{'graph':<9}{'collectives':>12}{'makespan us':>22}{'exposed comm us':>22}"
        f"{'peak MiB':>20}{'search s':>10}"
    )
    for g in doc["graphs"]:
        b, a = g["before"], g["after"]
        lines.append(
            f"{g['graph']:<9}{g['collectives']:>12}"
            f"{b['makespan_us']:>10.1f} -> {a['makespan_us']:<8.1f}"
            f"{b['exposed_comm_us']:>10.1f} -> {a['exposed_comm_us']:<8.1f}"
            f"{b['peak_memory_bytes'] / 2**20:>8.1f} -> {a['peak_memory_bytes'] / 2**20:<8.1f}"
            f"{g['seconds']:>10.2f}"
        )
    for g in doc["graphs"]:
        lines.append(f"\n{g['graph']}: scheme per collective")
        for d in g["decisions"]:
            lines.append(
                f"  {d['collective']:<28}{d['kind']:<16}{d['scheme']:<32}"
                f"exposed {d['exposed_before_us']:.1f} -> {d['exposed_after_us']:.1f} us "
                f"({d['leaves_scored']} leaves)"
            )
        for r in g["refusals"]:
            lines.append(f"  {r}")
    return "\n".join(lines)
