"""Rank jobs for tests/test_primitive_substitution.py (module level: the pool pickles them by reference)."""

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

FORCED = "primitive_substitution_forced"


class _MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


def _mlp_factory(mode: str, grad_reduction: str):
    from commfuse.models import simple_fsdp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def model() -> nn.Module:
        torch.manual_seed(0)
        return simple_fsdp.data_parallel(_MLP(), mesh, mode, grad_reduction=grad_reduction)

    def inputs(step: int) -> torch.Tensor:  # this rank's micro-batch
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        return torch.randn(4, 8, generator=g)

    return model, inputs


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def simple_fsdp_mlp_matches_eager(mode: str, grad_reduction: str = "mean", steps: int = 2) -> dict[str, Any]:
    """SimpleFSDP MLP (``fully_shard``: weight all_gathers in forward, gradient reduce_scatters in
    backward; ``replicate``: gradient all_reduces) trained eagerly and compiled with the forced
    substitution under the eager inner compiler; outputs, grads and params must be close."""
    model, inputs = _mlp_factory(mode, grad_reduction)
    torch._dynamo.reset()
    ref = train_step_outputs(model, inputs, steps=steps, lr=0.1, loss_fn=_loss)
    be = commfuse.backend(commfuse.Config(passes=[FORCED], inner_compiler="eager", strict=True))
    got = train_step_outputs(model, inputs, backend=be, steps=steps, lr=0.1, loss_fn=_loss)
    assert_close_tree(
        got, ref, dtype=torch.float32, msg=f"{mode} rank {dist.get_rank()}", summands=dist.get_world_size()
    )
    return {
        "kinds": {
            r.graph: {k: v.count for k, v in r.analysis.by_kind.items()} for r in be.reports if r.analysis
        },
        "counts": [p.counts for r in be.reports for p in r.passes if p.name == FORCED],
        "refusals": [x for r in be.reports for p in r.passes if p.name == FORCED for x in p.refusals],
        "max_abs_diff": max(
            float((a - b).abs().max())
            for a, b in zip(got["grads"].values(), ref["grads"].values(), strict=True)
            if a is not None
        ),
    }


def _sp_program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Sequence-parallel style: gather along dim 1, matmul, scatter back along dim 1 (avg)."""
    g = funcol.all_gather_single(x, 1, dist.group.WORLD)
    h = torch.tanh(g @ w)
    return funcol.reduce_scatter_single(h, "avg", 1, dist.group.WORLD) * 1


def inductor_compiles_rooted_forms() -> dict[str, Any]:
    """The forced substitution under Inductor (rooted reduce as a fallback kernel, broadcasts as
    functional collectives): compiled equals eager, and the generated graph holds the rooted ops."""
    torch._dynamo.reset()
    n = dist.get_world_size()
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(3, 2, 4, generator=g)
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(7))
    ref = _sp_program(x, w)
    be = commfuse.backend(commfuse.Config(passes=[FORCED], inner_compiler="inductor", strict=True))
    import torch._functorch.config as fcfg
    import torch._inductor.config as icfg

    # a cache hit skips commfuse's hooks (by design); this job looks at what they did
    with icfg.patch(fx_graph_cache=False), fcfg.patch(enable_autograd_cache=False):
        got = torch.compile(_sp_program, backend=be)(x, w)
    assert_close_tree(got, ref, dtype=torch.float32, msg=f"rank {dist.get_rank()}", summands=n)
    counts = [p.counts for r in be.reports for p in r.passes if p.name == FORCED]
    kinds = {r.graph: sorted(r.analysis.by_kind) for r in be.reports if r.analysis}
    return {"counts": counts, "kinds": kinds}
