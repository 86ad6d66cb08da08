"""The Lagom report: per-collective communicator settings and their PREDICTED effect.

What it runs
    The three blocks of ``overlap_vs_inductor`` (Llama TP+SP over one node, SimpleFSDP over
    16 ranks, SP attention + GShard MoE with EP over one node), captured as forward and
    backward ATen graphs on a ``fake`` process group of DGX-H100 x2 (16 ranks), then
    scheduled by commfuse's default pipeline (``Config(topology=DGX-H100 x2)``). On each
    scheduled graph Lagom's search (``commfuse.costmodel.lagom``) runs twice:

    * ``advisory``: no communicator pool; NC doubles 1..32 with the chunk tied to it (what a
      patched NCCL could run per collective; stock NCCL cannot apply it);
    * ``pool``: the pool ``commfuse.setup(communicator_ctas=POOL)`` would create on NCCL for
      the world and every mesh-dim group; NC restricted to the pool's channel counts, chunk
      at NCCL's process-wide default.

    Printed per graph: the predicted makespan with NCCL's default resources and with Lagom's
    settings, the search's simulator evaluations against brute force's combination count, the
    chosen settings (channel histogram), and the estimated memory of the extra communicators
    (``costmodel.lagom.MEMORY_FORMULA``). Every number is a prediction of the analytic
    cost model and the simulator, not a measurement (no GPU was used).

    python benchmarks/run.py --lagom-report [--json out.json]
"""

from __future__ import annotations

import collections
import time
from typing import Any

TOPOLOGY = ("dgx-h100", 2)
POOL = ((1, 1), (2, 2), (4, 4), (8, 8))

__all__ = ["lagom_tables", "run_lagom_report"]


def _settings_summary(settings: dict[str, Any]) -> dict[str, int]:
    hist = collections.Counter(
        f"NC{s.channels}" + ("" if s.source != "pool" else "*") for s in settings.values()
    )
    return dict(sorted(hist.items(), key=lambda kv: int(kv[0][2:].rstrip("*"))))


def _search_row(gm: Any, model: Any, pool: Any) -> dict[str, Any]:
    from commfuse.costmodel.lagom import lagom_search

    t = time.perf_counter()
    r = lagom_search(gm, model, pool=pool)
    return {
        "makespan_default_us": r.makespan_default_us,
        "makespan_us": r.makespan_us,
        "speedup": r.speedup,
        "compute_default_us": r.default.compute_us if r.default else 0.0,
        "compute_us": r.chosen.compute_us if r.chosen else 0.0,
        "exposed_default_us": r.default.exposed_comm_us if r.default else 0.0,
        "exposed_us": r.chosen.exposed_comm_us if r.chosen else 0.0,
        "evaluations": r.evaluations,
        "brute_force_combinations": r.brute_force_combinations,
        "kept_default": r.kept_default,
        "settings": {k: v.to_meta() for k, v in r.settings.items()},
        "channels": _settings_summary(r.settings),
        "extra_communicators": dict(r.extra_communicators),
        "extra_memory_bytes": r.extra_memory_bytes,
        "notes": list(r.notes),
        "search_s": time.perf_counter() - t,
    }


def _pool_memory(plan: list[Any], nc0: int, rank: int = 0) -> dict[str, Any]:
    """Estimated buffer memory of every pool group ``rank`` belongs to (what set-up costs)."""
    from commfuse.costmodel.lagom import communicator_memory_bytes, effective_channels

    mine = [p for p in plan if rank in p.ranks]
    return {
        "groups_total": len(plan),
        "groups_on_rank": len(mine),
        "bytes_on_rank": sum(
            communicator_memory_bytes(effective_channels(p.min_ctas, p.max_ctas, nc0)) for p in mine
        ),
    }


