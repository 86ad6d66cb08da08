"""Rank-pool jobs for tests/test_workload_partition.py (module level: the pool pickles them).

Each job trains a small model for two SGD steps eagerly and compiled with
``passes=["workload_partition"]`` (eager inner compiler, strict), asserts outputs, losses,
gradients and parameters close under the tolerance policy, and returns what the pass did
per graph so the test can assert it changed something.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.fuzz.forced import register_forced_passes
from commfuse.reference.numerics import assert_close_tree, train_step_outputs

# A rank-pool worker imports this module to unpickle a job; the jobs may name a forced variant,
# which only the fuzzer and the tests register.
register_forced_passes()


class _MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class _TPGatherMLP(nn.Module):
    """Sequence-parallel input, all_gathered (TP) before a column-parallel matmul + GeLU,
    then a row-parallel matmul whose partial result is reduce-scattered back to the
    sequence shard (Megatron SP written with autograd functional collectives)."""

    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        n, r = dist.get_world_size(), dist.get_rank()
        gen = torch.Generator().manual_seed(0)
        w1 = torch.randn(dim, hidden, generator=gen) / dim**0.5
        w2 = torch.randn(hidden, dim, generator=gen) / hidden**0.5
        cols = hidden // n
        self.w1 = nn.Parameter(w1[:, r * cols : (r + 1) * cols].clone())
        self.w2 = nn.Parameter(w2[r * cols : (r + 1) * cols].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = dist.group.WORLD
        full = funcol.all_gather_tensor_autograd(x, 0, group)
        h = torch.nn.functional.gelu(full @ self.w1)
        return funcol.reduce_scatter_tensor_autograd(h @ self.w2, "sum", 0, group)


def _summary(be: commfuse.CommfuseBackend) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in be.reports:
        for p in r.passes:
            if p.name == "workload_partition":
                out[r.graph] = {
                    "changed": p.changed,
                    "counts": dict(p.counts),
                    "refusals": list(p.refusals),
                    "kinds": {k: t.count for k, t in r.analysis.by_kind.items()} if r.analysis else {},
                }
    return out


def _compare(model, inputs, loss=None) -> dict[str, Any]:
    torch._dynamo.reset()
    ref = train_step_outputs(model, inputs, steps=2, lr=0.05, loss_fn=loss)
    cfg = commfuse.Config(passes=["workload_partition"], inner_compiler="eager", strict=True)
    be = commfuse.backend(cfg)
    got = train_step_outputs(model, inputs, backend=be, steps=2, lr=0.05, loss_fn=loss)
    assert_close_tree(got, ref, dtype=torch.float32, msg=f"rank {dist.get_rank()}")
    return _summary(be)


def _mean(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def simple_fsdp_matches_eager(mode: str) -> dict[str, Any]:
    """SimpleFSDP (``fully_shard``: weight all_gathers before the matmuls, gradient
    reduce_scatters; ``replicate``: DP gradient all_reduces) on an MLP."""
    from commfuse.models import simple_fsdp

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))

    def model():
        return simple_fsdp.data_parallel(_MLP(), mesh, mode)

    def inputs(step):
        return torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(100 * step + rank))

    return _compare(model, inputs, _mean)


def tp_gather_matmul_gelu_matches_eager() -> dict[str, Any]:
    rank = dist.get_rank()

    def inputs(step):
        return torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))

    return _compare(_TPGatherMLP, inputs, _mean)


def uneven_chunks_match_eager(case: str) -> dict[str, Any]:
    """On 2 nodes x 2 ranks, ``centauri_partition_forced`` (every collective Algorithm 1 cuts
    unevenly is cut in its granularity, each chunk group-partitioned) against eager (outputs,
    gradients, parameters over two SGD steps). ``case``: "tp", the TP gather -> matmul + GeLU
    -> matmul -> reduce_scatter MLP (gathers with consumer chains; each reduce_scatter reads a
    reassembled value and stays whole); "fsdp", a SimpleFSDP ``fully_shard`` MLP (weight
    gathers with their matmuls, gradient reduce_scatters with the matmuls that produce them)."""
    from commfuse.models import simple_fsdp
    from _jobs_group_partition import TOPO_2x2

    world, rank = dist.get_world_size(), dist.get_rank()
    commfuse.setup(topology=TOPO_2x2)
    name = "centauri_partition_forced"
    try:
        if case == "tp":
            model = _TPGatherMLP

            def inputs(step):
                return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        else:
            mesh = init_device_mesh("cpu", (world,))

            def model():
                return simple_fsdp.data_parallel(_MLP(), mesh, "fully_shard")

            def inputs(step):
                return torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(100 * step + rank))

        torch._dynamo.reset()
        ref = train_step_outputs(model, inputs, steps=2, lr=0.05, loss_fn=_mean)
        cfg = commfuse.Config(passes=[name], inner_compiler="eager", strict=True, topology=TOPO_2x2)
        be = commfuse.backend(cfg)
        got = train_step_outputs(model, inputs, backend=be, steps=2, lr=0.05, loss_fn=_mean)
        assert_close_tree(got, ref, dtype=torch.float32, msg=f"uneven chunks rank {rank}")
        return {
            r.graph: [
                {k: d[k] for k in ("kind", "scheme", "chunk_sizes")}
                for p in r.passes
                if p.name == name
                for d in p.decisions
            ]
            for r in be.reports
        }
    finally:
        commfuse.session.reset()
