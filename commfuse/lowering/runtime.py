"""commfuse's runtime lowering: the scheduled graph becomes Python code that issues c10d calls.

Contract
    ``lower_graph(gm, plan) -> LoweredGraph`` rewrites a *copy* of the scheduled graph:

    * every collective start becomes a call to an issuer bound to its planned
      collective: an asynchronous c10d call (:mod:`.c10d_issue`) on the plan's
      ``issue_group`` (resolved at the first run, in the process that runs it; the
      runtime never creates a process group), at the start's position in the graph;
    * every ``wait_tensor`` becomes a call that waits on that work where the schedule
      put the wait, then applies the collective's in-place finish (``avg`` on gloo) to
      the waited output. Each ``Work`` is waited once: the first wait of any output of a
      coalesced collective waits all its works, the waits of its other outputs only
      finish them (gloo's reduce-scatter work copies its sum into the output again on
      every ``wait()``, which would undo a finish applied by an earlier wait);
    * everything else is left as the graph's own ops, in the graph's order (so the
      issue order is the scheduler's single total order on every rank);
    * on CUDA, nodes the plan puts on a side stream run under ``torch.cuda.stream(s)``
      with the plan's events and ``record_stream`` keep-alives (:mod:`.streams`);
      on CPU the plan's streams are ignored (one thread runs compute in graph order;
      collectives run concurrently on c10d's own threads).

    The lowered module runs eagerly (``Config(inner_compiler="eager")``) or with its
    compute regions compiled by Inductor (:mod:`.regions`). When a recorder is active
    (:mod:`.recorder`) every issue, completion and wait is recorded.

Guarantees
    Same values as the graph run with functional collectives (the reduction itself is
    c10d's); the input graph is not modified; a graph without collectives is returned
    as is.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from commfuse.core.torch_private import copy_graph, resolve_process_group
from commfuse.ir.kinds import collective_spec, is_wait
from commfuse.lowering import c10d_issue, recorder as rec_mod
from commfuse.lowering.plan import LoweringPlan, PlannedCollective
from commfuse.lowering.streams import apply_stream_plan

log = logging.getLogger(__name__)
_graph_ids = itertools.count()


@dataclass
class _Pending:
    planned: PlannedCollective
    issued: c10d_issue.Issued
    record: Optional[rec_mod.CollectiveRecord]
    # The works were waited (by the wait of one output; a coalesced collective shares this entry
    # among its outputs). Never wait a Work twice: gloo's reduce-scatter work copies its result
    # into the output again on each wait(), undoing the finish (avg division) already applied.
    waited: bool = False


@dataclass
class RuntimeState:
    """Per lowered graph: resolved groups and the collectives issued and not yet waited."""

    label: str
    groups: dict[str, Any] = field(default_factory=dict)
    pending: dict[int, _Pending] = field(default_factory=dict)  # id(output tensor) -> pending

    def group(self, name: str) -> Any:
        pg = self.groups.get(name)
        if pg is None:
            pg = resolve_process_group(name)
            if pg is None:
                raise RuntimeError(f"commfuse runtime: no process group named {name!r} in this process "
                                   f"(groups come from torch.distributed / commfuse.setup, never from compiling)")
            self.groups[name] = pg
        return pg


def _make_issuer(state: RuntimeState, planned: PlannedCollective, target: Any) -> Callable[..., Any]:
    native = c10d_issue.has_issuer(target)
    coalesced = bool(getattr(collective_spec(target), "coalesced", False))
    # Synchronous collectives (the autograd variants of commfuse's boundary ops) wait inside
    # the op and have no wait node: keeping them pending would hold their outputs forever.
    synchronous = bool(getattr(collective_spec(target), "synchronous", False))

    def issue(*args: Any, **kwargs: Any) -> Any:
        rec = rec_mod.active()
        t0 = rec.call_begin(state.label) if rec is not None else 0
        if native:
            issued = c10d_issue.issue(target, args, kwargs, state.group(planned.issue_group))
        else:
            issued = c10d_issue.issue_fallback(
                target, args, kwargs, planned.issue_group if planned.issue_group != planned.group else None)
        record = None
        if rec is not None:
            record = rec_mod.CollectiveRecord(
                planned.index, planned.start, state.label, planned.kind, planned.group, planned.issue_group,
                planned.logged_bytes, issued.sent_bytes, issued.received_bytes, t0)
            rec.collective(record, issued.works)
            rec.call_end(state.label)
        if not synchronous:
            p = _Pending(planned, issued, record)
            for t in issued.outputs:
                state.pending[id(t)] = p
        return list(issued.outputs) if coalesced else issued.outputs[0]

    issue.__name__ = issue.__qualname__ = f"commfuse_issue_{planned.index}"
    return issue


def _make_wait(state: RuntimeState) -> Callable[[torch.Tensor], torch.Tensor]:
    def wait(t: torch.Tensor) -> torch.Tensor:
        rec = rec_mod.active()
        t0 = rec.call_begin(state.label) if rec is not None else 0
        p = state.pending.pop(id(t), None)
        if p is None:  # not issued by this runtime (e.g. a tensor a custom op registered)
            out = c10d_issue.wait_fallback(t)
        else:
            if not p.issued.works:
                c10d_issue.wait_fallback(t)
            elif not p.waited:
                for w in p.issued.works:
                    w.wait()
                p.waited = True
            if p.issued.finish is not None:
                p.issued.finish(t)
            out = t
        if rec is not None:
            rec.wait(p.record if p is not None else None, state.label, t0)
            rec.call_end(state.label)
        return out

    wait.__name__ = wait.__qualname__ = "commfuse_wait"
    return wait


@dataclass
class LoweredGraph:
    """The runnable result: ``module`` (the rewritten copy) and the plan it follows."""

    module: fx.GraphModule
    plan: LoweringPlan
    state: RuntimeState

    def __call__(self, *args: Any) -> Any:
        rec = rec_mod.active()
        if rec is None:
            rec_mod.start_from_env()
            rec = rec_mod.active()
        if rec is None:
            return self.module(*args)
        rec.graph_begin(self.state.label)
        try:
            return self.module(*args)
        finally:
            rec.graph_end(self.state.label)


def lower_graph(gm: fx.GraphModule, plan: LoweringPlan, *, streams: bool = True) -> LoweredGraph:
    """Rewrite a copy of `gm` to issue its collectives through the runtime (see module docstring)."""
    state = RuntimeState(label=f"{plan.graph_kind}#{next(_graph_ids)}")
    graph = copy_graph(gm.graph)
    planned = {c.start: c for c in plan.collectives}
    wait_fn = _make_wait(state)
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        p = planned.get(n.name)
        if p is not None:
            n.target = _make_issuer(state, p, n.target)
        elif is_wait(n.target):
            n.target = wait_fn
    module = fx.GraphModule(gm, graph, class_name="CommfuseLowered")
    if streams and plan.node_streams and torch.cuda.is_available():
        apply_stream_plan(module, plan)
    return LoweredGraph(module, plan, state)