def run_lagom_report(small: bool = False, blocks: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Capture, schedule, search; ``small=True``: tiny shapes (tests)."""
    import commfuse
    from commfuse.costmodel import AnalyticCostModel, Topology
    from commfuse.costmodel.lagom import MEMORY_FORMULA, CommunicatorPool
    from commfuse.testing.fake_pg import fake_mesh

    from benchmarks.overlap_vs_inductor import _BLOCKS, FULL, SMALL, _commfuse, _describe

    preset, nodes = TOPOLOGY
    topo = Topology.preset(preset, num_nodes=nodes)
    model = AnalyticCostModel(topo, backend="nccl")
    sizes = SMALL if small else FULL
    out: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    for block, (shape, names, capture) in _BLOCKS.items():
        if blocks is not None and block not in blocks:
            continue
        with fake_mesh(topo.world_size, shape, names) as mesh:
            commfuse.setup(topology=topo, mesh=mesh)
            try:
                plan = commfuse.session.communicator_pool_plan(topo.world_size, POOL, mesh=mesh)
                pool = CommunicatorPool.from_plan(plan)
                graphs = capture(mesh, sizes[block])
                rows = []
                for kind in ("forward", "backward"):
                    gm, sched_s = _commfuse(graphs[kind], topo, kind, None)
                    rows.append(
                        {
                            "graph": kind,
                            "nodes": len(gm.graph.nodes),
                            "schedule_s": sched_s,
                            "advisory": _search_row(gm, model, None),
                            "pool": _search_row(gm, model, pool),
                        }
                    )
            finally:
                commfuse.session.reset()
        out.append(
            {
                "block": block,
                "workload": _describe(block, sizes[block]),
                "graphs": rows,
                "pool_memory": _pool_memory(plan, topo.nccl_channels),
            }
        )
    return {
        "topology": f"{preset} x{nodes} ({topo.world_size} ranks), analytic model, backend nccl",
        "predicted": True,
        "small": small,
        "pool": [list(p) for p in POOL],
        "memory_formula": MEMORY_FORMULA,
        "blocks": out,
        "wall_s": time.perf_counter() - t_all,
    }


def _mib(b: float) -> str:
    return f"{b / 2**20:.0f} MiB"


def lagom_tables(doc: dict[str, Any]) -> str:
    lines = [
        f"Lagom per-collective communicator settings -- PREDICTED (analytic cost model + simulator, no GPU "
        f"measurement) on {doc['topology']}",
        "default = NCCL's default resources (16 channels, 2 MiB chunk) for every collective; "
        "advisory = NC 1..32 with the chunk tied to NC (not applicable on stock NCCL); "
        f"pool = communicator_ctas={[tuple(p) for p in doc['pool']]} (NC per communicator, chunk process-wide)",
        f"{'':<2}{'graph':<10}{'search':<9}{'makespan us (default -> lagom)':>33}{'speedup':>9}"
        f"{'exposed us':>22}{'evals':>7}{'brute force':>13}  channels chosen (* = pool group)",
    ]
    for b in doc["blocks"]:
        lines.append(f"\n{b['block']}: {b['workload']}")
        for g in b["graphs"]:
            for mode in ("advisory", "pool"):
                r = g[mode]
                lines.append(
                    f"  {g['graph'] if mode == 'advisory' else '':<10}{mode:<9}"
                    f"{r['makespan_default_us']:>15.1f} -> {r['makespan_us']:<14.1f}{r['speedup']:>9.3f}"
                    f"{r['exposed_default_us']:>10.1f} -> {r['exposed_us']:<8.1f}{r['evaluations']:>7}"
                    f"{r['brute_force_combinations']:>13.2e}  "
                    + ", ".join(f"{k} x{v}" for k, v in r["channels"].items())
                    + ("  (defaults kept)" if r["kept_default"] else "")
                )
        pm = b["pool_memory"]
        used = max((g["pool"]["extra_memory_bytes"] for g in b["graphs"]), default=0)
        lines.append(
            f"  communicator pool: {pm['groups_total']} groups created at set-up, {pm['groups_on_rank']} on "
            f"rank 0 ~ {_mib(pm['bytes_on_rank'])} of NCCL buffers (estimate); the settings chosen use "
            f"~ {_mib(used)} of them on one graph"
        )
    lines.append(f"\nMemory estimate per communicator: {doc['memory_formula']}")
    lines.append(f"wall time {doc['wall_s']:.1f} s")
    return "\n".join(lines)
