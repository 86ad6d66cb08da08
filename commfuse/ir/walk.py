"""Walks over FX graphs that several layers need."""

from __future__ import annotations

import torch.fx as fx


def descendants(n: fx.Node) -> set[fx.Node]:
    """``n`` and every node computed from it."""
    seen, todo = {n}, [n]
    while todo:
        for u in todo.pop().users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen
