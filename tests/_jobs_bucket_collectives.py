"""Rank-pool jobs for tests/test_bucket_collectives.py (module level: the pool pickles them).

Each job trains a SimpleFSDP Llama for two SGD steps eagerly and compiled with
``passes=["bucket_collectives", "sink_waits"]`` (eager inner compiler, strict), asserts
outputs, losses, gradients and parameters close under the tolerance policy, and returns
what the bucketing pass did per graph so the test can assert it changed something.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.reference.numerics import assert_close_tree, train_step_outputs


def simple_fsdp_matches_eager(mode: str) -> dict[str, Any]:
    """``fully_shard``: weight all_gathers + gradient reduce_scatters; ``replicate``: DP
    gradient all_reduces."""
    from commfuse.models import llama, simple_fsdp

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    cfg = llama.LlamaConfig(n_layers=1, dim=32, n_heads=4, ffn_dim=64)

    def model():
        return simple_fsdp.data_parallel(llama.build_llama(cfg, seed=0), mesh, mode)

    def inputs(step):
        return simple_fsdp.make_inputs(cfg, world * 2, 8, rank=rank, world_size=world, seed=step).inputs

    def loss(out):
        return out.float().pow(2).mean()

    torch._dynamo.reset()
    ref = train_step_outputs(model, inputs, steps=2, lr=0.05, loss_fn=loss)
    # Every rank holds the same batch: the memory budget may count its activations (by default it
    # counts only what every rank shares, tests/test_same_decision.py).
    be = commfuse.backend(
        commfuse.Config(
            passes=["bucket_collectives", "sink_waits"],
            inner_compiler="eager",
            strict=True,
            uniform_batches=True,
        )
    )
    got = train_step_outputs(model, inputs, backend=be, steps=2, lr=0.05, loss_fn=loss)
    assert_close_tree(got, ref, dtype=torch.float32, msg=f"{mode} rank {rank}")
    out: dict[str, Any] = {}
    for r in be.reports:
        for p in r.passes:
            if p.name == "bucket_collectives":
                out[r.graph] = {
                    "counts": dict(p.counts),
                    "kinds": {k: t.count for k, t in r.analysis.by_kind.items()} if r.analysis else {},
                }
    return out
