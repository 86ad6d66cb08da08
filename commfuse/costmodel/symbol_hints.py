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
flat value. :class:`SymbolHints` carries them to :func:`commfuse.costmodel.collectives.concrete`.

Rank-invariant: a symbol is never priced at the example value the compiler traced it with (its
ShapeEnv hint). That value is this rank's own size -- a data-parallel rank's local batch -- and
another rank that traced another batch, or a static one, would price otherwise. The hints depend
on the graph only, so every rank prices the same.

Bounded: symbols without a hint of their own that multiply together in one size or one shape
share the flat value, ``k`` of them at ``default ** (1/k)`` each (:func:`hinted`): a batch x
sequence shape ``[s0, s1, d]`` is priced as 64 x 64 rows of ``d``, not 4096 x 4096, which priced a
tiny MLP's step at minutes. Symbols that only add up (the split sizes of an exchange) keep the flat
value each.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import sympy
import torch
import torch.fx as fx

_A2A = torch.ops._c10d_functional.all_to_all_single.default
# The flat value of a symbol nothing else sizes: rows of an unknown batch (x sequence) on one rank.
DEFAULT_SYMBOL_HINT = 4096


class SymbolHints:
    """A value per symbol name, and ``default`` for the others; ``int(hints)`` is the default."""

    def __init__(self, values: Mapping[str, int], default: int = DEFAULT_SYMBOL_HINT) -> None:
        self.values = dict(values)
        self.default = int(default)

    def __int__(self) -> int:
        return self.default

    def get(self, symbol: sympy.Symbol) -> int:
        return self.values.get(str(symbol), self.default)

    def substitute(self, expr: sympy.Expr) -> sympy.Expr:
        flat = sorted((s for s in expr.free_symbols if str(s) not in self.values), key=str)
        return expr.subs(hinted(expr.free_symbols, self, degree=_degree(expr, flat)))

    def __repr__(self) -> str:
        return f"SymbolHints({self.values}, default={self.default})"


def hinted(
    symbols: Iterable[sympy.Symbol],
    hint: "int | SymbolHints" = DEFAULT_SYMBOL_HINT,
    *,
    degree: Optional[int] = None,
) -> dict[sympy.Symbol, int]:
    """Values for ``symbols`` that appear together in one size or shape: a symbol with a hint of its
    own (``SymbolHints.values``) takes it; the others share the flat default. ``degree``: how many
    of them multiply together at most (default: all of them); each is hinted at
    ``default ** (1/degree)`` (at least 1), so a product of them stands for at most ``default``
    elements, while a sum of split sizes keeps ``default`` per symbol."""
    own = hint.values if isinstance(hint, SymbolHints) else {}
    syms = sorted(set(symbols), key=str)
    flat = [s for s in syms if str(s) not in own]
    k = len(flat) if degree is None else min(max(degree, 1), max(len(flat), 1))
    share = max(1, int(round(int(hint) ** (1.0 / k)))) if flat else 1
    return {s: own.get(str(s), share) for s in syms}


def _degree(expr: sympy.Expr, symbols: list[sympy.Symbol]) -> int:
    """The most of ``symbols`` that multiply together in one term of ``expr``."""
    if not symbols:
        return 1
    try:
        return max(1, sympy.Poly(expr, *symbols).total_degree())
    except (sympy.PolynomialError, sympy.GeneratorsNeeded, ValueError, TypeError):
        return len(symbols)  # floor divisions and the like: as if they all multiplied


def hinted_size(x: Any, hint: "int | SymbolHints" = DEFAULT_SYMBOL_HINT) -> int:
    """An int for one size (int, SymInt or sympy expression), its symbols hinted by :func:`hinted`."""
    return hinted_shape([x], hint)[0]


def hinted_shape(shape: Iterable[Any], hint: "int | SymbolHints" = DEFAULT_SYMBOL_HINT) -> tuple[int, ...]:
    """The sizes of one shape, its symbols hinted together by :func:`hinted` (never the example
    value a SymInt was traced with: that is this rank's own)."""
    exprs: list[Any] = []
    for s in shape:
        if isinstance(s, (bool, int)):
            exprs.append(int(s))
            continue
        e = s if isinstance(s, sympy.Expr) else getattr(getattr(s, "node", None), "expr", None)
        if e is None:
            e = sympy.sympify(int(s))
        exprs.append(e)
    syms = set().union(*(e.free_symbols for e in exprs if isinstance(e, sympy.Expr)))
    own = hint.values if isinstance(hint, SymbolHints) else {}
    flat = sorted((x for x in syms if str(x) not in own), key=str)
    numel = sympy.Mul(*[e for e in exprs if isinstance(e, sympy.Expr)])
    values = hinted(syms, hint, degree=_degree(numel, flat)) if syms else {}
    return tuple(
        e if isinstance(e, int) else max(0, int(e.subs(values) if e.free_symbols else e)) for e in exprs
    )


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


__all__ = [
    "DEFAULT_SYMBOL_HINT",
    "SymbolHints",
    "balanced_exchange_hints",
    "hinted",
    "hinted_shape",
    "hinted_size",
]
