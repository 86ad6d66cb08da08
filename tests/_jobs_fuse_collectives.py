"""Rank-pool jobs for tests/test_fuse_collectives.py (module level: the pool pickles them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commfuse
from commfuse.reference.numerics import assert_close_tree, train_step_outputs


class _TwoGroups(torch.nn.Module):
    """all_gather on one group, then reduce_scatter on another group of the same ranks (the
    backward: all_gather on the second, reduce_scatter on the first)."""

    def __init__(self, first: str, second: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(8, 8) / 8)
        self.first, self.second = first, second

    def forward(self, x):
        y = funcol.all_gather_tensor_autograd(x @ self.w, 0, self.first)
        z = funcol.reduce_scatter_tensor_autograd(y, "sum", 1, self.second)
        return z.tanh()


def same_members_fuse_like_unfused() -> dict[str, Any]:
    """Two groups with equal membership under different names: compiled with
    ``fuse_collectives`` alone (eager inner compiler, strict) vs eager, two SGD steps;
    outputs, losses, gradients and parameters close. Returns the pass's counts per graph and
    the group names the compiled graphs' collectives use."""
    world, rank = dist.get_world_size(), dist.get_rank()
    g1 = dist.new_group(list(range(world)))
    g2 = dist.new_group(list(range(world)))
    assert g1.group_name != g2.group_name

    def model():
        return _TwoGroups(g1.group_name, g2.group_name)

    def inputs(step):
        torch.manual_seed(100 * step + rank)
        return torch.randn(4, 8)

    def loss(out):
        return out.pow(2).mean()

    torch._dynamo.reset()
    ref = train_step_outputs(model, inputs, steps=2, lr=0.05, loss_fn=loss)
    be = commfuse.backend(commfuse.Config(passes=["fuse_collectives"], inner_compiler="eager", strict=True))
    got = train_step_outputs(model, inputs, backend=be, steps=2, lr=0.05, loss_fn=loss)
    assert_close_tree(got, ref, dtype=torch.float32, msg=f"rank {rank}")
    out: dict[str, Any] = {"first": g1.group_name, "second": g2.group_name, "graphs": {}}
    for r in be.reports:
        for p in r.passes:
            if p.name == "fuse_collectives":
                out["graphs"][r.graph] = {
                    "counts": {k: v for k, v in p.counts.items() if v},
                    "refusals": list(p.refusals),
                    "groups": sorted(r.analysis.by_group) if r.analysis else None,
                }
    return out
