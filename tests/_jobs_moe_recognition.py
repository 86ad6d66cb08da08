"""Rank-pool jobs for tests/test_moe_recognition.py (module-level so the pool can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.models import moe_styles as ms
from commfuse.reference.numerics import assert_close_tree, train_step_outputs


def _loss(out):
    return out[0].float().pow(2).mean() + 0.1 * out[1]


def style_matches_eager(style: str, dtype_name: str, layout: str = "ep", steps: int = 2) -> dict:
    """A user-style MoE (``commfuse.models.moe_styles``) trained ``steps`` SGD steps eagerly
    and compiled with the default commfuse pipeline (eager inner compiler): outputs, the
    loss, every gradient and parameter close per the tolerance policy. ``layout="ep"``: the
    layer alone with expert parallelism over the world, each rank with its own tokens;
    ``"sp_ep_sp"``: the TP attention block with sequence-parallel residual stream."""
    dtype = getattr(torch, dtype_name)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    group = mesh.get_group()
    if layout == "ep":
        # capacity 1.0 binds (drops happen): recognition must keep the same drops
        cfg = ms.MoEStyleConfig(
            style=style, dim=16, num_experts=2 * world, ffn_dim=32, top_k=2, capacity_factor=1.0
        )

        def model():
            return ms.build_moe_style(cfg).to(dtype).expert_parallel(group)

        def inputs(step):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            return torch.randn(2, 4, 16, generator=gen).to(dtype)

        config = commfuse.Config(inner_compiler="eager", strict=True, moe_recognition="always")
    else:
        cfg = ms.MoEStyleConfig(
            style=style, dim=32, num_experts=2 * world, ffn_dim=32, top_k=2, capacity_factor=float(world)
        )  # gshard: capacity that cannot bind

        def model():
            return ms.parallelize_moe_style_tp(ms.build_moe_style_tp(cfg).to(dtype), mesh, layout)

        def inputs(step):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            return torch.randn(2, 2, 32, generator=gen).to(dtype)  # this rank's sequence shard

        config = commfuse.Config(inner_compiler="eager", strict=True, group_roles={group.group_name: "tp"})
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch._dynamo.reset()
        ref = train_step_outputs(model, inputs, steps=steps, lr=0.05, loss_fn=_loss)
        be = commfuse.backend(config)
        got = train_step_outputs(model, inputs, backend=be, steps=steps, lr=0.05, loss_fn=_loss)
        torch._dynamo.reset()
    summands = world if dtype != torch.float32 else None
    assert_close_tree(
        got, ref, dtype=dtype, msg=f"{style} {layout} {dtype_name} rank {rank}", summands=summands
    )
    counts: dict[str, int] = {}
    for r in be.dynamo_reports + be.reports:
        for p in r.passes:
            for k, v in p.counts.items():
                counts[f"{r.graph}:{p.name}.{k}"] = counts.get(f"{r.graph}:{p.name}.{k}", 0) + v
    return {
        "counts": counts,
        "refusals": [x for r in be.dynamo_reports + be.reports for p in r.passes for x in p.refusals],
    }


def _counts_and_refusals(be) -> dict:
    counts: dict[str, int] = {}
    for r in be.dynamo_reports + be.reports:
        for p in r.passes:
            for k, v in p.counts.items():
                counts[f"{r.graph}:{p.name}.{k}"] = counts.get(f"{r.graph}:{p.name}.{k}", 0) + v
    wire = {r.graph: (r.input_wire_bytes, r.output_wire_bytes) for r in be.reports}
    kinds = {r.graph: (r.input_kinds, r.output_kinds) for r in be.reports}
    return {
        "counts": counts,
        "wire": wire,
        "kinds": kinds,
        "refusals": [x for r in be.dynamo_reports + be.reports for p in r.passes for x in p.refusals],
    }


def user_style_matches_eager(style: str, layout: str, steps: int = 2) -> dict:
    """An independently written MoE layer (tests/_user_moe_layers.py) with experts split over
    the world, trained ``steps`` SGD steps eagerly and compiled with the default pipeline
    (eager inner compiler): outputs, loss, gradients and parameters close. ``layout="ep"``:
    each rank routes its own tokens (capacity that drops tokens for the GShard style;
    recognition forced, since "auto" leaves pure EP alone); ``"sp_ep_sp"``: the tokens are
    sequence shards the layer gathers, and it returns its own chunk."""
    import _user_moe_layers as user

    world, rank = dist.get_world_size(), dist.get_rank()
    group = init_device_mesh("cpu", (world,)).get_group().group_name
    hidden, experts, ffn, top_k = 16, 2 * world, 32, 2
    sp = layout == "sp_ep_sp"
    tokens = 2 * 4 * (world if sp else 1)  # tokens the layer routes per rank
    par = dict(group=group, ranks=world, rank=rank, sp=sp, seed=3)

    def model():
        if style == "einsum_capacity":
            # EP: 2 slots for 2 assignments per expert on average (drops happen); SP: capacity that cannot bind
            return user.EinsumCapacityMoE(hidden, experts, ffn, top_k, capacity=tokens if sp else 2, **par)
        if style == "sort_dropless":
            return user.SortDroplessMoE(hidden, experts, ffn, top_k, **par)
        return user.ExpertLoopMoE(hidden, experts, ffn, top_k, **par)

    def inputs(step):
        return torch.randn(2, 4, hidden, generator=torch.Generator().manual_seed(1000 * step + rank))

    def loss(out):
        return out[0].pow(2).mean() + 0.1 * out[1] if isinstance(out, tuple) else out.pow(2).mean()

    # the rewrites themselves are under test: at this size the step-time gate would keep the unrewritten graph
    config = commfuse.Config(
        inner_compiler="eager",
        strict=True,
        moe_recognition="auto" if sp else "always",
        group_roles={group: "tp"} if sp else {},
        step_time_gate=False,
    )
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        torch._dynamo.reset()
        ref = train_step_outputs(model, inputs, steps=steps, lr=0.05, loss_fn=loss)
        be = commfuse.backend(config)
        got = train_step_outputs(model, inputs, backend=be, steps=steps, lr=0.05, loss_fn=loss)
        torch._dynamo.reset()
    assert_close_tree(got, ref, dtype=torch.float32, msg=f"{style} {layout} rank {rank}")
    return _counts_and_refusals(be)
