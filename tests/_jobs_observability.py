"""Rank-pool jobs for the observability tests (module-level so the pool can pickle them)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

import commfuse

from _multirank_jobs import _example, example_config


def traced_profiled_step(trace_dir: str) -> dict[str, Any]:
    """The SP Llama block compiled with commfuse (eager inner compiler) under torch's structured
    trace, written into ``trace_dir`` as ``TORCH_TRACE`` would (torch's own lazy handler, opened at
    the first event, named by this rank); one warm-up step, then one step under both
    ``torch.profiler.profile`` and ``commfuse.record``. Returns what the parent checks: the plans'
    collective labels, the profiler's commfuse events (name, ts, dur), its clock base, the
    recorder's Chrome trace."""
    from torch._logging import _internal as tl

    # A pool worker imported torch long before, without TORCH_TRACE: install the handler
    # TORCH_TRACE makes, the way torch's structured-trace tests do.
    handler = tl.LazyTraceHandler(trace_dir)
    handler.setFormatter(tl.TorchLogsFormatter(trace=True))
    tl.trace_log.addHandler(handler)
    try:
        torch._dynamo.reset()
        model_factory, inputs = _example("llama_tp_sp", torch.float32)
        be = commfuse.backend(example_config("llama_tp_sp", inner_compiler="eager"))
        compiled = torch.compile(model_factory(), backend=be)

        def step(i: int) -> None:
            out = compiled(inputs(i))
            (out.to_local() if hasattr(out, "to_local") else out).float().mean().backward()

        step(0)
    finally:
        tl.trace_log.removeHandler(handler)
        handler.close()
    with commfuse.record() as rec, torch.profiler.profile() as prof:
        step(1)
    path = os.path.join(trace_dir, f"profile_rank{dist.get_rank()}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        kineto = json.load(f)
    os.remove(path)
    events = [
        (e["name"], float(e["ts"]), float(e.get("dur", 0)))
        for e in kineto["traceEvents"]
        if str(e.get("name", "")).startswith("commfuse::") and e.get("ph") == "X"
    ]
    return {
        "rank": dist.get_rank(),
        "labels": [c.label() for p in be.plans for c in p.collectives],
        "graphs": [r.graph for r in be.reports],
        "changed": {r.graph: [p.name for p in r.passes if p.changed] for r in be.reports},
        "events": events,
        "base_ns": kineto.get("baseTimeNanoseconds"),
        "recorder": rec.chrome_trace(),
    }
