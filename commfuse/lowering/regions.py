"""Compute regions compiled separately, so the planned collective order survives compilation.

The lowered module alternates compute with runtime calls (issue, wait, stream ops).
``compile_compute_regions`` cuts it at every runtime call (``split_module`` with the
original order kept), hands each compute region -- a graph of ordinary ATen ops -- to
the given compiler (Inductor's ``compile_fx_inner``), and leaves the runtime calls as
Python between them. Inductor can fuse and reorder *inside* a region, but no compute
can move across an issue or a wait: the order the scheduler chose is the order that
runs, which a whole-graph Inductor compile does not promise.

The cost: one Inductor compile per region, and no fusion across a collective. The
alternative (whole graph to Inductor, order pinned by dependencies) is
``Config(lowering="inductor")``; ``benchmarks/lowering_overlap.py`` measures both.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from .runtime import LoweredGraph

RUNTIME_PREFIXES = ("commfuse_issue_", "commfuse_wait", "commfuse_stream_")


def is_runtime_call(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "").startswith(RUNTIME_PREFIXES)


def region_ids(gm: fx.GraphModule) -> dict[str, int]:
    """Node name -> partition: runtime calls alone, compute between them grouped, in graph order."""
    ids: dict[str, int] = {}
    part = 0
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node) \
                and n.args[0].name in ids:
            # Unpack a multi-output op where it ran: regions then pass tensors, never lists.
            ids[n.name] = ids[n.args[0].name]
        elif is_runtime_call(n):
            part += 1
            ids[n.name] = part
            part += 1
        else:
            ids[n.name] = part
    return ids


class _Region(torch.nn.Module):
    """A compiled region called with positional args, like the submodule it replaces."""

    def __init__(self, compiled: Any, single: bool) -> None:
        super().__init__()
        self.compiled = compiled
        self.single = single

    def forward(self, *args: Any) -> Any:
        out = self.compiled(list(args))
        return out[0] if self.single else tuple(out)


def _example_inputs(sub: fx.GraphModule, vals: dict[str, Any]) -> list[Any]:
    return [vals[n.target] if n.target in vals else n.meta.get("val")
            for n in sub.graph.nodes if n.op == "placeholder"]


def compile_compute_regions(lowered: LoweredGraph, compile_region: Callable[[fx.GraphModule, list], Any]
                            ) -> LoweredGraph:
    """Replace every compute region of `lowered.module` by `compile_region(region_gm, example_inputs)`
    (a boxed callable, e.g. Inductor's compiled graph)."""
    gm = lowered.module
    vals = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    ids = region_ids(gm)
    split = split_module(gm, gm, lambda n: ids[n.name], keep_original_order=True,
                         keep_original_node_name=True)
    for n in list(split.graph.nodes):
        if n.op != "call_module":
            continue
        sub = getattr(split, n.target)
        calls = [m for m in sub.graph.nodes if m.op == "call_function"]
        if not calls or all(is_runtime_call(m) for m in calls):
            continue
        out = next(m for m in sub.graph.nodes if m.op == "output")
        single = not isinstance(out.args[0], (tuple, list))
        if single:
            out.args = ((out.args[0],),)
            sub.recompile()
        compiled = compile_region(sub, _example_inputs(sub, vals))
        setattr(split, n.target, _Region(compiled, single))
    split.recompile()
    return LoweredGraph(split, lowered.plan, lowered.state)


__all__ = ["compile_compute_regions", "is_runtime_call", "region_ids"]
