"""What ``commfuse report`` needs beside the dumps, written while the pipeline runs.

Contract
    :class:`ReportFacts` (a pipeline instrument, on whenever graphs are dumped) writes, next to
    each graph's dumps: ``predicted_trace.json`` (the simulator's Chrome trace of the graph as it
    will run) and ``predicted_trace_input.json`` (the graph the pipeline received) for every graph
    that runs (forward, backward, inference, plain), and ``report_facts.json``: the predicted
    summaries of the input, of commfuse's result before any executor-specific lowering
    (:data:`EXECUTOR_LOWERINGS`) and of the graph as run, the cost model that priced them, each
    process group's ranks and mesh dim, each collective's layer, and a joint graph's
    forward/backward split. The cost model is :data:`PRICING`'s last entry when one is set
    (``commfuse.reports.predict_timelines``), else the pipeline's (its topology or calibrated
    profile), else the analytic ``cpu-gloo`` preset sized to the world (:func:`cost_model`).

Guarantees
    Never changes compilation: the simulations run on the graphs the pipeline hands over and
    copy nothing into them, and any failure (a graph the simulator cannot price, an unwritable
    directory) is recorded in ``report_facts.json`` or logged, like a dump. Nothing is
    communicated.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
import torch.fx as fx

from commfuse.core.torch_private import resolve_process_group
from commfuse.costmodel.analytic import AnalyticCostModel
from commfuse.costmodel.profile import CostProfile
from commfuse.costmodel.simulator import Simulator
from commfuse.costmodel.topology import Topology
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.passmgr.instrument import Instrumentation
from commfuse.schedule.layer_level import layer_name

PREDICTED_TRACE = "predicted_trace.json"
PREDICTED_INPUT_TRACE = "predicted_trace_input.json"
REPORT_FACTS = "report_facts.json"
# Passes that adapt a graph to one collective library (gloo has no reduce_scatter algorithm)
# rather than optimise the program: the report shows their effect apart from commfuse's result.
EXECUTOR_LOWERINGS = ("gloo_reduce_scatter",)
# graph kinds that run (the simulator prices them as one step's forward, backward, ...)
RUNTIME_KINDS = ("forward", "backward", "inference", "graph")

log = logging.getLogger(__name__)
# commfuse.reports.predict_timelines(**kw) while active: the cost model the instrument prices with
PRICING: list[dict[str, Any]] = []


def world_size_of(gm: fx.GraphModule) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()

    return max([c.group.size or 1 for c in CollectiveIR(gm).collectives] or [1])


def cost_model(profile: Any = None, topology: Any = None, backend: Optional[str] = None, world_size: int = 2):
    """(AnalyticCostModel, description): the profile's model, or the analytic one of `topology`."""

    if profile is not None:
        if not isinstance(profile, CostProfile):
            profile = CostProfile.load(profile)
        return profile.build_model(
            topology
        ), f"profile {profile.topology}/{profile.backend} {profile.provenance.date}"
    if topology is None:
        per_node = Topology.preset("cpu-gloo").ranks_per_node
        topology = Topology.preset("cpu-gloo", num_nodes=max(1, -(-world_size // per_node)))
        backend = backend or "gloo"
    backend = backend or "nccl"
    return AnalyticCostModel(topology, backend), f"analytic {topology.name}/{backend} (uncalibrated)"


def graph_directions(gm: fx.GraphModule) -> dict[str, str]:
    """Collective name -> "forward" / "backward" in a joint graph (where its start or input lies)."""
    ir = CollectiveIR(gm)
    out = {}
    for c in ir.collectives:
        back = c.start in ir.backward_nodes or (c.inputs and c.inputs[0] in ir.backward_nodes)
        out[c.name] = "backward" if back else "forward"
    return out


def _mesh_dim(
    group_name: str, role: Optional[str], source: Optional[str]
) -> tuple[Optional[str], Optional[str]]:
    """(mesh dim name, where it came from) of a process group, where this process can tell."""
    try:
        pg = resolve_process_group(group_name)
        desc = getattr(pg, "group_desc", None) if pg is not None else None
    except Exception:  # noqa: BLE001 - a group this process cannot resolve has no description
        desc = None
    if isinstance(desc, str) and desc.startswith("mesh_") and desc not in ("mesh_default",):
        return desc[len("mesh_") :], "process group description"
    if source == "mesh" and role:
        # setup(mesh=) / the DTensor mesh named the dim whose role this is (tp -> tp, dp_shard -> fsdp)
        return role, "DeviceMesh dim name"
    return None, None


def group_facts(ir: CollectiveIR) -> dict[str, dict[str, Any]]:
    """Per process group of the graph: size, ranks, the role given for it and its mesh dim."""
    roles, sources = ir.options.group_roles, ir.options.role_sources
    out: dict[str, dict[str, Any]] = {}
    for c in ir.collectives:
        g = c.group
        if g.name in out:
            continue
        role = roles.get(g.name)
        role = getattr(role, "value", role)
        dim, how = _mesh_dim(g.name, role, sources.get(g.name))
        out[g.name] = {
            "size": g.size,
            "ranks": list(g.ranks) if g.ranks is not None else None,
            "role": role,
            "role_source": sources.get(g.name),
            "mesh_dim": dim,
            "mesh_dim_source": how,
        }
    return out


# Dynamo's name of the compiled module in module paths: "L['self'].layers.3"
_DYNAMO_ROOT = re.compile(r"^L\['[^']*'\]\.")


def collective_layers(ir: CollectiveIR) -> dict[str, str]:
    """Collective start node -> the layer that traced it (``layers.3``), where the graph says."""
    out = {}
    for c in ir.collectives:
        name = layer_name(c.start)
        for n in [c.logical_input, *c.inputs]:
            if name is not None:
                break
            if isinstance(n, fx.Node):
                name = layer_name(n)
        if name is not None:
            out[c.start.name] = _DYNAMO_ROOT.sub("", name)
    return out


def _summary(trace: dict[str, Any]) -> dict[str, float]:
    o = trace.get("otherData", {})
    return {
        k: float(o[k])
        for k in ("makespan_us", "compute_us", "comm_us", "exposed_comm_us", "hidden_comm_us")
        if isinstance(o.get(k), (int, float))
    }


class ReportFacts(Instrumentation):
    """Pipeline instrument (``Pipeline`` adds it when graphs are dumped): see the module docstring.
    Every failure is caught."""

    def __init__(self, graph_kind: str) -> None:
        self.kind = graph_kind
        self.gm: Optional[fx.GraphModule] = None
        self.dir: Optional[Path] = None
        self.facts: dict[str, Any] = {}
        self.traces: dict[str, dict[str, Any]] = {}
        self.model: Any = None
        self.topology = ""  # the pipeline report's words for its topology and pricing

    def _price(self, gm: fx.GraphModule, ctx: Any) -> None:
        if self.model is not None:
            return
        if PRICING:
            self.model, describe = cost_model(**{"world_size": world_size_of(gm), **PRICING[-1]})
        elif ctx.cost.model is not None:
            self.model = ctx.cost.model.full  # a report prices every size as traced: it decides nothing
            describe = f"the pipeline's cost model ({self.topology}; {ctx.cost.backend})"
        else:
            self.model, describe = cost_model(world_size=world_size_of(gm))
            describe += "; no topology given (Config.topology / commfuse.setup)"
        self.facts["cost_model"] = describe

    def _simulate(self, stage: str, gm: fx.GraphModule, ctx: Any) -> None:
        try:
            self._price(gm, ctx)
            trace = Simulator(gm, self.model).simulate(memory=False).to_chrome_trace()
            trace.setdefault("otherData", {})["cost_model"] = self.facts.get("cost_model", "")
            self.traces[stage] = trace
        except Exception as e:  # noqa: BLE001 - a prediction that cannot be made costs only the picture
            self.facts.setdefault("prediction_errors", {})[stage] = f"{type(e).__name__}: {e}"
            log.debug("commfuse: no predicted timeline of the %s graph (%s)", self.kind, stage, exc_info=True)

    def before_pipeline(self, gm: fx.GraphModule, ctx: Any, report: Any) -> None:
        if not report.dump_dir or self.kind == "dynamo":
            return
        self.dir, self.gm, self.topology = Path(report.dump_dir), gm, report.topology
        try:
            self.facts.update(
                format="commfuse-report-facts",
                version=1,
                graph_kind=self.kind,
                groups=group_facts(ctx.ir),
                layers=collective_layers(ctx.ir),
            )
            if self.kind == "joint":
                self.facts["directions"] = graph_directions(gm)
        except Exception as e:  # noqa: BLE001
            self.facts["error"] = f"{type(e).__name__}: {e}"
        if self.kind in RUNTIME_KINDS:
            self._simulate("input", gm, ctx)

    def before_pass(self, p: Any, record: Any) -> None:
        if (
            self.gm is not None
            and self.kind in RUNTIME_KINDS
            and p.name in EXECUTOR_LOWERINGS
            and "commfuse" not in self.traces
        ):
            self._simulate("commfuse", self.gm, None)

    def after_pass(self, p: Any, record: Any, gm: fx.GraphModule, ctx: Any) -> None:
        if p.name in EXECUTOR_LOWERINGS and record.changed:
            self.facts.setdefault("executor_lowerings", []).append(p.name)

    def after_pipeline(self, gm: fx.GraphModule, ctx: Any, report: Any) -> None:
        if self.dir is None or not report.dump_dir:
            return
        try:
            if self.kind in RUNTIME_KINDS:
                self._simulate("as_run", gm, ctx)
                if not self.facts.get("executor_lowerings"):
                    self.traces.pop("commfuse", None)  # the lowering changed nothing: the same graph
                self.facts["predicted"] = {k: _summary(t) for k, t in self.traces.items()}
                self.facts["layers"] = {**self.facts.get("layers", {}), **collective_layers(ctx.ir)}
            if self.kind == "joint":
                self.facts["directions_after"] = graph_directions(gm)
            self.dir.mkdir(parents=True, exist_ok=True)
            for stage, name in (("as_run", PREDICTED_TRACE), ("input", PREDICTED_INPUT_TRACE)):
                if stage in self.traces:
                    (self.dir / name).write_text(json.dumps(self.traces[stage]))
            (self.dir / REPORT_FACTS).write_text(json.dumps(self.facts, indent=1, default=str))
        except Exception:  # noqa: BLE001 - like a dump: never reaches compilation
            log.debug("commfuse: report facts of the %s graph not written", self.kind, exc_info=True)
