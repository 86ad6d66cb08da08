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

Safety net: a region holds no collective, so how it computes is this rank's own business. A
region that fails to compile, or whose compiled form fails on its first run, runs eagerly
from then on (its FX graph op by op: the same values, no fusion), with one warning naming the
graph, the region and the error. The collective order is untouched, so ranks may differ in
this without any risk. A compiled region that worked once and fails later raises.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any, Callable, Optional

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


class GuardedRegion:
    """A boxed callable: the compiled region, or its FX graph run eagerly once compiling it or
    its first compiled run failed (see the module docstring)."""

    def __init__(self, compiled: Optional[Callable[[list], Any]], eager: fx.GraphModule, where: str) -> None:
        # an instance attribute: wrappers made with functools.wraps (AOTAutograd's, Dynamo's
        # disable) copy __dict__, and AOTAutograd calls a compiled graph boxed only if it is set
        self._boxed_call = True
        self.compiled = compiled
        self.eager = eager
        self.where = where
        self.proven = False  # the compiled form ran once

    def __call__(self, args: list) -> Any:
        if self.compiled is None:
            return self.eager(*args)
        if self.proven:
            return self.compiled(args)
        try:
            out = self.compiled(list(args))  # a copy: a boxed callable may clear the list it is given
        except Exception as e:  # noqa: BLE001 - any failure of the compiled form: run the graph itself
            self.compiled = None
            warnings.warn(f"commfuse: {self.where} failed on its first run and runs eagerly from now on "
                          f"(same values, no fusion): {type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
            return self.eager(*args)
        self.proven = True
        return out


def compile_guarded(compile_region: Callable[[fx.GraphModule, list], Any], gm: fx.GraphModule, example_inputs: list,
                    where: str) -> GuardedRegion:
    """``compile_region(gm, example_inputs)``, falling back to running ``gm`` eagerly when that
    compile fails or the compiled form fails on its first run (one warning naming ``where``)."""
    try:
        compiled = compile_region(gm, example_inputs)
    except Exception as e:  # noqa: BLE001 - Inductor can fail in many ways; the graph itself still runs
        warnings.warn(f"commfuse: {where} did not compile and runs eagerly (same values, no fusion): "
                      f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
        compiled = None
    return GuardedRegion(compiled, gm, where)


class _Region(torch.nn.Module):
    """A compiled region called with positional args, like the submodule it replaces."""

    def __init__(self, compiled: GuardedRegion, single: bool) -> None:
        super().__init__()
        self.compiled = compiled
        self.single = single

    def forward(self, *args: Any) -> Any:
        out = self.compiled(list(args))
        return out[0] if self.single else tuple(out)


def _example_inputs(sub: fx.GraphModule, vals: dict[str, Any]) -> list[Any]:
    return [vals[n.target] if n.target in vals else n.meta.get("val")
            for n in sub.graph.nodes if n.op == "placeholder"]


def compile_compute_regions(lowered: LoweredGraph, compile_region: Callable[[fx.GraphModule, list], Any],
                            graph_kind: str = "graph") -> LoweredGraph:
    """Replace every compute region of `lowered.module` by `compile_region(region_gm, example_inputs)`
    (a boxed callable, e.g. Inductor's compiled graph), guarded by the eager fallback."""
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
        compiled = compile_guarded(compile_region, sub, _example_inputs(sub, vals),
                                   f"compute region {n.target} of the {graph_kind} graph")
        setattr(split, n.target, _Region(compiled, single))
    split.recompile()
    return LoweredGraph(split, lowered.plan, lowered.state)


__all__ = ["GuardedRegion", "compile_compute_regions", "compile_guarded", "is_runtime_call", "region_ids"]
