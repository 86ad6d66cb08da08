"""Rank-pool jobs for tests/test_expert_exchange_partition.py (module level: the pool pickles them).

The job trains commfuse.models.moe's MoE block (capacity dispatch, expert parallel over the 4
gloo ranks, as examples/moe_ep.py) for two SGD steps eagerly and compiled with
``passes=["expert_exchange_partition"]`` (eager inner compiler, strict), asserts losses,
gradients and parameters close under the tolerance policy, and returns what the pass did per
graph so the test can assert it changed something and every rank decided the same.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.fuzz.forced import register_forced_passes
from commfuse.reference.numerics import assert_close_tree, train_step_outputs

# A rank-pool worker imports this module to unpickle a job; the jobs may name a forced variant,
# which only the fuzzer and the tests register.
register_forced_passes()

PASS = "expert_exchange_partition"


def moe_matches_eager(
    passes: tuple[str, ...] = (PASS,), seq: int = 16, two_nodes: bool = False, **cfg: Any
) -> dict[str, Any]:
    """commfuse.models.moe's block (capacity dispatch, experts over the world) trained two SGD
    steps eagerly and compiled with ``passes`` (eager inner compiler, strict); ``two_nodes``: the
    4 ranks declared as 2 nodes x 2 (``commfuse.setup`` creates the sub-groups Algorithm 1's
    two-level exchange needs). Returns what the passes did per graph."""
    from commfuse.models import moe

    world, rank = dist.get_world_size(), dist.get_rank()
    if two_nodes:
        from _jobs_group_partition import TOPO_2x2

        commfuse.setup(topology=TOPO_2x2)
        cfg = {"topology": TOPO_2x2, **cfg}
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        batch = moe.make_inputs(8, seq, 32, rank=rank, world_size=world)

        def model():
            return moe.parallelize_moe(moe.build_moe(dim=32, num_experts=8, ffn_dim=64, seed=0), mesh)

        def inputs():
            return batch.inputs

        def loss(out):
            return moe.loss_fn(out[0], out[1], batch)

        torch._dynamo.reset()
        ref = train_step_outputs(model, inputs, steps=2, lr=0.05, loss_fn=loss)
        be = commfuse.backend(
            commfuse.Config(passes=list(passes), inner_compiler="eager", strict=True, **cfg)
        )
        got = train_step_outputs(model, inputs, backend=be, steps=2, lr=0.05, loss_fn=loss)
        assert_close_tree(got, ref, dtype=torch.float32, msg=f"rank {rank}")
    finally:
        if two_nodes:
            commfuse.session.reset()
    out: dict[str, Any] = {}
    for r in be.reports:
        for p in r.passes:
            if p.name in passes:
                out[r.graph] = {
                    "changed": p.changed,
                    "counts": dict(p.counts),
                    "refusals": list(p.refusals),
                    "decisions": [d["decision"] for d in p.decisions],
                    "kinds": {k: t.count for k, t in r.analysis.by_kind.items()} if r.analysis else {},
                }
    return out


def moe_tp_matches_eager(layout: str, **cfg: Any) -> dict[str, Any]:
    """commfuse.models.moe_tp (attention tensor parallel, the dropless ``commfuse::moe_layer``
    with its experts over the same ranks; ``layout`` "tp_ep" or "sp_ep_sp") trained eagerly and
    compiled with the pass; returns what the pass did per graph."""
    from commfuse.models import moe_tp

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    config = moe_tp.MoETPConfig(n_layers=1, dim=32, n_heads=4, num_experts=2 * world, ffn_dim=32)
    gen = torch.Generator().manual_seed(1 + (rank if layout == "sp_ep_sp" else 0))
    x = torch.randn(2, 16 // world, 32, generator=gen)

    def model():
        return moe_tp.parallelize_moe_tp(moe_tp.build_moe_tp(config, seed=0), mesh, layout)

    def loss(out):
        return out[0].float().pow(2).mean() + 0.01 * out[1]

    torch._dynamo.reset()
    ref = train_step_outputs(model, lambda: (x,), steps=2, lr=0.05, loss_fn=loss)
    be = commfuse.backend(commfuse.Config(passes=[PASS], inner_compiler="eager", strict=True, **cfg))
    got = train_step_outputs(model, lambda: (x,), backend=be, steps=2, lr=0.05, loss_fn=loss)
    assert_close_tree(got, ref, dtype=torch.float32, msg=f"rank {rank}")
    out: dict[str, Any] = {}
    for r in be.reports:
        for p in r.passes:
            if p.name == PASS:
                out[r.graph] = {
                    "counts": dict(p.counts),
                    "decisions": [d["decision"] for d in p.decisions],
                    "refusals": list(p.refusals),
                }
    return out
