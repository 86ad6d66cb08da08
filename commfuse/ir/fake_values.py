"""One fake mode per graph: the node values (``meta["val"]``) the passes read and splice in.

Passes read shapes from ``meta["val"]`` and splice new nodes traced under the graph's fake mode
(:mod:`commfuse.ir.rewrite`). Graphs from Dynamo/AOTAutograd and ``make_fx(tracing_mode="fake"
/ "symbolic")`` hold fake tensors of one mode. A ``make_fx`` trace on real tensors does not:
torch records each value as a fake tensor of a mode of its own, and an op of a spliced template
on two of them fails ("Mixing fake modes NYI"). Graphs built by hand or traced without values
lack them. :func:`ensure_fake_values` finds such a graph and re-propagates every value through
it in one mode, as :class:`torch.fx.passes.fake_tensor_prop.FakeTensorProp` does.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils._pytree import tree_leaves

from commfuse.core.torch_private import active_fake_mode, fake_tensor_mode_of_value, new_fake_mode


class FakeValuesError(ValueError):
    """The graph's values cannot be propagated in one fake mode (the message says why)."""


def why_propagate(gm: fx.GraphModule) -> Optional[str]:
    """Why the graph's values must be propagated again (None: they already share one fake mode,
    the one active here if any): real tensors, values of several fake modes, or ops without
    values."""
    modes: dict[int, Any] = {}
    real = missing = 0
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        if "val" not in n.meta:
            missing += _needs_value(gm, n)
            continue
        for v in tree_leaves(n.meta["val"]):
            if isinstance(v, torch.Tensor):
                mode = fake_tensor_mode_of_value(v)
                if mode is None:
                    real += 1
                else:
                    modes.setdefault(id(mode), mode)
    reasons = []
    if real:
        reasons.append(f"{real} real tensor value(s)")
    if len(modes) > 1:
        reasons.append(f"values of {len(modes)} fake modes")
    if missing:
        reasons.append(f"{missing} node(s) without a value")
    active = active_fake_mode()
    if not reasons and active is not None and modes and id(active) not in modes:
        reasons.append("values of another fake mode than the active one")
    return ", ".join(reasons) or None


def _needs_value(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "placeholder":
        return True
    if n.op == "get_attr":  # a tensor constant; a higher-order op's subgraph has no value
        try:
            return isinstance(_attr(gm, str(n.target)), torch.Tensor)
        except AttributeError:
            return False
    # ATen/c10d ops that return something; Python operators and higher-order ops may lack one
    return (
        n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and bool(n.target._schema.returns)
    )


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def ensure_fake_values(gm: fx.GraphModule, example_inputs: Optional[Sequence[Any]] = None) -> Optional[str]:
    """Give every node of ``gm`` a ``meta["val"]`` of one fake mode, where it lacks that.

    The mode is the active fake mode if one is active, else the mode the placeholders' values
    share (keeping their symbolic sizes), else a fresh one with a shape environment (sizes read
    from tensor data become unbacked symbols, as under Dynamo). The placeholders' values come from their ``meta["val"]`` (a real
    tensor or another mode's fake tensor gives its shape, strides and dtype), else their
    ``tensor_meta`` / ``example_value``, else ``example_inputs``.

    Returns why values were propagated (None: nothing to do). Raises :class:`FakeValuesError`
    when a placeholder has no value to start from or the propagation fails; ``gm``'s values are
    then left as they were.
    """
    why = why_propagate(gm)
    if why is None:
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if example_inputs is not None and len(example_inputs) != len(placeholders):
        raise FakeValuesError(f"{len(example_inputs)} example inputs for {len(placeholders)} placeholders")
    mode = active_fake_mode() or _shared_mode(placeholders) or new_fake_mode()
    with mode:
        args = [
            _input_value(n, mode, None if example_inputs is None else example_inputs[i])
            for i, n in enumerate(placeholders)
        ]
    saved = {n: n.meta["val"] for n in gm.graph.nodes if "val" in n.meta}
    try:
        _Propagate(gm, mode).propagate_dont_convert_inputs(*args)
    except Exception as e:
        for n in gm.graph.nodes:
            n.meta.pop("val", None)
            if n in saved:
                n.meta["val"] = saved[n]
        raise FakeValuesError(f"fake-tensor propagation failed ({why}): {type(e).__name__}: {e}") from e
    return why


def _shared_mode(placeholders: list[fx.Node]):
    """The fake mode of every placeholder's tensor values, if they share exactly one and it has a
    shape environment (a real-mode trace's one-value modes have none)."""
    modes: dict[int, Any] = {}
    for n in placeholders:
        for v in tree_leaves(n.meta.get("val")):
            if isinstance(v, torch.Tensor):
                m = fake_tensor_mode_of_value(v)
                if m is None:
                    return None
                modes.setdefault(id(m), m)
    mode = next(iter(modes.values())) if len(modes) == 1 else None
    return mode if mode is not None and mode.shape_env is not None else None


def _input_value(n: fx.Node, mode, given: Any) -> Any:
    if "val" in n.meta:
        v = n.meta["val"]
    elif "example_value" in n.meta:
        v = n.meta["example_value"]
    elif n.meta.get("tensor_meta") is not None:
        tm = n.meta["tensor_meta"]
        return torch.empty_strided(tuple(tm.shape), tuple(tm.stride), dtype=tm.dtype)
    elif given is not None:
        v = given
    else:
        raise FakeValuesError(
            f"placeholder {n.name} has no value (meta['val']) to propagate from; "
            "trace the graph with make_fx, or pass example_inputs"
        )
    return _in_mode(v, mode, n.name)


def _in_mode(v: Any, mode, where: str) -> Any:
    if isinstance(v, (list, tuple)):
        return type(v)(_in_mode(x, mode, where) for x in v)
    if not isinstance(v, torch.Tensor) or fake_tensor_mode_of_value(v) is mode:
        return v
    if any(not isinstance(s, int) for s in (*v.shape, *v.stride())):
        raise FakeValuesError(
            f"placeholder {where}: symbolic sizes of another fake mode cannot be carried over"
        )
    # the sizes, strides and dtype only: a real input's data is never read
    return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device)


class _Propagate(FakeTensorProp):
    """FakeTensorProp whose constants (``get_attr`` tensors, real in a real-mode trace) enter the
    mode as fake tensors of the same sizes."""

    def get_attr(self, target, args, kwargs):
        v = super().get_attr(target, args, kwargs)
        if not isinstance(v, torch.Tensor) or fake_tensor_mode_of_value(v) is self._mode:
            return v
        if fake_tensor_mode_of_value(v) is None:
            return self._mode.from_tensor(v, static_shapes=True)  # keeps a small constant's data
        with self._mode:
            return _in_mode(v, self._mode, str(target))


__all__ = ["FakeValuesError", "ensure_fake_values", "why_propagate"]
