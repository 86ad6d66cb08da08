"""Lowering: how a rewritten, scheduled graph is executed.

`Config.lowering` picks the executor of the collectives:

* "commfuse" (:mod:`.runtime`): commfuse's runtime issues every collective as an
  asynchronous c10d call on the process group the plan chose (:mod:`.plan`), waits
  where the schedule put the wait, runs side-stream compute on CUDA streams
  (:mod:`.streams`) and feeds the recorder (:mod:`.recorder`). Compute runs op by op
  with `inner_compiler="eager"`, or in regions compiled by Inductor (:mod:`.regions`).
* "inductor": Inductor compiles the whole graph and emits the functional collectives
  as its own c10d calls (the order is the graph's; no pool groups, no recorder).

`lower(gm, graph_kind, config)` returns the boxed callable AOTAutograd expects.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

import torch.fx as fx

from commfuse.core.torch_private import (
    make_boxed_func,
    resolve_process_group,
    structured_trace_enabled,
    trace_artifact,
)
from commfuse.lowering.plan import LoweringPlan, build_plan
from commfuse.lowering.recorder import Recorder, record
from commfuse.lowering.regions import compile_compute_regions, compile_guarded
from commfuse.lowering.runtime import LoweredGraph, lower_graph


def lower_eager(gm: fx.GraphModule) -> Callable:
    """Run the graph as is, in graph order, with functional collectives (boxed calling convention)."""
    return make_boxed_func(gm.forward)


def plan_for(
    gm: fx.GraphModule, graph_kind: str, group_roles: Optional[dict[str, str]] = None
) -> LoweringPlan:
    """The plan for `gm` in this process (pool aliases used when registered here)."""
    return build_plan(
        gm,
        graph_kind,
        group_available=lambda name: resolve_process_group(name) is not None,
        group_roles=group_roles,
    )


def write_plan(plan: LoweringPlan, dump_dir: Optional[str]) -> None:
    """Put the plan next to the graph's dumps (best effort: dumps never fail compilation)."""
    if not dump_dir:
        return
    from pathlib import Path

    try:
        d = Path(dump_dir)
        d.mkdir(parents=True, exist_ok=True)
        (d / "lowering_plan.txt").write_text(plan.describe() + "\n")
        (d / "lowering_plan.json").write_text(json.dumps(plan.to_dict(), indent=1))
    except OSError:
        pass


def lower_runtime(
    gm: fx.GraphModule,
    graph_kind: str,
    *,
    dump_dir: Optional[str] = None,
    compile_regions: Optional[Callable[[fx.GraphModule, list], Any]] = None,
    example_inputs: Optional[list] = None,
    on_plan: Optional[Callable[[LoweringPlan], None]] = None,
    group_roles: Optional[dict[str, str]] = None,
) -> Callable:
    """commfuse's runtime lowering of one graph (boxed). ``compile_regions(region_gm, example_inputs)``
    compiles compute (Inductor); a graph without collectives is one region. ``on_plan`` receives the plan.
    ``group_roles``: the pipeline's group name -> role, for the plan's (and the profiler labels') roles."""
    plan = plan_for(gm, graph_kind, group_roles)
    write_plan(plan, dump_dir)
    # beside the graphs in torch's structured trace (TORCH_TRACE): what the runtime will issue
    if structured_trace_enabled():
        trace_artifact(
            f"commfuse_{graph_kind}_lowering_plan", "json", lambda: json.dumps(plan.to_dict(), indent=1)
        )
    if on_plan is not None:
        on_plan(plan)
    if not plan.collectives:
        if compile_regions is None:
            return lower_eager(gm)
        if example_inputs is None:
            example_inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]

        return compile_guarded(
            compile_regions,
            gm,
            list(example_inputs),
            f"the {graph_kind} graph (one compute region, no collective)",
        )
    lowered = lower_graph(gm, plan)
    if compile_regions is not None:
        lowered = compile_compute_regions(lowered, compile_regions, graph_kind)
    return make_boxed_func(lowered)


__all__ = [
    "LoweredGraph",
    "LoweringPlan",
    "Recorder",
    "build_plan",
    "lower_eager",
    "lower_graph",
    "lower_runtime",
    "plan_for",
    "record",
    "write_plan",
]
