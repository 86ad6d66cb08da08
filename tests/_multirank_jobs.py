"""Jobs run on every rank of a gloo pool (module-level so the pool can pickle them)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.reference.numerics import assert_close_tree, train_step_outputs


def example_config(name: str, **overrides: Any) -> commfuse.Config:
    """The backend config a test uses for example ``name``: TP examples declare their
    group's role, as a user would with ``commfuse.setup(mesh=...)`` or ``group_roles``."""
    if name.startswith(("llama_tp", "moe_tp", "moe_sp")):
        mesh_group = dist.group.WORLD.group_name
        overrides.setdefault("group_roles", {mesh_group: "tp"})
    # These tests check that Chimera's rewrites train like eager; on models this small the
    # step-time gate (tests/test_step_time_gate.py) would rightly keep the unrewritten graph.
    overrides.setdefault("step_time_gate", False)
    return commfuse.Config(**overrides)


def _example(name: str, dtype: torch.dtype) -> tuple[Callable[[], torch.nn.Module], Callable[[int], Any]]:
    """(model factory, input factory) for one example model on the current world."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    if name == "llama_tp":
        # Plain TP (no SP), embedding and head included: chimera turns it into SP.
        from commfuse.models import llama

        cfg = llama.LlamaConfig(n_layers=2, dim=32, n_heads=4, ffn_dim=64, vocab=64)

        def model():
            return llama.parallelize_llama(
                llama.build_llama(cfg, seed=0).to(dtype), mesh, sequence_parallel=False
            )

        def inputs(step):
            return llama.make_inputs(
                cfg, 2, 8, rank=rank, world_size=world, sequence_parallel=False, seed=step
            ).inputs
    elif name == "llama_tp_sp":
        from commfuse.models import llama

        cfg = llama.LlamaConfig(n_layers=1, dim=32, n_heads=4, ffn_dim=64)

        def model():
            return llama.parallelize_llama(
                llama.build_llama(cfg, seed=0).to(dtype), mesh, sequence_parallel=True
            )

        def inputs(step):
            return llama.make_inputs(cfg, 2, 8, rank=rank, world_size=world, seed=step).inputs.to(dtype)
    elif name == "moe_ep":
        from commfuse.models import moe

        def model():
            return moe.parallelize_moe(
                moe.build_moe(dim=16, num_experts=world * 2, ffn_dim=32, seed=0).to(dtype), mesh
            )

        def inputs(step):
            return moe.make_inputs(world * 2, 4, 16, rank=rank, world_size=world, seed=step).inputs.to(dtype)
    elif name.startswith(("moe_tp_ep", "moe_sp_ep_sp")):
        # TP attention + commfuse's MoE layer with EP over the same ranks (Chimera TP+EP, SP+EP+SP).
        from commfuse.models import moe_tp

        layout = "sp_ep_sp" if name.startswith("moe_sp") else "tp_ep"
        capacity = name.endswith("_capacity")
        # Capacity that can drop tokens, made exact on shards by token groups = world
        # (batch 1 so a sequence shard is a run of whole groups).
        cfg = moe_tp.MoETPConfig(
            n_layers=2 if layout == "tp_ep" else 1,
            dim=32,
            n_heads=4,
            num_experts=2 * world,
            ffn_dim=32,
            capacity_factor=1.0 if capacity else 0.0,
            token_groups=world if capacity else 1,
            vocab=64 if layout == "tp_ep" else None,
        )
        batch = 1 if capacity else 2

        def model():
            return moe_tp.parallelize_moe_tp(moe_tp.build_moe_tp(cfg, seed=0).to(dtype), mesh, layout)

        def inputs(step):
            gen = torch.Generator().manual_seed(step)
            if cfg.vocab:
                return torch.randint(0, cfg.vocab, (batch, 16), generator=gen)
            return torch.randn(batch, 4, 32, generator=gen).to(dtype)  # this rank's sequence shard
    elif name == "simple_fsdp":
        from commfuse.models import llama, simple_fsdp

        cfg = llama.LlamaConfig(n_layers=1, dim=32, n_heads=4, ffn_dim=64)

        def model():
            return simple_fsdp.data_parallel(llama.build_llama(cfg, seed=0).to(dtype), mesh, "fully_shard")

        def inputs(step):
            return simple_fsdp.make_inputs(
                cfg, world * 2, 8, rank=rank, world_size=world, seed=step
            ).inputs.to(dtype)
    else:
        raise ValueError(name)
    return model, inputs


def _mean_logits(out: torch.Tensor) -> torch.Tensor:
    return out.float().mean()


def _moe_tp_loss(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return out[0].float().mean() + 0.01 * out[1]


LOSSES: dict[str, Callable[[Any], torch.Tensor]] = {
    "llama_tp": _mean_logits,
    **{name: _moe_tp_loss for name in ("moe_tp_ep", "moe_tp_ep_capacity", "moe_sp_ep_sp")},
}


def compiled_matches_eager(
    name: str, dtype_name: str, inner: str = "eager", steps: int = 2, passes: list[str] | None = None
) -> dict:
    """Train `steps` SGD steps eagerly and with backend=commfuse; assert outputs, grads, params close."""
    dtype = getattr(torch, dtype_name)
    model, inputs = _example(name, dtype)
    torch._dynamo.reset()
    # Mean-reduced loss: gradients of magnitude O(1), the scale the tolerance policy assumes.
    loss = LOSSES.get(name)
    ref = train_step_outputs(model, inputs, steps=steps, lr=0.05, loss_fn=loss)
    be = commfuse.backend(example_config(name, inner_compiler=inner, strict=True, passes=passes))
    with commfuse.record() as rec:  # the runtime's own account of what it issued
        got = train_step_outputs(model, inputs, backend=be, steps=steps, lr=0.05, loss_fn=loss)
    # MoE in bf16: the rewritten program reduces in another order (reduce_scatter instead
    # of all_reduce, token shards), and the router amplifies those roundings; widen atol for
    # reductions over the world's ranks as the tolerance policy defines it.
    summands = dist.get_world_size() if name.startswith("moe_") and dtype != torch.float32 else None
    assert_close_tree(
        got, ref, dtype=dtype, msg=f"{name} {dtype_name} rank {dist.get_rank()}", summands=summands
    )
    kinds = sorted({k for r in be.reports if r.analysis for k in r.analysis.by_kind})
    wire = {r.graph: r.analysis.total.wire_bytes for r in be.reports if r.analysis}
    return {
        "kinds": kinds,
        "wire": wire,
        "passes": [p.model_dump() for r in be.reports for p in r.passes],
        "wire_before_after": [(r.graph, r.input_wire_bytes, r.output_wire_bytes) for r in be.reports],
        "graphs": [r.graph for r in be.reports],
        "state_dict": _state_dict_meta(model, inputs),
        "planned": [[c.kind for c in p.collectives] for p in be.plans],
        "steps": steps,
        "recorded": [c.kind for c in rec.collectives],
        "completed": all(c.end_ns is not None and c.end_ns >= c.issued_ns for c in rec.collectives),
    }


def _state_dict_meta(model_factory, inputs) -> list:
    """Compile and run a fresh model; parameter names, shapes and dtypes must not change."""
    m = model_factory()
    before = {k: (tuple(v.shape), str(v.dtype)) for k, v in m.state_dict().items()}
    torch._dynamo.reset()
    torch.compile(m, backend=commfuse.backend(inner_compiler="eager"))(inputs(0))
    after = {k: (tuple(v.shape), str(v.dtype)) for k, v in m.state_dict().items()}
    assert before == after, (before, after)
    return sorted(before)


# -- hostile inputs ----------------------------------------------------------------
class _CheckpointedSPMLP(torch.nn.Module):
    """Sequence-parallel MLP written with autograd functional collectives, wrapped in checkpoint.

    (DTensor modules inside `checkpoint` cannot be compiled at all in torch 2.13 — AOTAutograd
    tries to save the DeviceMesh for backward, with any backend — so the DTensor examples
    cannot be used here; see docs/reliability.md.)
    """

    def __init__(self, selective: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = torch.nn.Linear(16, 32)
        self.w2 = torch.nn.Linear(32, 16)
        self.selective = selective

    def _body(self, x):
        import torch.distributed._functional_collectives as funcol

        full = funcol.all_gather_tensor_autograd(x, 0, dist.group.WORLD)
        y = self.w2(torch.relu(self.w1(full)))
        return funcol.reduce_scatter_tensor_autograd(y, "sum", 0, dist.group.WORLD)

    def forward(self, x):
        import functools

        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        kw = {}
        if self.selective:
            ops = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]
            kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, ops)
        return checkpoint(self._body, x, use_reentrant=False, **kw) + x


def checkpointed_model_matches_eager(selective: bool) -> bool:
    """Activation checkpointing (full or selective) around collectives, compiled with commfuse."""
    rank = dist.get_rank()

    def inputs(step):
        g = torch.Generator().manual_seed(100 * step + rank)
        return torch.randn(4, 16, generator=g)

    torch._dynamo.reset()
    model = lambda: _CheckpointedSPMLP(selective)  # noqa: E731
    ref = train_step_outputs(model, inputs, steps=2, lr=0.05)
    be = commfuse.backend(inner_compiler="eager", strict=True)
    got = train_step_outputs(model, inputs, backend=be, steps=2, lr=0.05)
    assert_close_tree(got, ref, dtype=torch.float32, msg=f"checkpoint selective={selective} rank {rank}")
    ran = [p.name for r in be.reports for p in r.passes]
    assert "sink_waits" in ran, [
        r.model_dump(include={"graph", "skipped_reason", "input_problems"}) for r in be.reports
    ]
    return True


def inplace_all_reduce_matches_eager() -> list:
    """User code mutating with dist.all_reduce (traced as functional all_reduce + copy_)."""

    def f(x, w):
        y = x @ w
        dist.all_reduce(y)
        return torch.relu(y) + x.sum()

    torch._dynamo.reset()
    x = torch.arange(12.0).reshape(3, 4) + dist.get_rank()
    w = torch.ones(4, 4)
    ref = f(x.clone(), w)
    got = torch.compile(f, backend=commfuse.backend(inner_compiler="eager", strict=True))(x.clone(), w)
    assert torch.equal(ref, got)
    return got.tolist()


# -- commfuse.moe -----------------------------------------------------------------
def moe_op_matches_unsharded(capacity_factor: float, top_k: int) -> float:
    """The EP op (E/N experts per rank, own tokens) against the single-process op on every
    rank's tokens with all experts and token_groups = N: outputs and all gradients."""
    from commfuse.moe import MoELayer

    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = MoELayer(8, 2 * n, 16, top_k=top_k, capacity_factor=capacity_factor, token_groups=n)
    ep = MoELayer(8, 2 * n, 16, top_k=top_k, capacity_factor=capacity_factor, token_groups=1)
    ep.load_state_dict(full.state_dict())
    ep.expert_parallel(dist.group.WORLD)
    x = torch.randn(4 * n, 8, generator=torch.Generator().manual_seed(5), requires_grad=True)
    up = torch.randn(4 * n, 8, generator=torch.Generator().manual_seed(6))
    out, stats = full(x)
    ((out * up).sum() + stats.load_balancing_loss() + stats.z_loss()).backward()
    mine = slice(4 * r, 4 * r + 4)
    xl = x.detach()[mine].clone().requires_grad_()
    got, st = ep(xl)
    # the statistics are sums over this rank's tokens: the global ones are their sum
    glob = [t.clone() for t in (st.probs_sum, st.top1_count, st.z_sum)]
    for t in glob:
        dist.all_reduce(t)
    ref_stats = [stats.probs_sum, stats.top1_count, stats.z_sum]
    ((got * up[mine]).sum()).backward()
    # x.grad of the reference also holds the aux-loss part; compare the token part alone
    x2 = x.detach().clone().requires_grad_()
    (x2_grad,) = torch.autograd.grad((full(x2)[0] * up).sum(), [x2])
    experts = slice(r * 2, r * 2 + 2)
    pairs = [
        (got, out[mine]),
        (xl.grad, x2_grad[mine]),
        (ep.w1.grad, full.w1.grad[experts]),
        (ep.w3.grad, full.w3.grad[experts]),
        (ep.w2.grad, full.w2.grad[experts]),
        *zip(glob, ref_stats, strict=True),
    ]
    worst = 0.0
    for a, b in pairs:
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-5)
        worst = max(worst, float((a - b).abs().max()))
    return worst


