"""Rank-pool jobs for tests/test_gloo_reduce_scatter.py (module level: the pool pickles them).

Each job trains a SimpleFSDP model (weight all_gathers in forward, gradient reduce_scatters in
backward) for two SGD steps eagerly and compiled with the given passes (eager inner compiler,
strict), asserts outputs, losses, gradients and parameters close under the tolerance policy,
and returns what ``gloo_reduce_scatter`` did per graph so the test can assert it rewrote
something (and the same on every rank).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.costmodel.topology import Topology
from commfuse.reference.numerics import assert_close_tree, train_step_outputs

PASS = "gloo_reduce_scatter"


class _MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


def _factories(model_name: str, dtype: torch.dtype, grad_reduction: str):
    from commfuse.models import llama, simple_fsdp

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    if model_name == "mlp":

        def model() -> nn.Module:
            torch.manual_seed(0)
            return simple_fsdp.data_parallel(
                _MLP().to(dtype), mesh, "fully_shard", grad_reduction=grad_reduction
            )

        def inputs(step: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(100 * step + rank)
            return torch.randn(4, 8, generator=g).to(dtype)

        return model, inputs
    cfg = llama.LlamaConfig(n_layers=1, dim=32, n_heads=4, ffn_dim=64)

    def llama_model() -> nn.Module:
        return simple_fsdp.data_parallel(
            llama.build_llama(cfg, seed=0).to(dtype), mesh, "fully_shard", grad_reduction=grad_reduction
        )

    def llama_inputs(step: int) -> torch.Tensor:
        return simple_fsdp.make_inputs(cfg, world * 2, 8, rank=rank, world_size=world, seed=step).inputs.to(
            dtype
        )

    return llama_model, llama_inputs


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def simple_fsdp_matches_eager(
    model_name: str,
    dtype_name: str,
    passes: list[str],
    grad_reduction: str = "mean",
    topology_nodes: Optional[int] = None,
) -> dict[str, Any]:
    """``topology_nodes``: None runs without a topology (the pass's cpu-gloo default); n declares
    ``Topology.preset("cpu-gloo", num_nodes=n)`` (2 ranks per node)."""
    dtype = getattr(torch, dtype_name)
    model, inputs = _factories(model_name, dtype, grad_reduction)
    topo = Topology.preset("cpu-gloo", num_nodes=topology_nodes) if topology_nodes else None
    torch._dynamo.reset()
    ref = train_step_outputs(model, inputs, steps=2, lr=0.05, loss_fn=_loss)
    be = commfuse.backend(commfuse.Config(passes=passes, inner_compiler="eager", strict=True, topology=topo))
    got = train_step_outputs(model, inputs, backend=be, steps=2, lr=0.05, loss_fn=_loss)
    # bf16: gloo adds in bf16 hop by hop, the local sum rounds once; reordered over the world's ranks.
    summands = dist.get_world_size() if dtype != torch.float32 else None
    assert_close_tree(
        got, ref, dtype=dtype, msg=f"{model_name} {dtype_name} rank {dist.get_rank()}", summands=summands
    )
    out: dict[str, Any] = {}
    for r in be.reports:
        for p in r.passes:
            if p.name == PASS:
                out[r.graph] = {
                    "counts": dict(p.counts),
                    "refusals": list(p.refusals),
                    "decisions": [dict(d) for d in p.decisions],
                    "kinds": {k: t.count for k, t in r.analysis.by_kind.items()} if r.analysis else {},
                    "order_hash": r.order_hash,
                }
    return out


def _scatter_program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    h = torch.tanh(x @ w)
    return funcol.reduce_scatter_single(h, "sum", 0, dist.group.WORLD) * 2


def inductor_compiles_the_lowering() -> dict[str, Any]:
    """The lowered graph through Inductor (the default inner compiler): compiled equals eager,
    and the pass lowered the reduce_scatter (compile caches off: a hit skips commfuse's hooks)."""
    import torch._functorch.config as fcfg
    import torch._inductor.config as icfg

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(8, 4, generator=g)
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(7))
    ref = _scatter_program(x, w)
    be = commfuse.backend(commfuse.Config(passes=[PASS], inner_compiler="inductor", strict=True))
    with icfg.patch(fx_graph_cache=False), fcfg.patch(enable_autograd_cache=False):
        got = torch.compile(_scatter_program, backend=be)(x, w)
    assert_close_tree(got, ref, dtype=torch.float32, msg=f"rank {dist.get_rank()}")
    return {
        "counts": [p.counts for r in be.reports for p in r.passes if p.name == PASS],
        "kinds": {r.graph: sorted(r.analysis.by_kind) for r in be.reports if r.analysis},
    }
