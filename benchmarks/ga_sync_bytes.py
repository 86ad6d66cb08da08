"""Gradient-sync bytes per rank of a gradient-accumulation step, with and without syncing once per step.

What it runs
    The ``simple_fsdp_ga`` workload (SimpleFSDP ``fully_shard`` Llama, M micro-batches per step) on a
    ``fake`` process group of 4 ranks (one process, nothing communicated: only the graphs matter), as
    ``commfuse.compile_train_step`` captures it, once per pipeline: ``none`` (the graph as captured:
    one reduce_scatter per parameter per micro-batch, what the plain loop and Inductor issue),
    ``accumulate_gradient_sync`` alone, and the default pipeline. Per graph it prints the
    reduce_scatters and their logged bytes per rank as the IR counts them (NCCL count semantics:
    the per-rank receive count), and the pass's decisions.

    python benchmarks/ga_sync_bytes.py [--size s|d] [--json out.json]

What to expect: the joint graph holds 9 x L x M reduce_scatters (L layers) before the pass and
9 x L after it, and the logged gradient-sync bytes per rank drop by M (docs/train-step.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import commfuse
from benchmarks.workloads import get_workload
from commfuse.testing.fake_pg import fake_process_group
from commfuse.train_step import compile_train_step

WORLD = 4
PIPELINES: dict[str, list[str] | None] = {
    "none": [],
    "accumulate_gradient_sync": ["accumulate_gradient_sync"],
    "default": None,
}


def rows(size: str) -> list[dict[str, Any]]:
    out = []
    for label, passes in PIPELINES.items():
        with fake_process_group(WORLD):
            torch._dynamo.reset()
            built = get_workload(f"simple_fsdp_ga:{size}").build(WORLD, 0)
            step = compile_train_step(
                built.model,
                lambda loss: loss,
                microbatches=built.microbatches,
                reduction="sum",
                config=commfuse.Config(inner_compiler="eager", passes=passes),
            )
            step(*built.inputs)
        for rep in step.reports:
            rs = rep.analysis.by_kind.get("reduce_scatter") if rep.analysis else None
            rec = next((p for p in rep.passes if p.name == "accumulate_gradient_sync"), None)
            out.append(
                {
                    "pipeline": label,
                    "graph": rep.graph,
                    "microbatches": built.microbatches,
                    "reduce_scatters": rs.count if rs else 0,
                    "reduce_scatter_logged_bytes": int(rs.logged_bytes) if rs else 0,
                    "kinds": {k: t.count for k, t in rep.analysis.by_kind.items()} if rep.analysis else {},
                    "pass_counts": dict(rec.counts) if rec else None,
                    # the memory decision: the accumulators' extra live bytes (all kept sums), the
                    # input's simulated peak and the peak the pass predicts with them
                    "extra_live_bytes": sum(d["extra_live_bytes"] for d in rec.decisions if d.get("kept"))
                    if rec
                    else None,
                    "peak_bytes": [
                        max((d[k] for d in rec.decisions if k in d), default=None)
                        for k in ("peak_bytes_before", "peak_bytes_after")
                    ]
                    if rec
                    else None,
                    "refusals": list(rec.refusals) if rec else None,
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="s", help="simple_fsdp_ga size (s: test sized, d: declared)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    table = rows(args.size)
    print(f"simple_fsdp_ga:{args.size}, fake process group of {WORLD} ranks, eager inner compiler")
    print(
        "| pipeline | graph | M | reduce_scatters | reduce_scatter logged B/rank | collectives | pass counts "
        "| extra live B | peak B before -> after |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        kinds = " ".join(f"{k}={v}" for k, v in sorted(r["kinds"].items())) or "-"
        print(
            f"| {r['pipeline']} | {r['graph']} | {r['microbatches']} | {r['reduce_scatters']} "
            f"| {r['reduce_scatter_logged_bytes']:,} | {kinds} | {r['pass_counts'] or '-'} "
            f"| {r['extra_live_bytes'] if r['extra_live_bytes'] is not None else '-'} "
            f"| {' -> '.join(map(str, r['peak_bytes'])) if r['peak_bytes'] else '-'} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
