"""Rank-pool jobs for tests/test_moe_2x2_mesh.py (module level: the pool pickles them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse import session
from commfuse.models import moe_styles as ms
from commfuse.reference.numerics import assert_close_tree, train_step_outputs

DIM, SEQ, BATCH = 16, 4, 2


def _loss(out):
    return out[0].pow(2).mean() + 0.1 * out[1]


def moe_block_on_2x2_mesh(style: str, layout: str, seq: int = SEQ, **config: Any) -> dict[str, Any]:
    """4 gloo ranks as a 2 x 2 mesh ``("ep", "tp")`` declared with ``commfuse.setup(mesh=)``: one
    decoder block of :mod:`commfuse.models.moe_styles` (``style``: "gshard" or "dropless") with
    attention TP over ``mesh["tp"]`` (ranks {0, 1}, {2, 3}) and the experts split over
    ``mesh["ep"]`` (ranks {0, 2}, {1, 3}), ``layout`` "tp_ep" (every TP rank holds the whole
    sequence; the two ranks of a TP group get the same tokens) or "sp_ep_sp" (each TP rank holds
    a sequence shard). The default backend (eager inner compiler) against eager, two SGD steps:
    outputs, losses, gradients and parameters close. Returns, per compiled graph, the collectives
    before and after commfuse's pipeline, their wire bytes per rank, the counts of the passes and
    fuse_collectives' refusals; and the bytes the runtime recorder saw this rank hand to c10d per
    collective kind and mesh dim (``"all_to_all@ep"``) in a second (already compiled) step.
    ``seq``: tokens per sequence (each TP group's batch is ``[2, seq, 16]``)."""
    rank = dist.get_rank()
    _forget_earlier_meshes()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    ep_index = mesh.get_coordinate()[0]
    sp = layout == "sp_ep_sp"
    # 4 experts, 2 per EP rank; GShard capacity that cannot bind (every token fits its expert)
    cfg = ms.MoEStyleConfig(
        style=style, dim=DIM, num_experts=4, ffn_dim=16, top_k=2, capacity_factor=4.0, n_heads=2
    )

    def model():
        return ms.parallelize_moe_style_tp(ms.build_moe_style_tp(cfg), mesh["tp"], layout, ep_mesh=mesh["ep"])

    def inputs(step):
        # the TP contract: one TP group's ranks see one batch (tp_ep: the same tokens; sp_ep_sp:
        # shards of one sequence); the EP peers, one per TP group, see different batches
        gen = torch.Generator().manual_seed(1000 * step + 10 * ep_index)
        x = torch.randn(BATCH, seq, DIM, generator=gen)
        return x.chunk(2, dim=1)[mesh.get_coordinate()[1]].contiguous() if sp else x

    session.reset()
    commfuse.setup(mesh=mesh)
    try:
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            out = _train_and_record(model, inputs, rank, f"{style} {layout}", config)
    finally:
        torch._dynamo.reset()
        session.reset()
    dims = {mesh.get_group(d).group_name: d for d in ("ep", "tp")}
    out["recorded_sent"] = {
        f"{kind}@{dims.get(group, group)}": n for (kind, group), n in out["recorded_sent"].items()
    }
    return out


def _forget_earlier_meshes() -> None:
    """DTensor's sharding and redistribution caches compare meshes without their process groups: a
    rank pool's earlier job's 2 x 2 mesh (its groups destroyed since) would be handed back
    (see benchmarks/thirdparty.py)."""
    import torch.distributed.tensor._redistribute as redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    redistribute.clear_redistribute_planner_cache()


def _train_and_record(model, inputs, rank, what, config) -> dict[str, Any]:
    torch._dynamo.reset()
    ref = train_step_outputs(model, inputs, steps=2, lr=0.05, loss_fn=_loss)
    be = commfuse.backend(commfuse.Config(inner_compiler="eager", **config))
    got = train_step_outputs(model, inputs, backend=be, steps=2, lr=0.05, loss_fn=_loss)
    assert_close_tree(got, ref, dtype=torch.float32, msg=f"{what} rank {rank}")
    torch._dynamo.reset()
    compiled = torch.compile(
        model(), backend=commfuse.backend(commfuse.Config(inner_compiler="eager", **config))
    )
    _loss(compiled(inputs(0))).backward()  # compile outside the recording
    with commfuse.record() as rec:
        _loss(compiled(inputs(1))).backward()
    recorded: dict[tuple[str, str], int] = {}
    for c in rec.collectives:
        recorded[(c.kind, c.issue_group)] = recorded.get((c.kind, c.issue_group), 0) + c.sent_bytes
    out: dict[str, Any] = {"graphs": {}, "recorded_sent": recorded, "refusals": [], "counts": {}}
    for r in be.dynamo_reports + be.reports:
        for p in r.passes:
            for k, v in p.counts.items():
                if v:
                    key = f"{r.graph}:{p.name}.{k}"
                    out["counts"][key] = out["counts"].get(key, 0) + v
            out["refusals"].extend(f"{r.graph}:{p.name}: {x}" for x in p.refusals)
    for r in be.reports:
        g = out["graphs"].setdefault(r.graph, {})
        g["before"] = dict(sorted(r.input_kinds.items()))
        g["after"] = dict(sorted(r.output_kinds.items()))
        g["wire"] = (r.input_wire_bytes, r.output_wire_bytes)
        g["collectives"] = [
            (c.kind, c.group_ranks, c.input_shapes, c.wire_bytes)
            for c in (r.analysis.collectives if r.analysis is not None else [])
        ]
    return out
