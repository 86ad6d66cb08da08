"""Calibrated decisions: what the passes decide with and without a measured cost profile.

What it runs
    Each workload is compiled on 2 real gloo ranks twice with the default pipeline (eager inner
    compiler, the workload's declared group roles): once priced with the nominal cost model
    (no topology: the documented defaults) and once with ``Config(cost_profile=PROFILE)``, the
    profile ``python -m commfuse calibrate`` measured on this machine and committed under
    ``benchmarks/results/``. One forward + backward runs each time. From every rank's pipeline
    reports it takes, per graph and pass, whether the pass changed the graph, the step-time
    gate's verdict and the pass's counts -- the decisions, not their timings.

    Printed per workload: whether every rank made the same decisions (they must: the profile
    is a file every rank reads), and each decision that differs between the nominal and the
    calibrated compile.

    python benchmarks/run.py --calibrated-decisions [--json out.json]
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from benchmarks.gloo_reduce_scatter import PROFILE, ROOT

WORKLOADS = ("llama_tp:s", "llama_tp_sp:s", "simple_fsdp:s", "moe_tp_ep:s")
WORLD = 2

__all__ = ["calibrated_decisions_tables", "decisions_job", "run_calibrated_decisions"]


def _decisions(reports: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    for r in reports:
        for p in r.passes:
            out.append(
                {
                    "graph": r.graph,
                    "pass": p.name,
                    "changed": p.changed,
                    "gate": [d["gate"] for d in p.decisions if "gate" in d],
                    "counts": {k: v for k, v in sorted(p.counts.items()) if v},
                }
            )
    return out


def decisions_job(workloads: Sequence[str], profile: str) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Rank job: ``{workload: {"nominal": decisions, "calibrated": decisions}}`` on this rank."""
    import torch
    import torch.distributed as dist

    import commfuse
    from benchmarks.workloads import get_workload

    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name in workloads:
        out[name] = {}
        for label, path in (("nominal", None), ("calibrated", profile)):
            torch._dynamo.reset()
            torch.manual_seed(0)
            built = get_workload(name).build(world, rank)
            backend = commfuse.backend(
                commfuse.Config(inner_compiler="eager", group_roles=built.roles, cost_profile=path)
            )
            built.loss(torch.compile(built.model, backend=backend)(*built.inputs)).backward()
            out[name][label] = _decisions(backend.reports)
    return out


def _differences(nominal: list[dict[str, Any]], calibrated: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"graph": a["graph"], "pass": a["pass"], "nominal": a, "calibrated": b}
        for a, b in zip(nominal, calibrated, strict=True)
        if a != b
    ]


def run_calibrated_decisions(
    workloads: Sequence[str] = WORKLOADS, profile: Optional[str] = None
) -> dict[str, Any]:
    from commfuse.tools.rank_pool import RankPool

    path = profile or str(PROFILE)
    with RankPool(WORLD, timeout_s=1800) as pool:
        per_rank = pool.run(decisions_job, list(workloads), path, timeout=1800)
    rows = []
    for name in workloads:
        first = per_rank[0][name]
        rows.append(
            {
                "workload": name,
                "ranks_agree": all(r[name] == first for r in per_rank),
                "decisions": len(first["nominal"]),
                "differences": _differences(first["nominal"], first["calibrated"]),
            }
        )
    shown = path if profile else str(PROFILE.relative_to(ROOT))
    return {"world_size": WORLD, "profile": shown, "workloads": rows}


def _brief(d: dict[str, Any]) -> str:
    gate = f", gate {'/'.join(d['gate'])}" if d["gate"] else ""
    counts = ", ".join(f"{k}={v}" for k, v in d["counts"].items())
    return f"{'changed' if d['changed'] else 'unchanged'}{gate}" + (f" ({counts})" if counts else "")


def calibrated_decisions_tables(doc: dict[str, Any]) -> str:
    lines = [
        f"Decisions with the nominal cost model vs the calibrated profile {doc['profile']} "
        f"({doc['world_size']} gloo ranks, default pipeline, eager inner compiler)",
        f"{'workload':<16}{'ranks agree':>12}{'decisions':>11}{'differ':>8}",
    ]
    for r in doc["workloads"]:
        lines.append(
            f"{r['workload']:<16}{'yes' if r['ranks_agree'] else 'NO':>12}{r['decisions']:>11}"
            f"{len(r['differences']):>8}"
        )
    for r in doc["workloads"]:
        for d in r["differences"]:
            lines.append(
                f"{r['workload']} {d['graph']} {d['pass']}: nominal {_brief(d['nominal'])}; "
                f"calibrated {_brief(d['calibrated'])}"
            )
    return "\n".join(lines)
