"""Splicing a fused eager function into a pipeline forward graph, at the autograd level.

Each rule's replacement is an eager function traced with ``make_fx(pre_dispatch=True)`` under
the graph's fake mode and spliced in where the transfer was (:func:`splice_autograd`: the
rewrite.py discipline, at the autograd level: the backward is derived afterwards by
``trace_joint``, so each fused op's backward is its autograd formula), traced as
commfuse.pipeline traces a whole model (:func:`pipeline_trace_position`: boundary ops trace
their input as ``src[position]`` and their output as ``dst[position]``).
:func:`m2ms_traceable_across_stages` says whether this build's ``commfuse::m2ms`` can be
traced that way (without it every rule refuses).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from commfuse.ir import rewrite
from commfuse.ops import M2MS_AUTOGRAD, trace_position


@contextmanager
def pipeline_trace_position(position: Optional[int]) -> Iterator[None]:
    """The tracing context of commfuse.pipeline's whole-model traces: boundary ops trace their
    input as ``src[position]`` and their output as ``dst[position]``."""

    with trace_position(None, position):
        yield


def m2ms_traceable_across_stages() -> Optional[str]:
    """None when an m2ms between two disjoint rank sets traces with sender-side input and
    receiver-side output shapes (what a whole-pipeline graph needs), else the reason."""

    def f(x):
        return M2MS_AUTOGRAD(x, 0, [1, 1, 1, 1], [0, 1], [2, 3], 4, "commfuse.boundary_fusion.probe")

    try:
        with pipeline_trace_position(0):
            gm = make_fx(f, tracing_mode="fake", pre_dispatch=True)(torch.empty(2, 3))
    except (ValueError, RuntimeError) as e:
        return (
            f"commfuse::m2ms cannot be traced across pipeline stages by this build ({type(e).__name__}: {e})"
        )
    out = [n for n in gm.graph.nodes if n.target is M2MS_AUTOGRAD][0].meta["val"]
    if tuple(out.shape) != (2, 3):
        return f"commfuse::m2ms traced across stages gives shape {tuple(out.shape)}, expected (2, 3)"
    return None


def splice_autograd(
    gm: fx.GraphModule,
    fn: Callable[..., Any],
    args: Sequence[fx.Node],
    *,
    consts: tuple,
    before: fx.Node,
    position: Optional[int],
    meta_from: Optional[fx.Node] = None,
) -> Any:
    """Insert ``fn(*args, *consts)`` before ``before``, traced pre-dispatch (autograd-level ops
    stay as they are: the joint graph derives their backward) in the graph's fake mode, as
    the pipeline traces: floating inputs require grad so ``detach`` is recorded."""
    mode = rewrite.fake_mode_of(gm)
    vals = []
    for a in args:
        v = a.meta["val"]
        if v.is_floating_point():
            v = v.detach().requires_grad_(True)
        vals.append(v)

    def body(*t):
        return fn(*t, *consts)

    # Unknown position: every rule's pieces are the same size for every position (the rules that
    # read the position refuse without it), so position 0's shapes are every position's.
    with pipeline_trace_position(position if position is not None else 0):
        if mode is not None:
            with mode:
                vals = [
                    v if isinstance(v, torch._subclasses.FakeTensor) else mode.from_tensor(v) for v in vals
                ]
                tgm = make_fx(body, tracing_mode="real", pre_dispatch=True)(*vals)
        else:
            tgm = make_fx(body, tracing_mode="fake", pre_dispatch=True)(*vals)
    rewrite._drop_shape_asserts(tgm)
    placeholders = [n for n in tgm.graph.nodes if n.op == "placeholder"]
    val_map: dict[fx.Node, fx.Node] = dict(zip(placeholders, args, strict=True))
    with gm.graph.inserting_before(before):
        out = gm.graph.graph_copy(tgm.graph, val_map)
    for tn in tgm.graph.nodes:
        n = val_map.get(tn)
        if n is None or tn.op == "placeholder":
            continue
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.requires_grad:  # graph values carry no autograd state
            n.meta["val"] = v.detach()
        if meta_from is not None:
            rewrite.inherit_meta(meta_from, n)
    return out


__all__ = ["m2ms_traceable_across_stages", "pipeline_trace_position", "splice_autograd"]
