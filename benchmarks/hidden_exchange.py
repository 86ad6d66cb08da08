"""Hidden-dim exchange partition on torchtitan's dropless MoE block: predicted, per exchange.

    python benchmarks/run.py --hidden-exchange [--json out.json]
    python benchmarks/hidden_exchange.py [--json out.json]

The block is torchtitan's token dispatcher written as graph all_to_alls
(:func:`commfuse.testing.dropless.dropless_joint_graph`: counts exchanged, split sizes read back
as unbacked symbols, rows sent, bfloat16 SwiGLU grouped experts, rows sent back; forward and
backward in one graph), 8 expert-parallel ranks with 2 local experts, on one DGX-H100 node and on
two. For each size: the exchanges' bytes as the cost model prices them (balanced routing vs the
flat symbol hint), what ``hidden_exchange_partition`` decides for every exchange (its block count
and prediction, or why not), and the whole graph's predicted makespan and exposed communication
without and with the pass, and with the pass forced to two blocks everywhere it applies (the
count graph_trainer's ``ep_chunk_pass`` uses, though graph_trainer cuts rows, which this graph
cannot: see docs/hidden-exchange-partition.md). Predicted, not timed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import commfuse  # noqa: E402
from commfuse.costmodel.collectives import concrete  # noqa: E402
from commfuse.costmodel.topology import Topology  # noqa: E402
from commfuse.passmgr.context import PassContext  # noqa: E402
from commfuse.testing.dropless import dropless_joint_graph  # noqa: E402
from commfuse.testing.fake_pg import fake_process_group  # noqa: E402
from commfuse.testing.graphs import _copy  # noqa: E402
from commfuse.transforms.partition_search import score_graph  # noqa: E402

PASS = "hidden_exchange_partition"
RANKS, LOCAL_EXPERTS = 8, 2
# (tokens per rank x top-k rows sent, hidden, expert ffn): DeepSeek-V3-like proportions, scaled
SIZES = ((4096, 2048, 1408), (8192, 4096, 2048))
TOPOLOGIES = (("dgx-h100", 1), ("dgx-h100", 2))


def _score(gm, topo) -> dict[str, float]:
    s = score_graph(PassContext(_copy(gm), commfuse.Config(topology=topo), topology=topo))
    return {"makespan_us": s.makespan_us, "exposed_us": s.exposed_comm_us}


def row(rows: int, dim: int, ffn: int, preset: str, nodes: int) -> dict[str, Any]:
    topo = Topology.preset(preset, num_nodes=nodes)
    if topo.world_size != RANKS:
        topo = topo.model_copy(update={"ranks_per_node": RANKS // nodes, "world_size": RANKS})
    with fake_process_group(RANKS):
        gm = dropless_joint_graph(RANKS, LOCAL_EXPERTS, rows, dim, ffn)
        ctx = PassContext(gm, commfuse.Config(topology=topo), topology=topo)
        exchanges = [
            c
            for c in ctx.ir.collectives
            if c.kind.value == "all_to_all" and c.input_shapes[0] is not None and len(c.input_shapes[0]) == 2
        ]
        priced = [
            {
                "exchange": c.name,
                "balanced_bytes": concrete(c.input_bytes, ctx.cost.model.symbol_hint),
                "flat_hint_bytes": concrete(c.input_bytes),
            }
            for c in exchanges
        ]
        whole = _score(gm, topo)
        chosen = _copy(gm)
        commfuse.optimize(chosen, commfuse.Config(passes=[PASS], topology=topo))
        rec = commfuse.last_report(chosen).passes[-1]
        forced = _copy(gm)
        commfuse.optimize(forced, commfuse.Config(passes=[PASS], topology=topo, workload_chunks=2))
        frec = commfuse.last_report(forced).passes[-1]
        return {
            "rows": rows,
            "dim": dim,
            "ffn": ffn,
            "topology": f"{preset} x{nodes}",
            "priced": priced,
            "whole": whole,
            "pass": _score(chosen, topo),
            "two_blocks": _score(forced, topo),
            "decisions": [d["decision"] for d in rec.decisions],
            "refusals": [r for r in rec.refusals if "not 2-D" not in r],
            "two_block_cuts": len(frec.decisions),
        }


def run_hidden_exchange() -> dict[str, Any]:
    rows = [row(r, d, f, p, n) for r, d, f in SIZES for p, n in TOPOLOGIES]
    return {
        "rows": rows,
        "settings": {
            "what": f"torchtitan-style dropless MoE block, forward + backward in one graph, {RANKS} EP ranks x "
            f"{LOCAL_EXPERTS} local experts, bfloat16 grouped SwiGLU experts; rows = tokens x top-k sent "
            "per rank; split sizes priced at balanced routing; predicted by commfuse's simulator, not timed",
            "two_blocks": "two blocks: the pass forced to Config.workload_chunks=2 (graph_trainer's count) on every "
            "exchange it can cut",
        },
    }


def hidden_exchange_tables(report: dict[str, Any]) -> str:
    lines = [
        "hidden_exchange_partition on a dropless MoE block (predicted, us)",
        "",
        f"{'rows x dim x ffn':<18} {'topology':<12} {'whole':>16} {'pass':>16} {'two blocks':>16}  decisions",
    ]
    for r in report["rows"]:
        cell = lambda s: f"{s['makespan_us']:.1f}/{s['exposed_us']:.1f}"  # noqa: E731
        lines.append(
            f"{r['rows']}x{r['dim']}x{r['ffn']:<8} {r['topology']:<12} {cell(r['whole']):>16} "
            f"{cell(r['pass']):>16} {cell(r['two_blocks']):>16}  {len(r['decisions'])} cut"
        )
        for d in r["decisions"]:
            lines.append(f"    cut: {d}")
        for x in r["refusals"]:
            lines.append(f"    whole: {x}")
    lines += [
        "",
        "cells: makespan / exposed communication",
        report["settings"]["what"],
        report["settings"]["two_blocks"],
        "",
        "exchange bytes per rank as priced (balanced routing vs the flat symbol hint 4096):",
    ]
    for p in report["rows"][0]["priced"]:
        lines.append(f"    {p['exchange']}: {p['balanced_bytes']} vs {p['flat_hint_bytes']}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    report = run_hidden_exchange()
    print(hidden_exchange_tables(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
