"""Dropless MoE token exchanges written as graph all_to_alls, traced the way Dynamo traces them.

torchtitan's token dispatcher exchanges the per-expert counts, reads the split sizes back with
``.tolist()`` (unbacked symbols), sends the rows with ``all_to_all_single_autograd``, regroups
them by expert, runs the grouped experts (``_grouped_mm`` in bfloat16, SwiGLU), puts the rows
back and sends them home. :func:`dropless_block` writes that block in plain torch (the expert
regrouping as a fixed row permutation); :func:`trace_static` traces a function on static input
shapes with a shape environment, so sizes read from tensors become unbacked symbols as they do
under Dynamo; :func:`dropless_joint_graph` traces the block's forward and backward in one graph.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv


def trace_static(
    fn: Callable[..., Any], inputs: Sequence[torch.Tensor], requires_grad: Sequence[int] = ()
) -> fx.GraphModule:
    """``make_fx(fn)`` on fake copies of ``inputs`` with static shapes in a fresh shape
    environment (``requires_grad``: the positions of inputs that need gradients)."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        args = [mode.from_tensor(t, static_shapes=True) for t in inputs]
        for i in requires_grad:
            args[i].requires_grad_(True)
        return make_fx(fn, tracing_mode="real")(*args)


def dropless_block(ranks: int, local_experts: int, dim: int, *, group=None) -> Callable[..., torch.Tensor]:
    """``block(x [rows, dim], counts [ranks * local_experts], w1, w3 [local, ffn, dim], w2 [local,
    dim, ffn])``: the rows (already sorted by destination expert) sent to their experts' ranks,
    bfloat16 SwiGLU experts over the expert offsets, the results sent back (float32)."""

    def block(x, counts, w1, w3, w2):
        g = group or dist.group.WORLD
        recv = funcol.all_to_all_single(counts, None, None, g).view(ranks, local_experts)
        in_splits = counts.view(ranks, local_experts).sum(1).tolist()
        out_splits = recv.sum(1).tolist()
        routed = funcol.all_to_all_single_autograd(x, out_splits, in_splits, g)
        rows = routed.shape[0]
        # rank-major to expert-major (torchtitan computes the permutation from the counts)
        perm = torch.arange(rows - 1, -1, -1)
        offs = torch.cumsum(recv.sum(0), 0).to(torch.int32)
        r = routed[perm].bfloat16()
        h = F.silu(torch._grouped_mm(r, w1.bfloat16().transpose(-2, -1), offs=offs)) * torch._grouped_mm(
            r, w3.bfloat16().transpose(-2, -1), offs=offs
        )
        y = torch._grouped_mm(h, w2.bfloat16().transpose(-2, -1), offs=offs).float()
        back = torch.index_put(y.new_zeros((rows, dim)), (perm,), y)
        return funcol.all_to_all_single_autograd(back, in_splits, out_splits, g)

    return block


def dropless_joint_graph(ranks: int, local_experts: int, tokens: int, dim: int, ffn: int) -> fx.GraphModule:
    """The block's forward and backward (gradients of the tokens and the three expert weights)
    traced in one graph; needs a (fake) process group of ``ranks``."""
    block = dropless_block(ranks, local_experts, dim)

    def joint(x, counts, w1, w3, w2):
        out = block(x, counts, w1, w3, w2)
        return (out, *torch.autograd.grad(out.sum(), [x, w1, w3, w2]))

    inputs = [
        torch.randn(tokens, dim),
        torch.zeros(ranks * local_experts, dtype=torch.int64),
        torch.randn(local_experts, ffn, dim),
        torch.randn(local_experts, ffn, dim),
        torch.randn(local_experts, dim, ffn),
    ]
    return trace_static(joint, inputs, requires_grad=(0, 2, 3, 4))


__all__ = ["dropless_block", "dropless_joint_graph", "trace_static"]
