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

    While a torch profiler records, every run is labelled with ``record_function`` in the
    plan's names, so the user's profiler trace shows commfuse's plan: the run
    (``commfuse::graph:<kind>#<id>``), each collective's issue
    (``commfuse::<kind>[<role>]:<start node>``, the group's name where its role is unknown),
    each wait (``commfuse::wait:<kind>[<role>]:<start node>``) and each compute region between
    them (``commfuse::region:<n>``, ``n`` as in :func:`region_ids`, the number of the
    ``submod_<n>`` Inductor compiles). Without a profiler the check is one C call per run.

Guarantees
    Same values as the graph run with functional collectives (the reduction itself is
    c10d's); the input graph is not modified; a graph without collectives is returned
    as is.
"""

from __future__ import annotations

import itertools
import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from torch.profiler import record_function

from commfuse.core.torch_private import copy_graph, profiler_active, resolve_process_group
from commfuse.ir.kinds import collective_spec, is_wait
from commfuse.lowering import c10d_issue, recorder as rec_mod
from commfuse.lowering.plan import LoweringPlan, PlannedCollective
from commfuse.lowering.streams import apply_stream_plan

log = logging.getLogger(__name__)
_graph_ids = itertools.count()

RUNTIME_PREFIXES = ("commfuse_issue_", "commfuse_wait", "commfuse_stream_")


def is_runtime_call(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "").startswith(RUNTIME_PREFIXES)


def region_ids(gm: fx.GraphModule) -> dict[str, int]:
    """Node name -> partition: runtime calls alone, compute between them grouped, in graph order
    (compute partitions are even, runtime calls odd)."""
    ids: dict[str, int] = {}
    part = 0
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if (
            n.op == "call_function"
            and n.target is operator.getitem
            and isinstance(n.args[0], fx.Node)
            and n.args[0].name in ids
        ):
            # Unpack a multi-output op where it ran: regions then pass tensors, never lists.
            ids[n.name] = ids[n.args[0].name]
        elif is_runtime_call(n):
            part += 1
            ids[n.name] = part
            part += 1
        else:
            ids[n.name] = part
    return ids


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
    # Profiler labels of the compute regions: the one the graph starts with, and the one after
    # each runtime call (node name; None where the next runtime call follows at once).
    first_region: Optional[str] = None
    region_after: dict[str, Optional[str]] = field(default_factory=dict)
    profiling: bool = False  # a profiler records this run: label it
    _region: Any = None  # the open region's record_function

    def open_region(self, label: Optional[str]) -> None:
        if label is not None:
            self._region = record_function(label)
            self._region.__enter__()

    def close_region(self) -> None:
        if self._region is not None:
            rf, self._region = self._region, None
            rf.__exit__(None, None, None)

    def labelled(self, node: str, label: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` as the runtime call ``node``, labelled ``label``, between the
        region before it and the one after it."""
        self.close_region()
        try:
            with record_function(label):
                return fn(*args, **kwargs)
        finally:
            self.open_region(self.region_after.get(node))

    def group(self, name: str) -> Any:
        pg = self.groups.get(name)
        if pg is None:
            pg = resolve_process_group(name)
            if pg is None:
                raise RuntimeError(
                    f"commfuse runtime: no process group named {name!r} in this process "
                    f"(groups come from torch.distributed / commfuse.setup, never from compiling)"
                )
            self.groups[name] = pg
        return pg


def _make_issuer(state: RuntimeState, planned: PlannedCollective, target: Any) -> Callable[..., Any]:
    native = c10d_issue.has_issuer(target)
    coalesced = bool(getattr(collective_spec(target), "coalesced", False))
    # Synchronous collectives (the autograd variants of commfuse's boundary ops) wait inside
    # the op and have no wait node: keeping them pending would hold their outputs forever.
    synchronous = bool(getattr(collective_spec(target), "synchronous", False))

    label = planned.label()

    def issue(*args: Any, **kwargs: Any) -> Any:
        if state.profiling:
            return state.labelled(planned.start, label, run, *args, **kwargs)
        return run(*args, **kwargs)

    def run(*args: Any, **kwargs: Any) -> Any:
        rec = rec_mod.active()
        t0 = rec.call_begin(state.label) if rec is not None else 0
        if native:
            issued = c10d_issue.issue(target, args, kwargs, state.group(planned.issue_group))
        else:
            issued = c10d_issue.issue_fallback(
                target,
                args,
                kwargs,
                planned.issue_group if planned.issue_group != planned.group else None,
                pg=state.group(planned.issue_group) if rec is not None else None,
            )
        record = None
        if rec is not None:
            record = rec_mod.CollectiveRecord(
                planned.index,
                planned.start,
                state.label,
                planned.kind,
                planned.group,
                planned.issue_group,
                planned.logged_bytes,
                issued.sent_bytes,
                issued.received_bytes,
                t0,
            )
            rec.collective(record, issued.works)
            rec.call_end(state.label)
        if not synchronous:
            p = _Pending(planned, issued, record)
            for t in issued.outputs:
                state.pending[id(t)] = p
        return list(issued.outputs) if coalesced else issued.outputs[0]

    issue.__name__ = issue.__qualname__ = f"commfuse_issue_{planned.index}"
    return issue


def _make_wait(state: RuntimeState, node: str, label: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def wait(t: torch.Tensor) -> torch.Tensor:
        if state.profiling:
            return state.labelled(node, label, run, t)
        return run(t)

    def run(t: torch.Tensor) -> torch.Tensor:
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
        if not profiler_active():
            return self._run(args)
        st = self.state
        with record_function(f"commfuse::graph:{st.label}"):
            st.profiling = True
            st.open_region(st.first_region)
            try:
                return self._run(args)
            finally:
                st.close_region()
                st.profiling = False

    def _run(self, args: tuple) -> Any:
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
    waited = {w: c for c in plan.collectives for w in c.waits}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        p = planned.get(n.name)
        if p is not None:
            n.target = _make_issuer(state, p, n.target)
        elif is_wait(n.target):
            c = waited.get(n.name)
            label = (
                f"commfuse::wait:{c.kind}[{c.role or c.group}]:{c.start}"
                if c is not None
                else f"commfuse::wait:{n.name}"
            )
            n.target = _make_wait(state, n.name, label)
    module = fx.GraphModule(gm, graph, class_name="CommfuseLowered")
    if streams and plan.node_streams and torch.cuda.is_available():
        apply_stream_plan(module, plan)
    _label_regions(module, state)
    return LoweredGraph(module, plan, state)


def _label_regions(gm: fx.GraphModule, state: RuntimeState) -> None:
    """The region labels of ``state``: compute partitions of :func:`region_ids` that hold a node.
    (Stream switches on CUDA are runtime calls the labels do not stop at: a region's label
    then also covers the switches and compute up to the next issue or wait.)"""
    ids = region_ids(gm)
    compute = {i for i in ids.values() if i % 2 == 0}
    name = lambda i: f"commfuse::region:{i}" if i in compute else None  # noqa: E731
    state.first_region = name(0)
    state.region_after = {n.name: name(ids[n.name] + 1) for n in gm.graph.nodes if is_runtime_call(n)}
