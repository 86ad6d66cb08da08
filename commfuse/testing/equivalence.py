"""Is a rewritten graph the same program? Run both on the reference interpreter.

:func:`check_equivalent` feeds the graph before and after a rewrite the same random
per-rank inputs (made from the placeholders' fake values), runs both for every
rank on the reference semantics and compares every output under the harness's
tolerance policy (bitwise with ``exact=True``). Pass unit tests use it on graphs
traced under the fake process group, where nothing can be run for real.

Inputs that the program's ops require to be equal on every rank of a group (the router
weight of ``commfuse::moe_layer``: see ``replicated`` of
:func:`~commfuse.reference.semantics.register_sync_op`) are made equal on every rank even
when the other inputs differ (:func:`replicated_placeholders`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from commfuse.ir.kinds import collective_spec, is_wait
from commfuse.reference.groups import GroupSpec
from commfuse.reference.interpreter import run_reference
from commfuse.reference.numerics import assert_bitwise_equal_tree, assert_close_tree
from commfuse.reference.semantics import sync_op_spec


def replicated_placeholders(gm: fx.GraphModule) -> set[fx.Node]:
    """Placeholders that must hold the same value on every rank: those a group-synchronous op's
    ``replicated`` argument (the MoE router weight) is computed from by local compute (views,
    casts, element-wise ops). The walk stops at collectives and waits: an all_gathered FSDP
    shard is equal on every rank after the gather, not before."""
    stack: list[fx.Node] = []
    for n in gm.graph.nodes:
        spec = sync_op_spec(n.target) if n.op == "call_function" else None
        if spec is not None:
            stack += [
                n.args[i] for i in spec.replicated if i < len(n.args) and isinstance(n.args[i], fx.Node)
            ]
    seen: set[fx.Node] = set()
    out: set[fx.Node] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v.op == "placeholder":
            out.add(v)
        elif (
            v.op == "call_function"
            and collective_spec(v.target) is None
            and not is_wait(v.target)
            and sync_op_spec(v.target) is None
        ):
            stack.extend(v.all_input_nodes)
    return out


def random_inputs(
    gm: fx.GraphModule, world_size: int, seed: int = 0, int_high: int = 8, *, replicated: bool = False
) -> list[list[Any]]:
    """Per-rank inputs for ``gm``'s placeholders, different on every rank unless
    ``replicated`` (the tensor-parallel contract: every rank holds the same inputs); those the
    program requires equal on every rank (:func:`replicated_placeholders`) are always equal."""
    same = replicated_placeholders(gm)
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
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, n in enumerate(phs):
        if n in same and isinstance(out[0][i], torch.Tensor):
            for rank in range(1, world_size):
                out[rank][i] = out[0][i].clone()
    return out


def check_equivalent(
    before: fx.GraphModule,
    after: fx.GraphModule,
    world_size: int,
    *,
    groups: Mapping[str, GroupSpec] | None = None,
    seed: int = 0,
    exact: bool = False,
    inputs: Sequence[Sequence[Any]] | None = None,
    summands: int | None = None,
    replicated_inputs: bool = False,
) -> list[Any]:
    """Assert ``after`` computes what ``before`` does on every rank; returns ``after``'s outputs."""
    if inputs is None:
        inputs = random_inputs(before, world_size, seed, replicated=replicated_inputs)
    expected = run_reference(before, inputs, groups=groups)
    actual = run_reference(after, inputs, groups=groups)
    for rank, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if exact:
            assert_bitwise_equal_tree(a, e, msg=f"rank {rank}")
        else:
            assert_close_tree(a, e, msg=f"rank {rank}", summands=summands or world_size)
    return actual
