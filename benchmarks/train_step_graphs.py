"""Collectives of the joint graph `commfuse.compile_train_step` captures, for 1 / 2 / 4 micro-batches.

What it runs
    A 1-layer Llama block (dim 32) made data parallel with SimpleFSDP (``fully_shard``, and
    ``replicate`` = DDP) and tensor + sequence parallel, on a ``fake`` process group of 4 ranks
    (one process, nothing communicated: only the graphs matter here). For each micro-batch count
    the step is compiled once with the eager inner compiler and the pipeline's analysis (as
    ``commfuse.analyze`` gives it) of every graph it saw (joint, forward, backward) is tabulated:
    collectives by kind, logged bytes per rank, node count, and the Dynamo graph count
    (1 = every micro-batch is in one graph).

    python benchmarks/train_step_graphs.py [--passes none|default] [--json out.json]

What to expect (docs/train-step.md has the measured table): SimpleFSDP's parametrization
runs once per parameter access, so the joint graph holds one all_gather per parameter PER
MICRO-BATCH (AOTAutograd's partitioner CSEs them to one per parameter in the forward) and
one reduce_scatter (DDP: all_reduce) per parameter per micro-batch in the backward -- the
gradient reductions the plain accumulation loop issues. Regrouping them is the model-level
scheduling decision of Centauri Eq. 2, which builds on this graph.
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
from commfuse.models import llama, simple_fsdp
from commfuse.testing.fake_pg import fake_mesh
from commfuse.train_step import compile_train_step

WORLD = 4
CFG = llama.LlamaConfig(n_layers=1, dim=32, n_heads=4, ffn_dim=64)
BATCH, SEQ = 4, 8


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).pow(2).mean()


def _model(layout: str, mesh) -> torch.nn.Module:
    model = llama.build_llama(CFG, seed=0)
    if layout in ("simple_fsdp", "ddp"):
        return simple_fsdp.data_parallel(
            model, mesh, "fully_shard" if layout == "simple_fsdp" else "replicate"
        )
    return llama.parallelize_llama(model, mesh, sequence_parallel=True)


def graph_rows(layout: str, microbatches: int, passes: list[str] | None) -> list[dict[str, Any]]:
    """One row per graph the pipeline compiled for one step of `layout` with `microbatches`."""
    with fake_mesh(WORLD) as mesh:
        torch._dynamo.reset()
        cfg = commfuse.Config(
            inner_compiler="eager",
            passes=passes,
            group_roles={mesh.get_group().group_name: "tp"} if layout == "tp_sp" else {},
        )
        step = compile_train_step(_model(layout, mesh), _loss, microbatches=microbatches, config=cfg)
        seq = SEQ // WORLD if layout == "tp_sp" else SEQ  # SP: this rank's sequence shard
        gen = torch.Generator().manual_seed(0)
        x, y = (torch.randn(BATCH, seq, CFG.dim, generator=gen) for _ in range(2))
        step(x, targets=y)
        rows = []
        for rep in step.reports:
            a = rep.analysis
            rows.append(
                {
                    "layout": layout,
                    "microbatches": microbatches,
                    "graph": rep.graph,
                    "dynamo_graphs": step.graph_count,
                    "nodes": a.num_nodes if a else None,
                    "collectives": {k: t.count for k, t in a.by_kind.items()} if a else {},
                    "logged_bytes": a.total.logged_bytes if a else None,
                }
            )
        return rows


def _fmt(row: dict[str, Any]) -> str:
    kinds = " ".join(f"{k}={v}" for k, v in sorted(row["collectives"].items())) or "-"
    return (
        f"| {row['layout']} | {row['microbatches']} | {row['graph']} | {row['dynamo_graphs']} | {row['nodes']} "
        f"| {kinds} | {row['logged_bytes']} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--passes",
        choices=["none", "default"],
        default="default",
        help="'none': the graph as captured; 'default': after the default pipeline",
    )
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    passes = [] if args.passes == "none" else None
    rows = [
        r
        for layout in ("simple_fsdp", "ddp", "tp_sp")
        for m in (1, 2, 4)
        for r in graph_rows(layout, m, passes)
    ]
    print(f"compile_train_step graphs, fake process group of {WORLD} ranks, passes={args.passes}")
    print("| layout | micro-batches | graph | dynamo graphs | nodes | collectives | logged B/rank |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(_fmt(r))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
