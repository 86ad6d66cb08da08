"""The volume report of every example workload: bytes per rank before and after commfuse.

What it runs
    Each workload of the quick suite (size ``s``, world size 2, as the stored benchmark runs)
    is built on a ``fake`` process group (graphs for the world size from one process; nothing
    is communicated), compiled with ``backend=commfuse`` (default pipeline, eager inner
    compiler, the workload's declared group roles) with dumps on, and run for one forward +
    backward. :func:`commfuse.reports.volume_from_dump_dir` then gives, per rank: the joint
    graph as traced (before) against the forward + backward graphs as lowered (after), per
    kind, role and direction, the Table 1 formula checks and the passes' reasons.

    Where a stored benchmark run has the same workload (``benchmarks/results/*.json``, world
    size 2), its ``eager`` and ``commfuse-eager`` wire bytes per rank are printed next to the
    report's before/after: both are ``commfuse.analyze`` counts of the same programs, so they
    must agree (collective counts may differ: runs stored before bucketing and the gloo
    reduce_scatter lowering joined the pipeline have more, smaller collectives).

    python benchmarks/run.py --volume-report [--json out.json]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

WORKLOADS = (
    "llama_tp_sp:s",
    "llama_tp:s",
    "moe_ep:s",
    "simple_fsdp:s",
    "dp:s",
    "moe_tp_ep:s",
    "moe_sp_ep_sp:s",
)
WORLD = 2
_RESULTS = Path(__file__).resolve().parent / "results"

__all__ = ["run_volume_report", "volume_tables"]


def _stored(world: int) -> dict[tuple[str, str], tuple[int, str]]:
    """(workload, baseline) -> (wire bytes per rank, file) from stored runs of this world size, newest last."""
    out: dict[tuple[str, str], tuple[int, str]] = {}
    for f in sorted(_RESULTS.glob("*.json")):
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("settings", {}).get("world_size") != world:
            continue
        for r in doc.get("results", []):
            wire = (r.get("metrics") or {}).get("wire_bytes")
            if isinstance(wire, int) and not r.get("error"):
                out[(r["workload"], r["baseline"])] = (wire, f.name)
    return out


def _one(name: str, world: int) -> dict[str, Any]:
    import torch

    import commfuse
    from benchmarks.workloads import get_workload
    from commfuse.reports import volume_from_dump_dir
    from commfuse.testing.fake_pg import fake_process_group

    with tempfile.TemporaryDirectory() as d, fake_process_group(world, rank=0):
        built = get_workload(name).build(world, 0)
        be = commfuse.backend(
            inner_compiler="eager", dump_dir=d, group_roles=dict(built.roles), svg_max_nodes=1
        )
        torch._dynamo.reset()
        out = torch.compile(built.model, backend=be)(*built.inputs)
        built.loss(out).backward()
        rep = volume_from_dump_dir(d)
    return {
        "workload": name,
        "world_size": world,
        "report": rep.to_dict(),
        "table": rep.table(max_reasons=3),
        "before_wire": rep.total("before").wire_bytes,
        "after_wire": rep.total("after").wire_bytes,
        "before_count": rep.total("before").count,
        "after_count": rep.total("after").count,
        "formula_checked": sum(1 for c in rep.collectives() if c.formula is not None),
        "formula_differ": len(rep.formula_mismatches()),
        "rewritten_before_autograd": [
            p.name for g in rep.graphs if g.kind == "dynamo" for p in g.passes if p.changed
        ],
    }


def run_volume_report(workloads: tuple[str, ...] = WORKLOADS, world: int = WORLD) -> dict[str, Any]:
    stored = _stored(world)
    rows = []
    for name in workloads:
        row = _one(name, world)
        for side, baseline in (("before", "eager"), ("after", "commfuse-eager")):
            hit = stored.get((name, baseline))
            row[f"stored_{side}_wire"], row[f"stored_{side}_file"] = hit if hit else (None, None)
        rows.append(row)
    return {"world_size": world, "workloads": rows}


def volume_tables(doc: dict[str, Any]) -> str:
    lines = [
        f"Volume report, world size {doc['world_size']} (fake process group; bytes per rank, wire = ring "
        "conventions; before = joint graph as traced, after = forward + backward as lowered)"
    ]
    lines.append(
        f"{'workload':<16}{'collectives':>14}{'wire before':>13}{'wire after':>12}{'change':>9}"
        f"{'stored eager':>14}{'stored commfuse':>17}{'formulas ok':>13}"
    )
    for r in doc["workloads"]:
        b, a = r["before_wire"], r["after_wire"]
        change = f"{100.0 * (a - b) / b:+.1f}%" if b else "-"
        sb = (
            "-"
            if r["stored_before_wire"] is None
            else (f"{r['stored_before_wire']}" + ("" if r["stored_before_wire"] == b else " (!)"))
        )
        sa = (
            "-"
            if r["stored_after_wire"] is None
            else (f"{r['stored_after_wire']}" + ("" if r["stored_after_wire"] == a else " (!)"))
        )
        lines.append(
            f"{r['workload']:<16}{r['before_count']:>6} -> {r['after_count']:<5}{b:>13}{a:>12}{change:>9}"
            f"{sb:>14}{sa:>17}{r['formula_checked'] - r['formula_differ']:>7}/{r['formula_checked']:<5}"
        )
    files = sorted(
        {
            r[f"stored_{s}_file"]
            for r in doc["workloads"]
            for s in ("before", "after")
            if r[f"stored_{s}_file"]
        }
    )
    lines.append(f"stored: {', '.join(files) or 'none'}; (!) marks a stored number that differs")
    for r in doc["workloads"]:
        if r["rewritten_before_autograd"]:
            lines.append(
                f"{r['workload']}: rewritten before AOTAutograd by {', '.join(r['rewritten_before_autograd'])}"
                ": 'before' counts the traced graph after that rewrite (the stored eager run counts "
                "the program as written)"
            )
    for r in doc["workloads"]:
        lines.append("")
        lines.append(f"== {r['workload']}")
        lines.append(r["table"])
    return "\n".join(lines)
