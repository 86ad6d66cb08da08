"""Rank-pool jobs for tests/test_fuse_across_groups.py (module level: the pool pickles them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

import commfuse
from commfuse import session
from commfuse.reference.numerics import assert_close_tree, train_step_outputs


class TensorToExpertTransition(torch.nn.Module):
    """A sequence-parallel projection handing its tokens to expert parallelism on a 2-D mesh:
    all_gather of the sequence over the ``tp`` group, then the token exchange (all_to_all over
    the batch) on the ``ep`` group, then local expert work. The backward runs the transposed
    pair: all_to_all on ``ep``, then reduce_scatter of the sequence on ``tp``."""

    def __init__(self, tp: str, ep: str, dim: int = 8, tp_mesh=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        w_in = torch.randn(dim, dim) / dim
        if tp_mesh is not None:  # a replicated DTensor weight, as a TP plan leaves the router or a norm
            w_in = DTensor.from_local(w_in, tp_mesh, [Replicate()], run_check=False)
        self.w_in = torch.nn.Parameter(w_in)
        self.w_out = torch.nn.Parameter(torch.randn(dim, dim) / dim)
        self.tp, self.ep = tp, ep

    def forward(self, x):  # x: [batch, seq / tp, dim]
        w_in = self.w_in.to_local() if isinstance(self.w_in, DTensor) else self.w_in
        h = funcol.all_gather_tensor_autograd(x @ w_in, 1, self.tp)  # [batch, seq, dim]
        h = funcol.all_to_all_single_autograd(h, None, None, self.ep)  # batch rows to their expert rank
        return (h @ self.w_out).tanh()


def tp_to_ep_trains_like_eager(declared_by: str = "setup") -> dict[str, Any]:
    """4 ranks as a 2 x 2 mesh (``ep`` x ``tp``), known to commfuse from ``commfuse.setup(mesh=...)``
    (``declared_by="setup"``) or only from a DTensor weight on the mesh's ``tp`` slice
    (``"dtensor"``, no setup): the default backend (eager inner compiler) against eager, two SGD
    steps; outputs, losses, gradients and parameters close. Returns what fuse_collectives did per
    graph and the bytes the runtime recorder saw per collective kind in the second step."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    tp, ep = mesh.get_group("tp").group_name, mesh.get_group("ep").group_name
    session.reset()
    if declared_by == "setup":
        commfuse.setup(mesh=mesh)

    def model():
        return TensorToExpertTransition(tp, ep, tp_mesh=mesh["tp"] if declared_by == "dtensor" else None)

    def inputs(step):
        torch.manual_seed(100 * step + rank)
        return torch.randn(4, 6, 8)

    def loss(out):
        return out.pow(2).mean()

    try:
        return _train_and_record(model, inputs, loss, rank)
    finally:
        session.reset()


def _train_and_record(model, inputs, loss, rank) -> dict[str, Any]:
    torch._dynamo.reset()
    ref = train_step_outputs(model, inputs, steps=2, lr=0.05, loss_fn=loss)
    be = commfuse.backend(commfuse.Config(inner_compiler="eager"))
    got = train_step_outputs(model, inputs, backend=be, steps=2, lr=0.05, loss_fn=loss)
    assert_close_tree(got, ref, dtype=torch.float32, msg=f"rank {rank}")
    torch._dynamo.reset()
    compiled = torch.compile(model(), backend=commfuse.backend(commfuse.Config(inner_compiler="eager")))
    compiled(inputs(0)).pow(2).mean().backward()  # compile outside the recording
    with commfuse.record() as rec:
        compiled(inputs(1)).pow(2).mean().backward()
    recorded: dict[str, int] = {}
    for c in rec.collectives:
        recorded[c.kind] = recorded.get(c.kind, 0) + c.sent_bytes
    out: dict[str, Any] = {"graphs": {}, "recorded_sent": recorded}
    for r in be.reports:
        g = out["graphs"].setdefault(r.graph, {"counts": {}, "kinds": []})
        out.setdefault("refusals", []).extend(x for p in r.passes for x in p.refusals if "groups differ" in x)
        for p in r.passes:  # fuse_collectives runs inside chimera in the default pipeline
            for k, v in p.counts.items():  # chimera prefixes its steps' counts with the step
                if "m2ms_" in k and v:
                    key = k[k.index("m2ms_") :]
                    g["counts"][key] = g["counts"].get(key, 0) + v
        if r.analysis is not None:
            g["kinds"] = sorted(r.analysis.by_kind)
    return out
