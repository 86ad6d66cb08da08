"""Rank-pool jobs for the overlap scheduler (module-level so the pool can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.reference.numerics import assert_bitwise_equal_tree, train_step_outputs


def scheduled_fsdp_matches_eager() -> dict:
    """SimpleFSDP Llama layer, schedule_overlap alone vs eager, 2 SGD steps, fp32: bitwise equal
    (a pure reorder; eager and the eager inner compiler are bitwise equal on CPU)."""
    from commfuse.models import llama, simple_fsdp

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    cfg = llama.LlamaConfig(n_layers=1, dim=32, n_heads=4, ffn_dim=64)

    def model():
        return simple_fsdp.data_parallel(llama.build_llama(cfg, seed=0), mesh, "fully_shard")

    def inputs(step):
        return simple_fsdp.make_inputs(cfg, world * 2, 8, rank=rank, world_size=world, seed=step).inputs

    torch._dynamo.reset()
    ref = train_step_outputs(model, inputs, steps=2, lr=0.05)
    be = commfuse.backend(commfuse.Config(passes=["schedule_overlap"], inner_compiler="eager", strict=True))
    got = train_step_outputs(model, inputs, backend=be, steps=2, lr=0.05)
    assert_bitwise_equal_tree(got, ref, msg=f"schedule_overlap rank {rank}")
    recs = [p for r in be.reports for p in r.passes if p.name == "schedule_overlap"]
    return {
        "changed": any(p.changed for p in recs),
        "orders": [d.get("kept") for p in recs for d in p.decisions],
    }
