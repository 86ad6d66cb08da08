"""Is a rewritten graph the same program? Run both on the reference interpreter.

:func:`check_equivalent` feeds the graph before and after a rewrite the same random
per-rank inputs (made from the placeholders' fake values), runs both for every
rank on the reference semantics and compares every output under the harness's
tolerance policy (bitwise with ``exact=True``). Pass unit tests use it on graphs
traced under the fake process group, where nothing can be run for real.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from ..testing.numerics import assert_bitwise_equal_tree, assert_close_tree
from .groups import GroupSpec
from .interpreter import run_reference


def random_inputs(gm: fx.GraphModule, world_size: int, seed: int = 0, int_high: int = 8, *,
                  replicated: bool = False) -> list[list[Any]]:
    """Per-rank inputs for ``gm``'s placeholders, different on every rank unless
    ``replicated`` (the tensor-parallel contract: every rank holds the same inputs)."""
    out = []
    for rank in range(world_size):
        gen = torch.Generator().manual_seed(seed * 1009 + (0 if replicated else rank))
        vals = []
        for n in gm.graph.nodes:
            if n.op != "placeholder":
                continue
            v = n.meta.get("val")
            if not isinstance(v, torch.Tensor):
                # Opaque objects (DTensor's script objects) and scalars only flow to outputs here.
                vals.append(v if isinstance(v, (int, float, bool)) else None)
                continue
            shape = tuple(int(s) for s in v.shape)
            if v.dtype.is_floating_point:
                t = torch.randn(shape, generator=gen).to(v.dtype)
            elif v.dtype == torch.bool:
                t = torch.rand(shape, generator=gen) > 0.5
            else:
                t = torch.randint(0, int_high, shape, generator=gen).to(v.dtype)
            vals.append(t)
        out.append(vals)
    return out


def check_equivalent(before: fx.GraphModule, after: fx.GraphModule, world_size: int, *,
                     groups: Mapping[str, GroupSpec] | None = None, seed: int = 0, exact: bool = False,
                     inputs: Sequence[Sequence[Any]] | None = None, summands: int | None = None,
                     replicated_inputs: bool = False) -> list[Any]:
    """Assert ``after`` computes what ``before`` does on every rank; returns ``after``'s outputs."""
    if inputs is None:
        inputs = random_inputs(before, world_size, seed, replicated=replicated_inputs)
    expected = run_reference(before, inputs, groups=groups)
    actual = run_reference(after, inputs, groups=groups)
    for rank, (a, e) in enumerate(zip(actual, expected)):
        if exact:
            assert_bitwise_equal_tree(a, e, msg=f"rank {rank}")
        else:
            assert_close_tree(a, e, msg=f"rank {rank}", summands=summands or world_size)
    return actual
