"""Side compute streams on CUDA: the plan's streams, events and keep-alives made explicit.

``stream_program(gm, plan)`` is the pure part (tested on CPU): the node sequence with
the stream operations the runtime inserts, in order:

* ``("fork",)`` after the placeholders: every side stream waits for the default stream
  (the graph's inputs were produced there);
* ``("switch", k)`` before a node whose stream differs from the current one;
* ``("wait", i)`` right before the first consumer, on its stream, of edge ``i``'s
  value, and ``("record", i)`` right after the producer, on its stream;
* ``("keep", value, k)`` with the wait: ``value.record_stream(stream k)``, so the
  caching allocator does not hand the value's memory to another tensor until stream
  ``k`` is done with it (the value was allocated on its producer's stream);
* ``("join",)`` before the output: switch back to the default stream and make it wait
  for every side stream, so outputs and frees after the graph are ordered.

``apply_stream_plan(module, plan)`` inserts those operations into the lowered module as
calls to a per-graph :class:`CudaStreams` object. Allocation happens on the stream an op
runs on (caching allocator semantics); keep-alives make that safe. Requires CUDA.
"""

from __future__ import annotations

from typing import Any, Union

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from commfuse.lowering.plan import LoweringPlan

Op = tuple[Any, ...]


def stream_program(gm: fx.GraphModule, plan: LoweringPlan) -> list[Union[Op, fx.Node]]:
    """The node sequence interleaved with stream ops (see module docstring)."""
    streams = plan.node_streams
    edges_by_producer: dict[str, list[int]] = {}
    edges_by_consumer: dict[str, list[int]] = {}
    for i, e in enumerate(plan.events):
        edges_by_producer.setdefault(e.producer, []).append(i)
        edges_by_consumer.setdefault(e.consumer, []).append(i)
    by_name = {n.name: n for n in gm.graph.nodes}
    kept: set[tuple[str, int]] = set()
    out: list[Union[Op, fx.Node]] = []
    current = 0
    forked = False
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            out.append(n)
            continue
        if not forked:
            out.append(("fork",))
            forked = True
        if n.op == "output":
            out.append(("join",))
            out.append(n)
            current = 0
            continue
        s = streams.get(n.name, 0)
        if s != current:
            out.append(("switch", s))
            current = s
        for i in edges_by_consumer.get(n.name, []):
            out.append(("wait", i))
        for p in n.all_input_nodes:
            if s in plan.keep_alive.get(p.name, ()) and (p.name, s) not in kept:
                kept.add((p.name, s))
                out.append(("keep", by_name[p.name], s))
        out.append(n)
        for i in edges_by_producer.get(n.name, []):
            out.append(("record", i))
    return out


class CudaStreams:
    """The streams and events of one lowered graph (created at its first run, on its device)."""

    def __init__(self, num_streams: int, num_events: int) -> None:
        self.num_streams = num_streams
        self.num_events = num_events
        self.streams: list[Any] = []
        self.events: list[Any] = []

    def _ensure(self) -> None:
        if not self.streams:
            self.streams = [torch.cuda.current_stream()] + [
                torch.cuda.Stream() for _ in range(self.num_streams - 1)
            ]
            self.events = [torch.cuda.Event() for _ in range(self.num_events)]

    def fork(self) -> None:
        self._ensure()
        self.streams[0] = torch.cuda.current_stream()
        for s in self.streams[1:]:
            s.wait_stream(self.streams[0])

    def switch(self, k: int) -> None:
        torch.cuda.set_stream(self.streams[k])

    def record(self, i: int) -> None:
        self.events[i].record(torch.cuda.current_stream())

    def wait(self, i: int) -> None:
        torch.cuda.current_stream().wait_event(self.events[i])

    def keep(self, value: Any, k: int) -> None:
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(self.streams[k])

    def join(self) -> None:
        torch.cuda.set_stream(self.streams[0])
        for s in self.streams[1:]:
            self.streams[0].wait_stream(s)


def apply_stream_plan(module: fx.GraphModule, plan: LoweringPlan) -> CudaStreams:
    """Insert the stream program's operations into `module` (in place); returns its stream object."""
    program = stream_program(module, plan)
    rt = CudaStreams(plan.num_streams, len(plan.events))
    g = module.graph
    fns = {
        "fork": rt.fork,
        "switch": rt.switch,
        "record": rt.record,
        "wait": rt.wait,
        "keep": rt.keep,
        "join": rt.join,
    }
    # Insert each op just before the next node of the program (or after the last placeholder).
    pending: list[Op] = []
    for item in program:
        if isinstance(item, fx.Node):
            for op in pending:
                with g.inserting_before(item):
                    g.call_function(_stream_op(fns[op[0]]), tuple(op[1:]))
            pending = []
        else:
            pending.append(item)
    g.lint()
    module.recompile()
    return rt


def _stream_op(fn: Any) -> Any:
    def op(*args: Any) -> None:
        fn(*args)

    op.__name__ = op.__qualname__ = f"commfuse_stream_{fn.__name__}"
    return op
