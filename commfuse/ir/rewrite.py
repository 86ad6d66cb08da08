"""Splicing eager rewrites into a graph (the bucketing.py discipline).

A pass writes the replacement for a pattern as a plain eager function over
functional collectives and ATen ops, :func:`splice` traces it with ``make_fx``
under the graph's fake mode on the pattern's input values and copies the traced
nodes into the graph. Traced templates are cached per (function, constants,
input shapes/dtypes), so a deep graph with one repeated pattern traces once.

Every spliced node carries ``meta["val"]`` (a fake tensor), so the IR, the
verifier and the partitioner see ordinary nodes. The helpers below name the
functional collectives the rewrites use, with the group given by name (no
process group is resolved or created while compiling).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Hashable, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from commfuse.core.torch_private import c10d_functional
from commfuse.ir.kinds import collective_spec, is_wait

_f = c10d_functional
# Per fake mode: a template's meta["val"] tensors belong to the mode it was traced in, and
# a graph must never mix modes (the partitioner and Inductor re-run fake tensors). The
# cache lives on the mode object itself, so it goes away with the mode (a weak-keyed map
# would not: its templates hold the mode alive).
_CACHE_ATTR = "_commfuse_templates"
_NO_MODE_TEMPLATES: dict[Hashable, fx.GraphModule] = {}


# ----------------------------------------------------------------- collectives
def all_reduce(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    return _f.wait_tensor(_f.all_reduce(x, op, group))


def all_gather(x: torch.Tensor, dim: int, n: int, group: str) -> torch.Tensor:
    """Gather along ``dim``; for dim != 0 the dim-0 collective plus the split/cat shuffle
    DTensor emits (the IR recognises it as a dim-``dim`` gather)."""
    out = _f.wait_tensor(_f.all_gather_into_tensor(x.contiguous(), n, group))
    if dim == 0:
        return out
    return torch.cat(torch.chunk(out, n, 0), dim)


def reduce_scatter(x: torch.Tensor, op: str, dim: int, n: int, group: str) -> torch.Tensor:
    if dim != 0:
        x = torch.cat(torch.chunk(x, n, dim), 0)
    return _f.wait_tensor(_f.reduce_scatter_tensor(x.contiguous(), op, n, group))


def all_to_all(x: torch.Tensor, split_dim: int, concat_dim: int, n: int, group: str) -> torch.Tensor:
    """Equal-split all_to_all: chunk ``r`` along ``split_dim`` goes to rank ``r``; the
    received pieces are concatenated in sender order along ``concat_dim``."""
    return all_to_all_receive(all_to_all_issue(x, split_dim, n, group), concat_dim, n)


def all_to_all_issue(x: torch.Tensor, split_dim: int, n: int, group: str) -> torch.Tensor:
    """The first half of :func:`all_to_all`: issue the exchange, return its un-waited result
    (a rewrite that overlaps the exchange with compute places the two halves apart)."""
    if split_dim != 0:
        x = torch.cat(torch.chunk(x, n, split_dim), 0)
    sizes = [x.shape[0] // n] * n  # the 2.13 schema takes explicit split sizes
    return _f.all_to_all_single(x.contiguous(), sizes, sizes, group)


def all_to_all_receive(started: torch.Tensor, concat_dim: int, n: int) -> torch.Tensor:
    """The second half of :func:`all_to_all`: wait, then concatenate the pieces on ``concat_dim``."""
    out = _f.wait_tensor(started)
    if concat_dim == 0:
        return out
    return torch.cat(torch.chunk(out, n, 0), concat_dim)


# ----------------------------------------------------------------- splicing
def fake_mode_of(gm: fx.GraphModule):
    """The fake mode the graph's ``meta["val"]`` tensors live in (None if it has none)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor

    # detect_fake_mode(all vals) walks and cross-checks every value: seconds on 10k-node graphs,
    # called per splice. An active mode wins as it does there; else the first fake value's
    # (one graph's values share one mode).
    mode = detect_fake_mode([])
    if mode is not None:
        return mode
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return None


def _val(n: Any) -> Any:
    return n.meta["val"] if isinstance(n, fx.Node) else n


def _key_of(v: Any) -> Hashable:
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), v.dtype, tuple(v.stride()))
    return ("C", repr(v))


