"""A DTensor TP+SP training step as a plain function of local tensors, for ``commfuse.optimize``
on its ``make_fx`` traces (tests/test_optimize_any_graph.py), and the rank-pool job that checks
it on gloo ranks (module level: the pool pickles it).

The step takes this rank's sequence shard of the activations and its shards of the weights,
builds the DTensor parameters with ``DTensor.from_local`` and returns the block's output and
the gradients of a rank-local loss, so that every collective DTensor issues (the SP gathers and
scatters of the forward and backward, the replicated norm's gradient all_reduces) is in the
traced graph.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.reference.numerics import assert_close_tree

from _graphs import SPBlock, parallelize_sp

B, S, H = 2, 8, 16


def sp_step(mesh) -> tuple[Callable[..., Any], list[torch.Tensor]]:
    """(step, the local weight shards): ``step(x_local, *w_local) -> (out, dx, *dw)``."""
    torch.manual_seed(0)
    block = parallelize_sp(SPBlock(H), mesh)
    names = [n for n, _ in block.named_parameters()]
    placements = [p.placements for _, p in block.named_parameters()]
    weights = [p.to_local().detach().clone() for _, p in block.named_parameters()]

    def step(x, *ws):
        params = {
            n: DTensor.from_local(w, mesh, pl, run_check=False)
            for n, w, pl in zip(names, ws, placements, strict=True)
        }
        out = torch.func.functional_call(block, params, (x,))
        loss = out.pow(2).sum()
        return (out, *torch.autograd.grad(loss, [x, *ws]))

    return step, weights


def local_input(rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(B, S // world, H, generator=g)


def trace(step, args: list[torch.Tensor], mode: str) -> torch.fx.GraphModule:
    return make_fx(step, tracing_mode=mode)(*[a.detach().requires_grad_(True) for a in args])


def collectives(gm: torch.fx.GraphModule) -> list[tuple]:
    """The graph's collectives in order: kind, group, input shapes."""
    return [
        (c.kind.value, c.group.name, [[str(s) for s in shape] for shape in c.input_shapes])
        for c in CollectiveIR(gm).collectives
    ]


def passes(gm: torch.fx.GraphModule) -> list[tuple]:
    """What each pass of the graph's last report did: name, changed, counts, error."""
    return [(p.name, p.changed, dict(p.counts), p.error) for p in commfuse.last_report(gm).passes]


def real_trace_optimizes_like_fake_and_matches_eager() -> dict[str, Any]:
    """On this rank: the step eagerly; its real-mode and fake-mode make_fx traces optimised by
    the default pipeline (strict: a pass error raises), then run on the same inputs. Asserts the
    traces' outputs and gradients equal eager's; returns what the pipeline did to each trace."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    step, weights = sp_step(mesh)
    args = [local_input(rank, world), *weights]
    ref = step(*[a.detach().requires_grad_(True) for a in args])
    ref = [t.detach() for t in ref]
    out: dict[str, Any] = {}
    for mode in ("real", "fake"):
        gm = trace(step, args, mode)
        before = collectives(gm)
        commfuse.optimize(gm, commfuse.Config(strict=True))
        got = gm(*[a.detach() for a in args])
        assert_close_tree(
            list(got), ref, dtype=torch.float32, msg=f"{mode}-mode trace, rank {rank}", summands=world
        )
        out[mode] = {
            "before": before,
            "after": collectives(gm),
            "passes": passes(gm),
            "notes": list(commfuse.last_report(gm).notes),
        }
    return out