def moe_regroup_matches_grouped_reference() -> dict:
    """Capacity that drops tokens, token_groups=1, with Config.moe_capacity_regroup: the
    compiled program runs each rank's sequence shard as its own token group, so it must
    equal the eager model built with token_groups = N (the same new grouping)."""
    from commfuse.models import moe_tp

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    base = dict(
        n_layers=1, dim=32, n_heads=4, num_experts=2 * world, ffn_dim=32, capacity_factor=1.0, vocab=64
    )

    def model(groups):
        cfg = moe_tp.MoETPConfig(token_groups=groups, **base)
        return lambda: moe_tp.parallelize_moe_tp(moe_tp.build_moe_tp(cfg, seed=0), mesh, "tp_ep")

    def inputs(step):
        return torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(step))

    torch._dynamo.reset()
    ref = train_step_outputs(model(world), inputs, steps=1, lr=0.05, loss_fn=_moe_tp_loss)
    results = {}
    for regroup in (False, True):
        torch._dynamo.reset()
        be = commfuse.backend(
            example_config("moe_tp_ep", inner_compiler="eager", strict=True, moe_capacity_regroup=regroup)
        )
        got = train_step_outputs(model(1), inputs, backend=be, steps=1, lr=0.05, loss_fn=_moe_tp_loss)
        joint = [r for r in be.reports if r.graph == "joint"][0]
        sharded = [e for e in joint.analysis.embedded if e.what == "dispatch" and not e.backward]
        results[regroup] = {
            "dispatch_bytes": [e.logged_bytes for e in sharded],
            "refusals": [x for p in joint.passes for x in p.refusals],
        }
        if regroup:
            assert_close_tree(got, ref, dtype=torch.float32, msg=f"regroup rank {dist.get_rank()}")
    return results


def topology_against_the_world() -> dict:
    """The topology a compile uses, checked against the real world size: one that holds another
    number of ranks is refused with an error naming it; the torchrun environment's is detected."""
    import os

    from commfuse.core.errors import ConfigError
    from commfuse.session import resolved_topology

    out = {}
    try:
        resolved_topology(commfuse.Config(topology=commfuse.Topology.preset("dgx-h100")))
    except ConfigError as e:
        out["error"] = str(e)
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(dist.get_world_size())
    try:
        topo, source = resolved_topology(commfuse.Config())
        out["detected"] = (topo.name, topo.world_size, source)
    finally:
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE")
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    return out
