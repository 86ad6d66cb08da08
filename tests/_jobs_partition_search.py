"""Rank-pool jobs for the Centauri partition search (module-level so the pool can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.costmodel import Topology
from commfuse.costmodel.topology import PRESETS
from commfuse.reference.numerics import assert_close_tree, train_step_outputs


def small_gpu_topology(**overrides) -> Topology:
    """Two "nodes" of two ranks priced like DGX-H100 links: the 4 gloo ranks of a test."""
    return Topology(
        **{**PRESETS["dgx-h100"], "name": "dgx-h100-2x2", "num_nodes": 2, "ranks_per_node": 2, **overrides}
    )


def partition_search_matches_eager() -> dict:
    """SimpleFSDP Llama layer on 2 nodes x 2: search + sink_waits vs eager, 2 SGD steps, fp32."""
    from commfuse.models import llama, simple_fsdp

    world, rank = dist.get_world_size(), dist.get_rank()
    # Slow inter-node links make partitioning pay at test sizes, so the search changes the graph.
    topo = small_gpu_topology(inter_node_bandwidth_GBps=2.0, intra_node_bandwidth_GBps=20.0)
    commfuse.setup(topology=topo)
    try:
        mesh = init_device_mesh("cpu", (world,))
        cfg = llama.LlamaConfig(n_layers=1, dim=64, n_heads=4, ffn_dim=256, vocab=None)

        def model():
            return simple_fsdp.data_parallel(llama.build_llama(cfg, seed=0), mesh, "fully_shard")

        def inputs(step):
            return simple_fsdp.make_inputs(cfg, world * 2, 32, rank=rank, world_size=world, seed=step).inputs

        def loss(out):
            return out.float().pow(2).mean()

        torch._dynamo.reset()
        ref = train_step_outputs(model, inputs, steps=2, lr=0.05, loss_fn=loss)
        be = commfuse.backend(
            commfuse.Config(
                passes=["centauri_partition", "sink_waits"],
                inner_compiler="eager",
                strict=True,
                topology=topo,
            )
        )
        got = train_step_outputs(model, inputs, backend=be, steps=2, lr=0.05, loss_fn=loss)
        assert_close_tree(got, ref, dtype=torch.float32, msg=f"partition search rank {rank}")
        searches = [p for r in be.reports for p in r.passes if p.name == "centauri_partition"]
        return {
            "changed": any(p.changed for p in searches),
            "schemes": [f"{d['collective']}={d['scheme']}" for p in searches for d in p.decisions],
        }
    finally:
        commfuse.session.reset()