def trace(fn: Callable[..., Any], args: Sequence[Any], consts: tuple = (), fake_mode=None) -> fx.GraphModule:
    """``make_fx(lambda *t: fn(*t, *consts))`` on the fake values of ``args``; cached."""
    vals = [_val(a) for a in args]
    key = (fn, consts, tuple(_key_of(v) for v in vals))
    if fake_mode is None:
        cache = _NO_MODE_TEMPLATES
    else:
        cache = getattr(fake_mode, _CACHE_ATTR, None)
        if cache is None:
            cache = {}
            setattr(fake_mode, _CACHE_ATTR, cache)
    gm = cache.get(key)
    if gm is None:

        def body(*tensors):
            return fn(*tensors, *consts)

        if fake_mode is not None:
            with fake_mode:
                gm = make_fx(body, tracing_mode="real")(*_distinct(vals))
        else:
            gm = make_fx(body, tracing_mode="fake")(*_distinct(vals))
        _drop_shape_asserts(gm)
        cache[key] = gm
    return gm


def _distinct(vals: list[Any]) -> list[Any]:
    """``vals`` with every repeat of a tensor object replaced by a fresh tensor of its shape,
    stride and dtype. make_fx binds a tensor to the placeholder it last came in, so a value
    passed twice would leave one placeholder unused and read the other in both places; the
    cache key holds only shapes, and such a template, reused for two different nodes, would
    read the second node twice."""
    seen: set[int] = set()
    out = []
    for v in vals:
        if isinstance(v, torch.Tensor) and id(v) in seen:
            v = torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device)
        elif isinstance(v, torch.Tensor):
            seen.add(id(v))
        out.append(v)
    return out


_ASSERTS = {
    torch.ops.aten._assert_async.default,
    torch.ops.aten._assert_async.msg,
    torch.ops.aten._assert_scalar.default,
}


def _drop_shape_asserts(gm: fx.GraphModule) -> None:
    """Templates are traced on static shapes; the runtime shape asserts make_fx may record
    (e.g. for a data-dependent size in an input graph's fake mode) check nothing there and
    carry no ``meta["val"]``."""
    asserts = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _ASSERTS]
    for n in asserts:
        gm.graph.erase_node(n)
    if asserts:
        gm.graph.eliminate_dead_code()
        gm.recompile()


def splice(
    gm: fx.GraphModule,
    fn: Callable[..., Any],
    args: Sequence[fx.Node],
    *,
    consts: tuple = (),
    before: fx.Node,
    meta_from: fx.Node | None = None,
) -> Any:
    """Insert ``fn(*args, *consts)`` before ``before``; returns the node(s) of its result.

    ``meta_from``: a node whose non-value metadata (stack trace, partitioner tags that
    say forward/backward) the new nodes inherit, so the partitioner and the dumps place
    them like the code they replace.
    """
    template = trace(fn, args, consts, fake_mode_of(gm))
    placeholders = [n for n in template.graph.nodes if n.op == "placeholder"]
    val_map: dict[fx.Node, fx.Node] = dict(zip(placeholders, args, strict=True))
    with gm.graph.inserting_before(before):
        out = gm.graph.graph_copy(template.graph, val_map)
    if meta_from is not None:
        for tn in template.graph.nodes:
            n = val_map.get(tn)
            if n is not None and tn.op != "placeholder":
                inherit_meta(meta_from, n)
    return out


_VALUE_META = ("val", "tensor_meta", "example_value")


def inherit_meta(src: fx.Node, dst: fx.Node) -> None:
    """Give ``dst`` ``src``'s metadata except its value (stack trace, the partitioner's
    forward/backward tags), without overwriting what ``dst`` has."""
    for k, v in src.meta.items():
        if k not in _VALUE_META:
            dst.meta.setdefault(k, copy.copy(v))


def mutates(node: fx.Node) -> bool:
    """Whether ``node`` writes one of its arguments (an in-place or out= op)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def erase_dead(gm: fx.GraphModule, roots: Sequence[fx.Node]) -> int:
    """Erase ``roots`` and, transitively, their inputs once they have no users left.

    Only removes pure computation, waits and collectives whose results are unused
    (waits are side-effecting for FX's own dead-code elimination, which is why this
    exists). Placeholders and in-place ops are never removed.
    """

    erased = 0
    stack = list(roots)
    seen: set[fx.Node] = set()
    while stack:
        n = stack.pop()
        if (
            n in seen
            or getattr(n, "_erased", False)
            or n.users
            or n.op in ("placeholder", "output", "get_attr")
        ):
            continue
        if n.op != "call_function":
            continue
        spec = collective_spec(n.target)
        if spec is not None and spec.inplace:
            continue
        if spec is None and not is_wait(n.target) and mutates(n):
            continue
        seen.add(n)
        inputs = list(n.all_input_nodes)
        gm.graph.erase_node(n)
        erased += 1
        stack.extend(inputs)
    return erased
