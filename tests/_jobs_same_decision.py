"""Rank-pool jobs for tests/test_same_decision.py (module level: the pool pickles them).

SimpleFSDP data parallelism (the README's style) on real gloo ranks whose local batches differ:
rank 0 holds 64 sequences, then 1, then 64 again, rank 1 holds 64 every step. Trained with the
default pipeline and compared with eager; the collectives each rank's graphs issue after the
pipeline are returned so the test can compare them across ranks.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.reference.numerics import assert_close_tree, train_step_outputs

# local batch per step, per rank
BATCHES = ((64, 64), (1, 64), (64, 64))


class _MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, hidden)
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(torch.relu(self.w2(torch.relu(self.w1(x)))))


def uneven_batches_train_like_eager(dynamic: Optional[bool]) -> dict[str, Any]:
    """``dynamic``: torch.compile's (None: automatic dynamic shapes, False: static, True:
    symbolic from the first compile; Dynamo specialises a batch of 1 in every case)."""
    from commfuse.models import simple_fsdp

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def model() -> nn.Module:
        torch.manual_seed(0)
        return simple_fsdp.data_parallel(_MLP(), mesh, "fully_shard")

    def inputs(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 * step + rank)
        return torch.randn(BATCHES[step][rank], 16, generator=g)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean()

    steps = len(BATCHES)
    torch._dynamo.reset()
    ref = train_step_outputs(model, inputs, steps=steps, lr=0.05, loss_fn=loss)
    # The net of commfuse/agreement.py off: the collectives must match by construction.
    be = commfuse.backend(commfuse.Config(inner_compiler="eager", check_agreement=False))
    patch = (
        {"automatic_dynamic_shapes": False}
        if dynamic is False
        else {"assume_static_by_default": False}
        if dynamic
        else {}
    )
    with torch._dynamo.config.patch(**patch):
        got = train_step_outputs(model, inputs, backend=be, steps=steps, lr=0.05, loss_fn=loss)
    for key in ("loss", "grads"):
        assert_close_tree(got[key], ref[key], dtype=torch.float32, rtol=1e-4, msg=f"{key}, rank {rank}")
    sequences: dict[str, list] = {}
    lowered = 0
    for r in be.reports:
        assert r.analysis is not None
        seq = [
            (c.kind, c.reduce_op, c.dtype, [str(s) for s in c.input_shapes]) for c in r.analysis.collectives
        ]
        if seq not in sequences.setdefault(r.graph, []):
            sequences[r.graph].append(seq)
        lowered += sum(p.counts.get("lowered", 0) for p in r.passes if p.name == "gloo_reduce_scatter")
    return {"sequences": sequences, "graphs": len(be.reports), "lowered": lowered}
