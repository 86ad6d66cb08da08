"""Reading a Dynamo graph one call at a time: op names, arguments, example values.

The graph ``torch.compile`` hands a backend spells one ATen operation many ways:
``x.softmax(-1)`` is a ``call_method``, ``F.softmax(x, dim=-1)`` and
``torch.softmax(x, -1)`` are ``call_function`` s of different callables,
``a / b`` is ``operator.truediv``. :class:`Call` gives every node one *name*
(``"softmax"``, ``"truediv"``, ``"c10d.all_to_all_single"``) and positional /
keyword access to its arguments (position 0 is the tensor the op works on), so
the MoE templates (:mod:`.templates`) are written once per operation.

Only callables from ``torch`` / ``operator`` / ``builtins`` get a name: a user
function that happens to be called ``softmax`` is not ``softmax``.
"""

from __future__ import annotations

import builtins
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

_MISSING = object()

# Python operators Dynamo records as call_function targets, by the name of the
# tensor method they stand for.
_OPERATORS = {
    operator.add: "add",
    operator.sub: "sub",
    operator.mul: "mul",
    operator.truediv: "truediv",
    operator.floordiv: "floordiv",
    operator.matmul: "matmul",
    operator.getitem: "getitem",
    operator.lt: "lt",
    operator.gt: "gt",
    operator.le: "le",
    operator.ge: "ge",
    operator.eq: "eq",
    operator.neg: "neg",
    operator.pow: "pow",
    operator.iadd: "add",
    operator.imul: "mul",
}
# Tensor-method aliases that are the same operation.
_ALIASES = {
    "div": "truediv",
    "divide": "truediv",
    "multiply": "mul",
    "subtract": "sub",
    "true_divide": "truediv",
    "greater": "gt",
    "less": "lt",
    "square": "square",
}


def op_name(node: fx.Node) -> Optional[str]:
    """The operation ``node`` performs, or None (placeholders, outputs, unknown callables)."""
    if node.op == "call_method":
        return _ALIASES.get(node.target, node.target)
    if node.op != "call_function":
        return None
    t = node.target
    if t in _OPERATORS:
        return _OPERATORS[t]
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        ns, base = (
            t._qualified_op_name.split("::")
            if isinstance(t, torch._ops.OpOverloadPacket)
            else t._schema.name.split("::")
        )
        if ns in ("_c10d_functional", "_c10d_functional_autograd"):
            return "c10d." + base
        return base if ns == "aten" else f"{ns}.{base}"
    module = getattr(t, "__module__", None) or ""
    name = getattr(t, "__name__", None)
    if name is None:
        return None
    if module == "builtins" and getattr(builtins, name, None) is t:
        return "builtins." + name
    if module.startswith("torch") or module in ("_operator", "operator"):
        return _ALIASES.get(name, name)
    return None


class Call:
    """One node as ``name(input, *args, **kwargs)`` with positional-or-keyword access."""

    def __init__(self, node: fx.Node) -> None:
        self.node = node
        self.name = op_name(node)
        self.args = tuple(node.args)
        self.kwargs = dict(node.kwargs)

    def arg(self, pos: int, key: str, default: Any = _MISSING) -> Any:
        if pos < len(self.args):
            return self.args[pos]
        if key in self.kwargs:
            return self.kwargs[key]
        if default is _MISSING:
            raise KeyError(key)
        return default

    def has(self, pos: int, key: str) -> bool:
        return pos < len(self.args) or key in self.kwargs

    @property
    def input(self) -> Any:
        return self.args[0] if self.args else self.kwargs.get("input", self.kwargs.get("self"))

    def sizes(self) -> Optional[tuple]:
        """The size arguments of reshape/view/expand/repeat/permute (varargs or one sequence)."""
        rest = self.args[1:]
        if "shape" in self.kwargs:
            rest = (self.kwargs["shape"],)
        if "size" in self.kwargs:
            rest = (self.kwargs["size"],)
        if "dims" in self.kwargs:
            rest = (self.kwargs["dims"],)
        if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
            rest = tuple(rest[0])
        return tuple(rest)

    def dtype_arg(self) -> Any:
        """The dtype a ``to``/``type`` call converts to (None when it names none)."""
        if "dtype" in self.kwargs:
            return self.kwargs["dtype"]
        for a in self.args[1:]:
            if isinstance(a, torch.dtype):
                return a
        return None


def value(node: Any) -> Any:
    """The example value of ``node`` (Dynamo's ``example_value``, or an ATen graph's ``val``)."""
    if not isinstance(node, fx.Node):
        return node
    v = node.meta.get("example_value", node.meta.get("val"))
    return v


def tensor(node: Any) -> Optional[torch.Tensor]:
    v = value(node)
    return v if isinstance(v, torch.Tensor) else None


def shape(node: Any) -> Optional[tuple]:
    t = tensor(node)
    if t is None:
        return None
    out = []
    for s in t.shape:
        if isinstance(s, torch.SymInt):
            expr = s.node.expr
            out.append(int(expr) if expr.is_number else expr)
        else:
            out.append(int(s))
    return tuple(out)


def static_shape(node: Any) -> Optional[tuple[int, ...]]:
    s = shape(node)
    return s if s is not None and all(isinstance(d, int) for d in s) else None


def dtype(node: Any) -> Optional[torch.dtype]:
    t = tensor(node)
    return None if t is None else t.dtype


def norm_dim(d: Any, ndim: int) -> Optional[int]:
    """``d`` as a non-negative dim of an ``ndim``-d tensor (None if it is not one dim)."""
    if isinstance(d, (list, tuple)) and len(d) == 1:
        d = d[0]
    if not isinstance(d, int) or not -ndim <= d < ndim:
        return None
    return d % ndim


def norm_dims(d: Any, ndim: int) -> Optional[frozenset[int]]:
    if d is None:
        return frozenset(range(ndim))
    ds = d if isinstance(d, (list, tuple)) else [d]
    out = [norm_dim(x, ndim) for x in ds]
    return None if any(x is None for x in out) else frozenset(out)


def is_const(x: Any, want: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == want
