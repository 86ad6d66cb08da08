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

What a region receives: every symbol its shapes use, and the layout it was compiled for.
Inductor binds a size symbol (``s14`` of a dynamic shape, ``u2`` of a data-dependent MoE split)
only from a region input that *is* that symbol (a SymInt input, or a tensor whose size or stride
is it); a region whose inputs only carry ``4*s14`` cannot be compiled. Before the cut, each
region whose values use a symbol none of its inputs binds is given the node that binds it (the
graph's SymInt input, the op that produced the unbacked value, or the first tensor sized by it)
as one more input. And since the ops between regions (c10d calls, waits) and the regions'
outputs need not produce the strides recorded in the graph, an input whose strides differ from
the ones the region was compiled for is copied into that layout before the call.

Safety net: a region holds no collective, so how it computes is this rank's own business. A
region that fails to compile, or whose compiled form fails on its first run, runs eagerly
from then on (its FX graph op by op: the same values, no fusion), with one warning naming the
graph, the region and the error. The collective order is untouched, so ranks may differ in
this without any risk. A compiled region that worked once and fails later raises.
"""

from __future__ import annotations

import logging
import operator
import warnings
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_symbols
from torch.fx.passes.split_module import split_module

from commfuse.lowering.runtime import LoweredGraph, is_runtime_call, region_ids

log = logging.getLogger(__name__)


def _bare_symbols(val: Any) -> set:
    """The symbols ``val`` binds when it is a compiled graph's input: a SymInt that is a symbol,
    a tensor's sizes, strides and offset that are symbols."""
    if isinstance(val, torch.SymInt):
        exprs = [val.node.expr]
    elif isinstance(val, torch.Tensor):
        exprs = [
            getattr(x, "node", None) and x.node.expr
            for x in (*val.shape, *val.stride(), val.storage_offset())
        ]
    else:
        return set()
    return {e for e in exprs if e is not None and getattr(e, "is_Symbol", False)}


def _vals_of(n: fx.Node) -> Any:
    return n.meta.get("val")


def commfuse_bind_symbols(*providers: Any) -> None:
    """Placeholder op: makes ``split_module`` pass a region the nodes binding its symbols; it is
    removed from the region after the cut and never runs."""
    return None


def bind_region_symbols(gm: fx.GraphModule, ids: dict[str, int]) -> int:
    """Give each region the inputs that bind the symbols its values use (see the module
    docstring): insert ``commfuse_bind_symbols(*providers)`` as the region's first node. Returns
    how many regions needed one. Symbols with no provider before the region are left alone (the
    region may then fail to compile and run eagerly)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    parts: dict[int, list[fx.Node]] = {}
    for n in nodes:
        parts.setdefault(ids[n.name], []).append(n)
    provider: dict[Any, fx.Node] = {}  # symbol -> first node (in graph order) that binds it
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        for sym in _bare_symbols(_vals_of(n)):
            provider.setdefault(sym, n)
    added = 0
    for part, members in parts.items():
        if any(is_runtime_call(m) for m in members):
            continue
        inside = set(members)
        needed: set = set()
        bound: set = set()
        for m in members:
            needed |= free_symbols(_vals_of(m))
            bound |= _bare_symbols(_vals_of(m))  # defined here (e.g. an .item() in this region)
            for a in m.all_input_nodes:
                if a not in inside:  # an input: its sizes must be defined too, and may define some
                    needed |= free_symbols(_vals_of(a))
                    bound |= _bare_symbols(_vals_of(a))
        first = members[0]
        extra = []
        for sym in sorted(needed - bound, key=str):
            src = provider.get(sym)
            if src is not None and src not in inside and position[src] < position[first] and src not in extra:
                extra.append(src)
        if not extra:
            continue
        with gm.graph.inserting_before(first):
            anchor = gm.graph.call_function(commfuse_bind_symbols, tuple(extra))
        ids[anchor.name] = part
        added += 1
    return added


def _drop_symbol_anchors(sub: fx.GraphModule) -> None:
    for m in list(sub.graph.nodes):
        if m.op == "call_function" and m.target is commfuse_bind_symbols:
            sub.graph.erase_node(m)


CONTIGUOUS = "contiguous"


def _expected_layout(val: Any) -> Any:
    """The strides a region compiled for ``val`` asserts: a tuple of ints, ``CONTIGUOUS`` for a
    symbolic contiguous layout, None when nothing is checked (no tensor, other symbolic layouts)."""
    if not isinstance(val, torch.Tensor):
        return None
    stride = val.stride()
    if all(isinstance(x, int) for x in stride):
        return tuple(stride)
    expect, exprs = 1, []
    for size in reversed(val.shape):
        exprs.append(expect)
        expect = expect * size
    contiguous = all(_expr(a) == _expr(b) for a, b in zip(stride, reversed(exprs), strict=True))
    return CONTIGUOUS if contiguous else None


def _expr(x: Any) -> Any:
    return x.node.expr if isinstance(x, torch.SymInt) else x


def _mutated_inputs(gm: fx.GraphModule) -> set[int]:
    """Positions of placeholders some op of ``gm`` may write to (never copied: the write must land)."""
    out = set()
    for i, p in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        for u in p.users:
            schema = getattr(u.target, "_schema", None)
            if u.op == "call_function" and schema is not None and schema.is_mutable:
                out.add(i)
    return out


def _in_layout(t: Any, layout: Any) -> Any:
    if layout is None or not isinstance(t, torch.Tensor):
        return t
    if layout == CONTIGUOUS:
        return t if t.is_contiguous() else t.contiguous()
    if t.stride() == layout or t.dim() != len(layout):
        return t
    fixed = torch.empty_strided(t.shape, layout, dtype=t.dtype, device=t.device)
    fixed.copy_(t)
    return fixed


class GuardedRegion:
    """A boxed callable: the compiled region, or its FX graph run eagerly once compiling it or
    its first compiled run failed (see the module docstring). ``layouts``: per input, the strides
    the compiled form expects (see ``_expected_layout``); inputs are copied into them if needed."""

    def __init__(
        self,
        compiled: Optional[Callable[[list], Any]],
        eager: fx.GraphModule,
        where: str,
        layouts: Optional[list] = None,
    ) -> None:
        # an instance attribute: wrappers made with functools.wraps (AOTAutograd's, Dynamo's
        # disable) copy __dict__, and AOTAutograd calls a compiled graph boxed only if it is set
        self._boxed_call = True
        self.compiled = compiled
        self.eager = eager
        self.where = where
        self.proven = False  # the compiled form ran once
        self.layouts = layouts or []

    def _restrided(self, args: list) -> list:
        for i, layout in enumerate(self.layouts):
            if layout is not None and i < len(args):
                args[i] = _in_layout(args[i], layout)
        return args

    def __call__(self, args: list) -> Any:
        if self.compiled is None:
            return self.eager(*args)
        if self.proven:
            return self.compiled(self._restrided(args))
        try:
            out = self.compiled(
                self._restrided(list(args))
            )  # a copy: a boxed callable may clear the list it is given
        except Exception as e:  # noqa: BLE001 - any failure of the compiled form: run the graph itself
            self.compiled = None
            warnings.warn(
                f"commfuse: {self.where} failed on its first run and runs eagerly from now on "
                f"(same values, no fusion): {type(e).__name__}: {e}",
                RuntimeWarning,
                stacklevel=2,
            )
            return self.eager(*args)
        self.proven = True
        return out


def compile_guarded(
    compile_region: Callable[[fx.GraphModule, list], Any],
    gm: fx.GraphModule,
    example_inputs: list,
    where: str,
) -> GuardedRegion:
    """``compile_region(gm, example_inputs)``, falling back to running ``gm`` eagerly when that
    compile fails or the compiled form fails on its first run (one warning naming ``where``)."""
    try:
        compiled = compile_region(gm, example_inputs)
    except Exception as e:  # noqa: BLE001 - Inductor can fail in many ways; the graph itself still runs
        warnings.warn(
            f"commfuse: {where} did not compile and runs eagerly (same values, no fusion): "
            f"{type(e).__name__}: {e}",
            RuntimeWarning,
            stacklevel=2,
        )
        log.debug("commfuse: %s did not compile", where, exc_info=True)
        compiled = None
    mutated = _mutated_inputs(gm)
    layouts = [None if i in mutated else _expected_layout(v) for i, v in enumerate(example_inputs)]
    return GuardedRegion(compiled, gm, where, layouts)


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
    return [
        vals[n.target] if n.target in vals else n.meta.get("val")
        for n in sub.graph.nodes
        if n.op == "placeholder"
    ]


def _hold_attribute_outputs(gm: fx.GraphModule) -> dict[int, str]:
    """Take the module attributes the graph returns as they are (an opaque object AOTAutograd
    passes through, e.g. a process group in a backward graph's outputs) out of its output:
    ``split_module`` can only return values computed in a partition. Returns position ->
    attribute name; the output holds None there until ``_restore_attribute_outputs``."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = out.args[0]
    if not isinstance(values, (tuple, list)):
        return {}
    held = {i: str(v.target) for i, v in enumerate(values) if isinstance(v, fx.Node) and v.op == "get_attr"}
    if held:
        out.args = (type(values)(None if i in held else v for i, v in enumerate(values)),)
        for n in list(gm.graph.nodes):
            if n.op == "get_attr" and not n.users:
                gm.graph.erase_node(n)
        gm.recompile()
    return held


def _restore_attribute_outputs(split: fx.GraphModule, gm: fx.GraphModule, held: dict[int, str]) -> None:
    if not held:
        return
    out = next(n for n in split.graph.nodes if n.op == "output")
    values = list(out.args[0])
    with split.graph.inserting_before(out):
        for i, target in held.items():
            if not hasattr(split, target):
                setattr(split, target, getattr(gm, target))
            values[i] = split.graph.get_attr(target)
    out.args = (type(out.args[0])(values),)


def compile_compute_regions(
    lowered: LoweredGraph, compile_region: Callable[[fx.GraphModule, list], Any], graph_kind: str = "graph"
) -> LoweredGraph:
    """Replace every compute region of `lowered.module` by `compile_region(region_gm, example_inputs)`
    (a boxed callable, e.g. Inductor's compiled graph), guarded by the eager fallback."""
    gm = lowered.module
    vals = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    ids = region_ids(gm)
    if bind_region_symbols(gm, ids):
        gm.recompile()
    held = _hold_attribute_outputs(gm)
    split = split_module(
        gm, gm, lambda n: ids[n.name], keep_original_order=True, keep_original_node_name=True
    )
    _restore_attribute_outputs(split, gm, held)
    for n in list(split.graph.nodes):
        if n.op != "call_module":
            continue
        sub = getattr(split, n.target)
        calls = [
            m
            for m in sub.graph.nodes
            if m.op == "call_function"
            and m.target is not commfuse_bind_symbols
            and m.target is not operator.getitem
        ]
        if not calls or all(is_runtime_call(m) for m in calls):
            continue  # a runtime call, with the getitems that unpack a coalesced one's results
        _drop_symbol_anchors(sub)
        out = next(m for m in sub.graph.nodes if m.op == "output")
        single = not isinstance(out.args[0], (tuple, list))
        if single:
            out.args = ((out.args[0],),)
            sub.recompile()
        compiled = compile_guarded(
            compile_region,
            sub,
            _example_inputs(sub, vals),
            f"compute region {n.target} of the {graph_kind} graph",
        )
        setattr(split, n.target, _Region(compiled, single))
    split.recompile()
    return LoweredGraph(split, lowered.plan, lowered.state)


__all__ = ["GuardedRegion", "compile_compute_regions", "compile_guarded", "is_runtime_call", "region_ids"]
