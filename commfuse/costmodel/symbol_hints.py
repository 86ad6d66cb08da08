"""Sizes for the symbols of a graph that the compiler cannot know: per-symbol hints.

The cost model prices a size it cannot know (a symbol without a hint) at one flat value,
``symbol_hint`` (4096). For a dynamic batch that is a guess among others; for the split sizes
of a dropless token exchange (torchtitan's dispatcher reads them back from the exchanged
counts: unbacked symbols ``u0, u1, ...``) it is far off, since the graph itself says how many
rows the exchange sends: a row count of 48 split into ``[u0, u1]`` is priced as 8192 rows.

:func:`balanced_exchange_hints` reads, from the graph alone, what balanced routing gives every
such symbol: an ``all_to_all_single`` whose input has ``R`` static rows over ``n`` ranks sends
``R / n`` rows to every peer, and under balanced routing receives as many from every peer, so
each of its input and output split symbols is ``R // n``. Symbols no exchange sizes keep the
flat value. The hints depend on the graph only, so every rank prices the same.
:class:`SymbolHints` carries them to :func:`commfuse.costmodel.collectives.concrete`.
"""

from __future__ import annotations

from typing import Any, Mapping

import sympy
import torch
import torch.fx as fx

_A2A = torch.ops._c10d_functional.all_to_all_single.default


class SymbolHints:
    """A value per symbol name, and ``default`` for the others; ``int(hints)`` is the default."""

    def __init__(self, values: Mapping[str, int], default: int = 4096) -> None:
        self.values = dict(values)
        self.default = int(default)

    def __int__(self) -> int:
        return self.default

    def get(self, symbol: sympy.Symbol) -> int:
        return self.values.get(str(symbol), self.default)

    def substitute(self, expr: sympy.Expr) -> sympy.Expr:
        return expr.subs({s: self.get(s) for s in expr.free_symbols})

    def __repr__(self) -> str:
        return f"SymbolHints({self.values}, default={self.default})"


def _symbol(x: Any) -> sympy.Symbol | None:
    expr = x.node.expr if isinstance(x, torch.SymInt) else None
    return expr if isinstance(expr, sympy.Symbol) else None


def balanced_exchange_hints(gm: fx.GraphModule) -> dict[str, int]:
    """Symbol name -> rows at balanced routing, for the split sizes of every ``all_to_all_single``
    of ``gm`` whose input has a static row count (see the module docstring)."""
    hints: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not _A2A or len(n.args) < 3:
            continue
        x = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
        out_splits, in_splits = n.args[1], n.args[2]
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or not isinstance(x.shape[0], int):
            continue
        if not isinstance(in_splits, (list, tuple)) or not in_splits:
            continue
        share = max(1, x.shape[0] // len(in_splits))
        for s in [*in_splits, *(out_splits or [])]:
            v = s.meta.get("val") if isinstance(s, fx.Node) else s
            sym = _symbol(v)
            if sym is not None:
                hints.setdefault(str(sym), share)
    return hints


__all__ = ["SymbolHints", "balanced_exchange_hints"]
