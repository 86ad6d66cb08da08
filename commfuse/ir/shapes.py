"""Shape/size helpers over fake-tensor metadata; symbolic sizes stay symbolic (sympy)."""

from __future__ import annotations

from typing import Any, Union

import sympy
import torch
import torch.fx as fx

Size = Union[int, sympy.Expr]


def as_size(s: Any) -> Size:
    """int for concrete sizes, the sympy expression for a SymInt."""
    if isinstance(s, torch.SymInt):
        expr = s.node.expr
        return int(expr) if expr.is_number else expr
    return int(s)


def tensor_meta(node: Any) -> torch.Tensor | None:
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def shape_of(node: Any) -> tuple[Size, ...] | None:
    val = tensor_meta(node)
    return None if val is None else tuple(as_size(s) for s in val.shape)


def numel(shape: tuple[Size, ...]) -> Size:
    n: Size = 1
    for s in shape:
        n = n * s
    return n


def nbytes(node: Any) -> Size | None:
    val = tensor_meta(node)
    if val is None:
        return None
    return numel(shape_of(node)) * val.dtype.itemsize  # type: ignore[arg-type]


def size_to_json(s: Size | None) -> int | str | None:
    if s is None or isinstance(s, int):
        return s
    return int(s) if s.is_number else str(s)


def is_concrete(s: Size | None) -> bool:
    return isinstance(s, int)
