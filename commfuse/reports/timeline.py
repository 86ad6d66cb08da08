"""Predicted timelines next to the dumps: the simulator's Chrome trace of each lowered graph.

Contract
    * :func:`simulate_trace` simulates one graph (``commfuse.costmodel.simulator``: one compute
      stream, one stream per process group, waits block) with a cost model -- a
      ``CostProfile`` when given, else the analytic model of ``topology`` (default: the
      ``cpu-gloo`` preset sized to the world, backend gloo) -- and returns its Chrome trace.
    * :func:`write_predicted_trace` writes it as ``predicted_trace.json`` into a graph's dump
      directory, where ``commfuse report`` draws it.
    * Dumping writes the predicted timelines of every compiled graph by itself
      (:class:`commfuse.passmgr.report_facts.ReportFacts`); :func:`predict_timelines` (context
      manager) prices those of the graphs compiled while it is active with a given
      ``profile`` / ``topology`` instead.

Guarantees
    Never changes compilation; nothing is communicated.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import torch.fx as fx

from commfuse.costmodel.simulator import Simulator
from commfuse.passmgr.report_facts import (
    EXECUTOR_LOWERINGS,
    PREDICTED_INPUT_TRACE,
    PREDICTED_TRACE,
    PRICING,
    REPORT_FACTS,
    RUNTIME_KINDS,
    cost_model,
    world_size_of,
)


def simulate_trace(
    gm: fx.GraphModule, *, profile: Any = None, topology: Any = None, backend: Optional[str] = None
) -> dict[str, Any]:

    model, describe = cost_model(profile, topology, backend, world_size_of(gm))
    trace = Simulator(gm, model).simulate().to_chrome_trace()
    trace.setdefault("otherData", {})["cost_model"] = describe
    return trace


def write_predicted_trace(gm: fx.GraphModule, dump_dir: str | Path, **kw: Any) -> Optional[Path]:
    """Simulate `gm` and write ``predicted_trace.json`` into `dump_dir` (best effort: warns on failure)."""
    try:
        trace = simulate_trace(gm, **kw)
        d = Path(dump_dir)
        d.mkdir(parents=True, exist_ok=True)
        path = d / PREDICTED_TRACE
        path.write_text(json.dumps(trace))
        return path
    except Exception as e:  # noqa: BLE001 - a prediction that cannot be made costs only the picture
        warnings.warn(
            f"commfuse: no predicted timeline for {dump_dir} ({type(e).__name__}: {e})",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


@contextlib.contextmanager
def predict_timelines(**kw: Any) -> Iterator[None]:
    """While active, the predicted timelines next to the dumps are priced with ``profile=`` /
    ``topology=`` / ``backend=`` (default: the pipeline's cost model). Dumping
    (``Config(dump_dir=...)``) writes them with or without this context."""
    PRICING.append(kw)
    try:
        yield
    finally:
        PRICING.remove(kw)


__all__ = [
    "EXECUTOR_LOWERINGS",
    "PREDICTED_INPUT_TRACE",
    "PREDICTED_TRACE",
    "REPORT_FACTS",
    "RUNTIME_KINDS",
    "cost_model",
    "predict_timelines",
    "simulate_trace",
    "write_predicted_trace",
]
