"""Rank-pool jobs for tests/test_group_partition.py (module level: the pool pickles them by reference).

Every job declares the 4 gloo ranks as 2 "nodes" of 2 ranks with `commfuse.setup`, so the
world spans nodes with 2 ranks on each and its sub-groups are {0,1},{2,3} (intra) and
{0,2},{1,3} (inter).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.costmodel import Topology
from commfuse.reference.numerics import assert_close_tree, train_step_outputs

# CPU topology (priced as gloo): hop latencies dominate these tiny tensors and the launch
# is cheap, so the hierarchical sequences are predicted faster than the flat collectives
# (one inter-node hop fewer per level than a ring over 4 ranks across 2 nodes).
TOPO_2x2 = Topology(
    name="test-2x2",
    num_nodes=2,
    ranks_per_node=2,
    intra_node_bandwidth_GBps=100.0,
    inter_node_bandwidth_GBps=1.0,
    intra_node_latency_us=1.0,
    inter_node_latency_us=5.0,
    collective_launch_us=0.1,
)


@contextlib.contextmanager
def counting_new_group(calls: list) -> Iterator[None]:
    """Record the ranks of every `dist.new_group` call (public and c10d module attribute)."""
    orig = dist.new_group

    def counted(ranks=None, *args, **kwargs):
        calls.append(sorted(ranks) if ranks is not None else None)
        return orig(ranks, *args, **kwargs)

    dist.new_group = c10d.new_group = counted
    try:
        yield
    finally:
        dist.new_group = c10d.new_group = orig


@contextlib.contextmanager
def no_group_creation() -> Iterator[None]:
    """Any process-group creation raises (compilation must only choose among existing groups)."""
    saved = {
        (m, n): getattr(m, n)
        for m in (dist, c10d)
        for n in ("new_group", "new_subgroups", "split_group")
        if hasattr(m, n)
    }

    def refuse(*args, **kwargs):
        raise AssertionError("a process group was created while compiling / running the compiled program")

    for m, n in saved:
        setattr(m, n, refuse)
    try:
        yield
    finally:
        for (m, n), fn in saved.items():
            setattr(m, n, fn)


def setup_counts() -> dict:
    """setup twice: the first creates the 4 sub-groups (same order on every rank), the second none."""
    first: list = []
    second: list = []
    with counting_new_group(first):
        s = commfuse.setup(topology=TOPO_2x2)
    with counting_new_group(second):
        s2 = commfuse.setup(topology=TOPO_2x2)
    sg = s2.subgroups[(0, 1, 2, 3)]
    # the alias resolves to this rank's own sub-group, whose ranks the IR reads
    from commfuse.ir.graph_ir import _resolve_group

    resolved = (_resolve_group(sg.intra_name, None).ranks, _resolve_group(sg.inter_name, None).ranks)
    out = {
        "first": first,
        "second": second,
        "intra": sg.intra,
        "inter": sg.inter,
        "names": (sg.intra_name, sg.inter_name),
        "resolved": resolved,
        "same_groups": s.subgroups[(0, 1, 2, 3)].intra_pg is sg.intra_pg,
    }
    commfuse.session.reset()
    return out


class _Mlp(nn.Module):
    def __init__(self, d: int = 8, h: int = 12) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, h)
        self.w2 = nn.Linear(h, d)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class _TPBlock(nn.Module):
    """A local layer on the sequence shard, then an all_gather along the sequence (dim 1)
    feeding a column-parallel matmul and a GeLU."""

    def __init__(self, d: int = 8, h: int = 12) -> None:
        super().__init__()
        self.pre = nn.Linear(d, d)
        self.w1 = nn.Linear(d, h)

    def forward(self, x):
        return F.gelu(self.w1(self.pre(x)))


class _EPBlock(nn.Module):
    """Tokens exchanged to their experts and back (equal splits, as capacity dispatch gives):
    dispatch all_to_all, a GeLU on the received tokens, combine all_to_all."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.w_in = nn.Linear(d, d)
        self.w_out = nn.Linear(d, d)

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        g = dist.group.WORLD
        h = funcol.all_to_all_single_autograd(self.w_in(x), None, None, g)
        return self.w_out(funcol.all_to_all_single_autograd(F.gelu(h), None, None, g))


def _workload(name: str, mesh) -> tuple[Any, Any]:
    rank = dist.get_rank()
    if name in ("fsdp", "dp"):
        from commfuse.models import simple_fsdp

        mode = "fully_shard" if name == "fsdp" else "replicate"

        def model():
            torch.manual_seed(0)
            return simple_fsdp.data_parallel(_Mlp(), mesh, mode)

        def inputs(step):
            return torch.randn(3, 8, generator=torch.Generator().manual_seed(100 * step + rank))
    elif name == "tp":
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        def model():
            torch.manual_seed(0)
            return parallelize_module(_TPBlock(), mesh, {"w1": ColwiseParallel(input_layouts=Shard(1))})

        def inputs(step):  # this rank's sequence shard: batch 2, 3 positions, dim 8
            return torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(100 * step + rank))
    elif name == "ep":

        def model():
            torch.manual_seed(0)
            return _EPBlock()

        def inputs(step):  # 8 tokens: 2 per rank of the world
            return torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * step + rank))
    else:
        raise ValueError(name)
    return model, inputs


def compiled_matches_eager(name: str) -> dict:
    """Train 2 SGD steps eagerly and compiled with only group_partition; outputs, gradients
    and parameters must agree (float32 policy). No group may be created while compiling."""
    calls: list = []
    with counting_new_group(calls):
        commfuse.setup(topology=TOPO_2x2)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, inputs = _workload(name, mesh)
    ref = train_step_outputs(model, inputs, steps=2, lr=0.05)
    be = commfuse.backend(commfuse.Config(passes=["group_partition"], inner_compiler="eager", strict=True))
    torch._dynamo.reset()
    with no_group_creation():
        got = train_step_outputs(model, inputs, backend=be, steps=2, lr=0.05)
    assert_close_tree(got, ref, dtype=torch.float32, msg=f"{name} rank {dist.get_rank()}")
    recs = [(r.graph, p) for r in be.reports for p in r.passes if p.name == "group_partition"]
    groups = sorted({c.group for r in be.reports if r.analysis for c in r.analysis.collectives})
    kinds = {
        r.graph: [f"{c.kind}@{c.group}" for c in r.analysis.collectives] for r in be.reports if r.analysis
    }
    commfuse.session.reset()
    return {
        "world": dist.group.WORLD.group_name,
        "created": calls,
        "counts": {g: p.counts for g, p in recs},
        "refusals": [x for _, p in recs for x in p.refusals],
        "dims": [(d["kind"], d["dim"]) for _, p in recs for d in p.decisions],
        "groups": groups,
        "kinds": kinds,
    }
