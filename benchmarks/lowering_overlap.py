"""Measured overlap and step time of commfuse's runtime lowering, next to Inductor's.

    python benchmarks/run.py --lowering-overlap [--json out.json]

On 2 gloo ranks of this machine, per workload and per executor:

* ``inductor`` / ``inductor+comm``: ``torch.compile`` default, and with Inductor's comm passes;
* ``commfuse``: commfuse's pipeline, its runtime issues the collectives, Inductor compiles the
  compute between them (``lowering="commfuse"``, the default);
* ``commfuse:whole-graph``: commfuse's pipeline, Inductor compiles the whole graph and issues
  the collectives itself (``lowering="inductor"``);
* ``commfuse-eager``: commfuse's runtime with compute run op by op.

Step time: median and IQR of the timed steps (forward + backward), per rank, reported for the
slower rank. Measured overlap (commfuse's runtime only -- the recorder sees the c10d calls the
runtime makes; Inductor's own calls are invisible to it): over ``record_steps`` more steps, the
share of the time collectives were in flight during which the rank's compute thread was in a
compute region (``commfuse.record``), with the in-flight and blocked-in-wait times.

What it is not: a GPU measurement. On gloo/CPU, compute and the transport threads share the
same cores, so overlap is real but costs compute speed (the contention the cost model's κ
describes).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

WORKLOADS = ("simple_fsdp:s", "llama_tp_sp:s")
EXECUTORS = ("inductor", "inductor+comm", "commfuse", "commfuse:whole-graph", "commfuse-eager")


def _iqr(xs: list[float]) -> float:
    if len(xs) < 4:
        return max(xs) - min(xs) if xs else 0.0
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def measure_rank(workload: str, executor: str, warmup: int, steps: int, record_steps: int) -> dict[str, Any]:
    """One executor on one workload, on this rank (a rank-pool job)."""
    import warnings

    import torch
    import torch.distributed as dist

    import commfuse
    from benchmarks.baselines import get_baseline
    from benchmarks.workloads import get_workload

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    built = get_workload(workload).build(dist.get_world_size(), dist.get_rank())

    def step(run) -> float:
        dist.barrier()
        t = time.perf_counter()
        built.loss(run(*built.inputs)).backward()
        built.model.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    with get_baseline(executor).session(built) as session:
        first = step(session.run)
        for _ in range(warmup):
            step(session.run)
        times = [step(session.run) for _ in range(steps)]
        summary = None
        if executor.startswith("commfuse") and executor != "commfuse:whole-graph":
            with commfuse.record() as rec:
                for _ in range(record_steps):
                    step(session.run)
            summary = rec.summary()
    return {"rank": dist.get_rank(), "first_step_s": first, "step_s": times, "recorded": summary}


def run_lowering_overlap(
    *,
    workloads=WORKLOADS,
    executors=EXECUTORS,
    warmup: int = 3,
    steps: int = 15,
    record_steps: int = 5,
    world: int = 2,
) -> dict[str, Any]:
    from commfuse.tools.rank_pool import RankPool, RankPoolError

    rows = []
    with RankPool(world, timeout_s=1800) as pool:
        for w in workloads:
            for e in executors:
                t = time.perf_counter()
                try:
                    ranks = pool.run(measure_rank, w, e, warmup, steps, record_steps, timeout=1800)
                    error = None
                except RankPoolError as exc:  # one failing executor must not stop the comparison
                    ranks, error = [], str(exc).splitlines()[0]
                rows.append(
                    {
                        "workload": w,
                        "executor": e,
                        "error": error,
                        "wall_s": time.perf_counter() - t,
                        "ranks": ranks,
                        **_aggregate(ranks),
                    }
                )
    return {"world_size": world, "warmup": warmup, "steps": steps, "record_steps": record_steps, "rows": rows}


def _aggregate(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    if not ranks:
        return {}
    # The step ends when the slowest rank ends: report the rank with the larger median.
    slow = max(ranks, key=lambda r: statistics.median(r["step_s"]))
    out = {
        "step_ms_median": 1e3 * statistics.median(slow["step_s"]),
        "step_ms_iqr": 1e3 * _iqr(slow["step_s"]),
        "first_step_s": max(r["first_step_s"] for r in ranks),
    }
    recs = [r["recorded"] for r in ranks if r.get("recorded")]
    if recs:
        out["overlap_ratio"] = min(r["overlap_ratio"] for r in recs)
        out["inflight_ms_per_step"] = max(r["inflight_us"] for r in recs) / 1e3
        out["blocked_ms_per_step"] = max(r["blocked_in_wait_us"] for r in recs) / 1e3
    return out


def lowering_overlap_tables(doc: dict[str, Any]) -> str:
    n = doc["record_steps"]
    lines = [
        f"Lowering: measured step time and overlap, {doc['world_size']} gloo ranks "
        f"({doc['steps']} timed steps after {doc['warmup']} warm-up; overlap over {n} recorded steps)",
        "",
        "| workload | executor | step ms (median) | IQR ms | first step s | measured overlap | "
        "in flight ms/step | blocked in wait ms/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        if r.get("error"):
            lines.append(f"| {r['workload']} | {r['executor']} | FAILED: {r['error']} | | | | | |")
            continue
        ov = r.get("overlap_ratio")
        cols = [
            f"{r['step_ms_median']:.2f}",
            f"{r['step_ms_iqr']:.2f}",
            f"{r['first_step_s']:.1f}",
            "n/a (Inductor issues)" if ov is None else f"{ov:.1%}",
            "" if ov is None else f"{r['inflight_ms_per_step'] / n:.2f}",
            "" if ov is None else f"{r['blocked_ms_per_step'] / n:.2f}",
        ]
        lines.append(f"| {r['workload']} | {r['executor']} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


__all__ = ["lowering_overlap_tables", "measure_rank", "run_lowering_overlap"]
