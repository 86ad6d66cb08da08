"""Predicted timelines next to the dumps: the simulator's Chrome trace of each lowered graph.

Contract
    * :func:`simulate_trace` simulates one graph (``commfuse.costmodel.simulator``: one compute
      stream, one stream per process group, waits block) with a cost model -- a
      ``CostProfile`` when given, else the analytic model of ``topology`` (default: the
      ``cpu-gloo`` preset sized to the world, backend gloo) -- and returns its Chrome trace.
    * :func:`write_predicted_trace` writes it as ``predicted_trace.json`` into a graph's dump
      directory, where ``commfuse report`` draws it.
    * :func:`predict_timelines` (context manager) does that for every graph a commfuse backend
      lowers with its runtime while the context is active (``Config(dump_dir=...)`` needed):
      it wraps ``commfuse.backend``'s ``lower_runtime`` (the same seam the benchmark runner
      records graphs at) and restores it on exit.

Guarantees
    Never changes compilation: the simulation runs after the pipeline decided, on the final
    graph, and any failure (a graph the simulator cannot price, an unwritable directory)
    warns and is skipped, like a dump. Nothing is communicated.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import torch.fx as fx

from commfuse.costmodel.analytic import AnalyticCostModel
from commfuse.costmodel.profile import CostProfile
from commfuse.costmodel.simulator import Simulator
from commfuse.costmodel.topology import Topology
from commfuse.ir.graph_ir import CollectiveIR

PREDICTED_TRACE = "predicted_trace.json"


def _world_size(gm: fx.GraphModule) -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()

    return max([c.group.size or 1 for c in CollectiveIR(gm).collectives] or [1])


def cost_model(profile: Any = None, topology: Any = None, backend: Optional[str] = None, world_size: int = 2):
    """(AnalyticCostModel, description): the profile's model, or the analytic one of `topology`."""

    if profile is not None:
        if not isinstance(profile, CostProfile):
            profile = CostProfile.load(profile)
        return profile.build_model(topology), f"profile {profile.topology}/{profile.backend} {profile.provenance.date}"
    if topology is None:
        per_node = Topology.preset("cpu-gloo").ranks_per_node
        topology = Topology.preset("cpu-gloo", num_nodes=max(1, -(-world_size // per_node)))
        backend = backend or "gloo"
    backend = backend or "nccl"
    return AnalyticCostModel(topology, backend), f"analytic {topology.name}/{backend} (uncalibrated)"


def simulate_trace(gm: fx.GraphModule, *, profile: Any = None, topology: Any = None,
                   backend: Optional[str] = None) -> dict[str, Any]:

    model, describe = cost_model(profile, topology, backend, _world_size(gm))
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
        warnings.warn(f"commfuse: no predicted timeline for {dump_dir} ({type(e).__name__}: {e})",
                      RuntimeWarning, stacklevel=2)
        return None


@contextlib.contextmanager
def predict_timelines(**kw: Any) -> Iterator[None]:
    """While active, every graph commfuse's runtime lowers gets ``predicted_trace.json`` in its dump dir."""
    be_mod = importlib.import_module("commfuse.backend")  # the module (commfuse.backend is the factory)
    original = be_mod.lower_runtime

    def lower_runtime(gm: fx.GraphModule, graph_kind: str, *args: Any, **kwargs: Any):
        dump_dir = kwargs.get("dump_dir")
        if dump_dir:
            write_predicted_trace(gm, dump_dir, **kw)
        return original(gm, graph_kind, *args, **kwargs)

    be_mod.lower_runtime = lower_runtime
    try:
        yield
    finally:
        be_mod.lower_runtime = original
