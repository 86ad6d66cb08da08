"""Rank-pool jobs for tests/test_expert_exchange_partition.py's uneven cut (module level: the pool
pickles them).

On 4 gloo ranks declared as 2 nodes x 2 (``commfuse.setup`` creates the intra- and inter-node
sub-groups), commfuse.models.moe's MoE block (capacity dispatch, expert parallel over the world)
is trained for two SGD steps eagerly and compiled with ``passes=["expert_exchange_partition"]``
(eager inner compiler, strict). The pipeline model is made to price Algorithm 1's uneven cut
below the even ones, so the pass takes it wherever Algorithm 1 picks uneven proportions: the
rewrite is checked on real all_to_alls, not the choice. Losses, gradients and parameters are
asserted close to eager's; the job returns what the pass did per graph so the test can assert
the uneven cut happened and every rank decided the same.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.reference.numerics import assert_close_tree, train_step_outputs

PASS = "expert_exchange_partition"


def uneven_moe_matches_eager() -> dict[str, Any]:
    from _jobs_group_partition import TOPO_2x2

    from commfuse.models import moe
    from commfuse.transforms import expert_exchange_partition as xp

    world, rank = dist.get_world_size(), dist.get_rank()
    commfuse.setup(topology=TOPO_2x2)
    priced = xp._uneven_span
    xp._uneven_span = lambda *a, **k: 1.0
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        # 64 tokens per rank: 20 capacity slots per expert (top-2 of 8, factor 1.25), which the
        # 4 units of 2:1:1 divide
        batch = moe.make_inputs(8, 32, 32, rank=rank, world_size=world)

        def model():
            return moe.parallelize_moe(moe.build_moe(dim=32, num_experts=8, ffn_dim=64, seed=0), mesh)

        def inputs():
            return batch.inputs

        def loss(out):
            return moe.loss_fn(out[0], out[1], batch)

        torch._dynamo.reset()
        ref = train_step_outputs(model, inputs, steps=2, lr=0.05, loss_fn=loss)
        be = commfuse.backend(commfuse.Config(passes=[PASS], inner_compiler="eager", strict=True, topology=TOPO_2x2))
        got = train_step_outputs(model, inputs, backend=be, steps=2, lr=0.05, loss_fn=loss)
        assert_close_tree(got, ref, dtype=torch.float32, msg=f"uneven exchange rank {rank}")
    finally:
        xp._uneven_span = priced
        commfuse.session.reset()
    out: dict[str, Any] = {}
    for r in be.reports:
        for p in r.passes:
            if p.name == PASS:
                out[r.graph] = {"changed": p.changed, "refusals": list(p.refusals),
                                "decisions": [{k: d.get(k) for k in ("chunks", "sizes", "granularity", "decision")}
                                              for d in p.decisions],
                                "kinds": {k: t.count for k, t in r.analysis.by_kind.items()} if r.analysis else {}}
    return out
