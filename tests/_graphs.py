"""Small graph builders shared by the single-process (fake process group) tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse


def all_kinds_fn(x: torch.Tensor, y: torch.Tensor):
    """One of every collective kind functional collectives produce, on the world group."""
    g = dist.group.WORLD
    a = funcol.all_reduce(x, "sum", g)
    b = funcol.all_gather_tensor(x, 1, g)  # dim-1 gather: dim-0 collective + split/cat
    c = funcol.reduce_scatter_tensor(y, "sum", 1, g)  # dim-1 scatter
    d = funcol.all_to_all_single(y, None, None, g)
    e = funcol.broadcast(x, 0, g)
    f = funcol.all_reduce_coalesced([x, y], "avg", g)
    h = funcol.all_gather_into_tensor_coalesced([x, y], g)
    i = funcol.reduce_scatter_tensor_coalesced([y, y], "sum", [0, 0], g)
    s = torch.ops._c10d_functional.isend(x, 1, 0, g.group_name)
    r = torch.ops._c10d_functional.irecv(torch.empty_like(x), 1, 0, g.group_name)
    s = torch.ops._c10d_functional.wait_tensor(s)
    r = torch.ops._c10d_functional.wait_tensor(r)
    return a, b, c, d, e, f, h, i, r


def trace_all_kinds():
    return make_fx(all_kinds_fn, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 16))


class SPBlock(nn.Module):
    """LayerNorm -> Linear -> ReLU -> Linear with a residual; parallelised TP+SP by `parallelize_sp`."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.w1 = nn.Linear(d, 4 * d)
        self.w2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


def parallelize_sp(m: SPBlock, mesh) -> SPBlock:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    return parallelize_module(
        m,
        mesh,
        {
            "norm": SequenceParallel(),
            "w1": ColwiseParallel(input_layouts=Shard(1)),
            "w2": RowwiseParallel(output_layouts=Shard(1)),
        },
    )


def summary(report: commfuse.AnalysisReport) -> str:
    """One line per collective: the fields tests snapshot."""
    lines = []
    for c in report.collectives:
        lines.append(
            f"{c.node}: {c.kind} g{c.group}/{c.group_size} dim={c.logical_dim}"
            f"{'' if c.logical_concat_dim is None else f'->{c.logical_concat_dim}'} "
            f"in={c.input_shapes} out={c.output_shapes} logged={c.logged_bytes} wire={c.wire_bytes} "
            f"role={c.role}({c.role_source})"
        )
    return "\n".join(lines)


def prefetch_fn(x, w1, w2, w3):
    """Three weight gathers, each issued (as AOTAutograd does) right before its matmul."""
    g = dist.group.WORLD
    h = torch.tanh(x @ x)
    h = h @ funcol.all_gather_tensor(w1, 0, g)
    h = torch.tanh(h @ x)
    h = h @ funcol.all_gather_tensor(w2, 0, g)
    h = torch.tanh(h @ x)
    return h @ funcol.all_gather_tensor(w3, 0, g)


def prefetch_graph(n: int = 256, world: int = 8):
    """``prefetch_fn`` traced on the fake process group (call inside ``fake_process_group(world)``)."""
    return make_fx(prefetch_fn, tracing_mode="fake")(
        torch.randn(n, n), *[torch.randn(n // world, n) for _ in range(3)]
    )
