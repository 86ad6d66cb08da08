"""Same decision on every rank, by construction: ranks whose local batches differ (static on one,
symbolic on another) issue the same collectives after the default pipeline.

The rule (docs/architecture.md, "Same decision on every rank"): a decision that changes which
collectives run or their order prices compute only where its shapes follow from inputs
replicated across the groups it changes; everything else from what every rank shares. The cost
policy hands passes a model that prices only those sizes (passmgr/invariance.py); symbols take
rank-invariant, bounded hints (costmodel/symbol_hints.py); the step-time gate reverts any
predicted slowdown.
"""

from __future__ import annotations

import warnings

import pytest
import sympy
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse
from commfuse.costmodel.analytic import AnalyticCostModel
from commfuse.costmodel.collectives import concrete
from commfuse.costmodel.symbol_hints import DEFAULT_SYMBOL_HINT, SymbolHints, hinted, hinted_shape
from commfuse.costmodel.topology import Topology
from commfuse.ir.graph_ir import CollectiveIR, IRBuildOptions
from commfuse.passmgr import gate
from commfuse.passmgr.context import PassContext
from commfuse.passmgr.invariance import batch_splitting_groups, varying_nodes
from commfuse.testing.fake_pg import fake_mesh, fake_process_group

import _jobs_same_decision as jobs

TOPO = Topology.preset("cpu-gloo", num_nodes=1)


# ---------------------------------------------------------------- the helper: which sizes vary
def _fsdp_step(x, shard, w2):
    """A parameter shard gathered (FSDP), a matmul with the data, an activation all_reduce."""
    g = dist.group.WORLD
    w = funcol.all_gather_tensor(shard, 0, g)
    h = torch.relu(x @ w.t())
    return h @ w2, w.sum()


def _traced(fn, *shapes):
    return make_fx(fn, tracing_mode="fake")(*[torch.randn(s) for s in shapes])


def _by_name(gm, names):
    nodes = {n.name: n for n in gm.graph.nodes}
    return [nodes[n] for n in names]


def test_data_dependent_compute_varies_across_a_data_parallel_group_and_is_not_priced():
    with fake_process_group(2):
        gm = _traced(_fsdp_step, (8, 16), (16, 16), (32, 4))
        ir = CollectiveIR(gm)
        (c,) = ir.collectives
        assert list(batch_splitting_groups(ir)) == [c.group.name]  # a parameter gather: FSDP
        varying = varying_nodes(gm, ir)
        x, shard, w2 = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # the data and everything computed from it vary; the shard, its gather and what only
        # reads the gathered weight are the same on every rank of the group
        assert x in varying and w2 in varying  # an input nothing marks as a parameter
        assert shard not in varying and c.start not in varying and c.waits[0] not in varying
        mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
        wsum = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.sum.default)
        assert mm in varying and wsum not in varying

        ctx = PassContext(gm, commfuse.Config(topology=TOPO), topology=TOPO)
        model = ctx.cost.model
        assert model.compute_time_us(mm) == 0 and model.value_bytes(mm) == 0
        assert model.compute_time_us(wsum) > 0 and model.collective(c).time_us > 0
        assert model.value_bytes(c.start) == 32 * 16 * 4  # the gathered weight
        assert model.full.compute_time_us(mm) > 0  # what reports price


def test_a_group_whose_ranks_share_the_batch_prices_every_compute():
    """The same graph with the group given the TP role: its ranks compute on the same tokens,
    so every compute shape is shared and priced."""
    with fake_process_group(2):
        gm = _traced(_fsdp_step, (8, 16), (16, 16), (32, 4))
        name = dist.group.WORLD.group_name
        ir = CollectiveIR(gm, IRBuildOptions(group_roles={name: "tp"}))
        assert batch_splitting_groups(ir) == {} and varying_nodes(gm, ir) == frozenset()
        ctx = PassContext(gm, commfuse.Config(topology=TOPO), topology=TOPO, group_roles={name: "tp"})
        mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
        assert ctx.cost.model.compute_time_us(mm) > 0


def test_a_gradient_reduction_fixes_its_operand_but_not_the_compute_that_makes_it():
    """A reduce_scatter's operand has the same size on every rank of its group (the program runs
    only so), whatever the local batch it was computed from; the matmul that computes it reads
    the local batch."""

    def f(dy, x):
        g = funcol.reduce_scatter_tensor(dy.t() @ x, "sum", 0, dist.group.WORLD)
        return g * 2

    with fake_process_group(2):
        gm = _traced(f, (8, 16), (8, 16))
        ir = CollectiveIR(gm)
        assert batch_splitting_groups(ir)
        varying = varying_nodes(gm, ir)
        (c,) = ir.collectives
        mm = c.inputs[0]
        scale = next(iter(c.waits[0].users))
        assert mm not in varying and c.start not in varying and scale not in varying
        model = PassContext(gm, commfuse.Config(topology=TOPO), topology=TOPO).cost.model
        assert model.compute_time_us(mm) == 0  # it reads the local batch
        assert model.value_bytes(mm) == 16 * 16 * 4 and model.compute_time_us(scale) > 0


def test_a_factory_without_inputs_may_bake_a_batch_size_in():
    def f(x, shard):
        w = funcol.all_gather_tensor(shard, 0, dist.group.WORLD)
        return torch.zeros(8, 16) + x @ w, torch.ones(()) * w.sum()

    with fake_process_group(2):
        gm = _traced(f, (8, 16), (8, 16))
        varying = varying_nodes(gm, CollectiveIR(gm))
    zeros = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.zeros.default)
    ones = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.ones.default)
    assert zeros in varying and ones not in varying  # 0-d: the same on every rank


# ---------------------------------------------------------------- size hints
def test_size_hints_are_rank_invariant_and_bounded():
    s0, s1, u0 = sympy.symbols("s0 s1 u0")
    assert hinted([s0]) == {s0: DEFAULT_SYMBOL_HINT}
    assert hinted([s0, s1]) == {s0: 64, s1: 64}  # together at most the flat value
    assert hinted([s0, u0], SymbolHints({"u0": 12})) == {s0: DEFAULT_SYMBOL_HINT, u0: 12}
    assert hinted_shape([s0, s1, 16]) == (64, 64, 16)
    assert concrete(s0 * s1 * 16) == 64 * 64 * 16
    # a SymInt is never priced at the example value it was traced with (this rank's batch)
    sizes = []
    for batch in (3, 64):
        gm = make_fx(lambda x: x * 2, tracing_mode="symbolic")(torch.randn(batch, 16))
        (x,) = [n for n in gm.graph.nodes if n.op == "placeholder"]
        sizes.append(concrete(x.meta["val"].shape[0]))
    assert sizes == [DEFAULT_SYMBOL_HINT, DEFAULT_SYMBOL_HINT]


def test_a_symbolic_tiny_mlp_step_is_priced_at_a_plausible_time():
    """Batch and sequence symbolic: priced at 64 x 64 rows, not 4096 x 4096 (a step of minutes)."""
    w1, w2 = torch.randn(16, 64), torch.randn(64, 16)
    gm = make_fx(lambda x: torch.relu(x @ w1) @ w2, tracing_mode="symbolic", _allow_non_fake_inputs=True)(
        torch.randn(3, 5, 16)
    )
    model = AnalyticCostModel(TOPO, backend="gloo")
    step = sum(model.compute_time_us(n) for n in gm.graph.nodes)
    assert 0 < step < 10_000, step  # microseconds


# ---------------------------------------------------------------- the gate
@pytest.mark.parametrize(
    "before, after, kept",
    [
        (223e6, 223e6 + 70.0, False),  # the case: a 223 s prediction hid 70 us
        (500.0, 500.0 + 1e-3, False),
        (500.0, 500.0, True),
        (500.0, 500.0 * (1 + 1e-12), True),  # float rounding of the simulator's sums only
        (500.0, 499.0, True),
    ],
)
def test_the_gate_never_keeps_a_change_it_predicts_slower(monkeypatch, before, after, kept):
    preds = iter([before, after])
    monkeypatch.setattr(gate, "predicted_us", lambda *a, **k: next(preds))
    with fake_process_group(2):
        gm = _traced(_fsdp_step, (8, 16), (16, 16), (32, 4))
        ctx = PassContext(gm, commfuse.Config(topology=TOPO), topology=TOPO)
        verdict = gate.judge(ctx, gm)
    assert verdict.kept is kept


# ---------------------------------------------------------------- one process, many batch sizes
class _MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, hidden)
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(torch.relu(self.w2(torch.relu(self.w1(x)))))


def _data_parallel(mode: str, dims):
    def build(mesh):
        from commfuse.models import simple_fsdp

        torch.manual_seed(0)
        model = simple_fsdp.data_parallel(_MLP(), mesh, mode)
        return model, lambda b: torch.randn(b, 16), lambda out: out.pow(2).mean()

    return build, dims


def _expert_parallel():
    def build(mesh):
        from commfuse.models import moe

        model = moe.parallelize_moe(moe.build_moe(dim=16, num_experts=4, ffn_dim=32), mesh)
        # A capacity per expert that does not follow the local token count: the exchange's
        # sizes are then the same on every rank whatever its batch (GShard's default derives
        # them from the local tokens, which uneven batches cannot run).
        model.capacity = lambda tokens: 4
        return model, lambda b: torch.randn(b, 4, 16), lambda out: out[0].pow(2).mean() + out[1]

    return build, ("ep",)


PROGRAMS = {
    "fsdp": _data_parallel("fully_shard", None),  # the README's style: a mesh without names
    "dp": _data_parallel("replicate", ("dp",)),
    "ep": _expert_parallel(),
}
BATCHES = [(1, False), (2, False), (7, False), (64, False), (7, True), (64, True)]


def _sequences(program: str, batch: int, dynamic: bool, topology) -> dict:
    """Per graph and group (by its member ranks), the collectives the default pipeline leaves."""
    build, dims = PROGRAMS[program]
    with fake_mesh(2, mesh_dim_names=dims) as mesh:
        model, inputs, loss = build(mesh)
        be = commfuse.backend(commfuse.Config(inner_compiler="eager", topology=topology))
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = torch.compile(model, backend=be, dynamic=dynamic)
            loss(compiled(inputs(batch))).backward()
    out: dict = {}
    for r in be.reports:
        assert r.analysis is not None
        for c in r.analysis.collectives:
            key = (r.graph, tuple(c.group_ranks) if c.group_ranks is not None else c.group)
            out.setdefault(key, []).append((c.kind, c.reduce_op, c.dtype, [str(s) for s in c.input_shapes]))
    return out


@pytest.mark.slow(
    reason="traces three parallel programs six times each through Dynamo, AOTAutograd and the "
    "default pipeline (~10 s a trace on 2 cores)"
)
@pytest.mark.parametrize("topology", [None, TOPO], ids=["no-topology", "cpu-gloo"])
@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_every_local_batch_gets_the_same_collectives(program, topology):
    """Local batch 1, 2, 7 and 64 static, and symbolic (Dynamo specialises 0 and 1): the
    post-pipeline collective sequence of every group is identical."""
    ref = _sequences(program, 64, False, topology)
    assert ref and all(ref.values())
    for batch, dynamic in BATCHES:
        if (batch, dynamic) == (64, False):
            continue
        got = _sequences(program, batch, dynamic, topology)
        diff = {k: (got.get(k), v) for k, v in ref.items() if got.get(k) != v}
        assert got == ref, (program, batch, dynamic, diff)


# ---------------------------------------------------------------- the same, one graph per step
def _fsdp_train_step(x, s1, s2):
    """A SimpleFSDP-style step in one graph: parameter shards gathered, forward, the gradients
    (of the loss sum(y) / 2) reduce-scattered."""
    g = dist.group.WORLD
    w1, w2 = funcol.all_gather_tensor(s1, 0, g), funcol.all_gather_tensor(s2, 0, g)
    h = torch.relu(x @ w1.t())
    y = h @ w2.t()
    gh = (y @ w2) * (h > 0)
    return (
        funcol.reduce_scatter_tensor(y.t() @ h, "avg", 0, g),
        funcol.reduce_scatter_tensor(gh.t() @ x, "avg", 0, g),
    )


def _step_sequences(batch, symbolic: bool) -> dict:
    """``symbolic``: the batch dim symbolic and the parameters static, as Dynamo traces them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    batch_dim = DimDynamic.DYNAMIC if symbolic else DimDynamic.STATIC
    dims = StatelessSymbolicContext(dynamic_sizes=[batch_dim, DimDynamic.STATIC])
    x = mode.from_tensor(torch.randn(batch, 16), symbolic_context=dims)
    shards = [mode.from_tensor(torch.randn(16, 16)), mode.from_tensor(torch.randn(8, 32))]
    with fake_process_group(2):
        with mode:
            gm = make_fx(_fsdp_train_step)(x, *shards)
        commfuse.optimize(gm, commfuse.Config(topology=TOPO))
        ir = CollectiveIR(gm)
        assert len(ir.groups) == 1  # one group: its sequence is the graph's
        return {
            "sequence": [
                (c.kind.value, c.reduce_op, str(c.dtype), [str(s) for s in c.input_shapes or ()])
                for c in ir.collectives
            ]
        }


def test_a_train_step_graph_gets_the_same_collectives_at_every_local_batch():
    """The inner-loop form of the test above: one make_fx graph per step through the default
    pipeline, local batch 1, 64 and symbolic."""
    ref = _step_sequences(64, False)
    assert len(ref["sequence"]) >= 3
    assert _step_sequences(1, False) == ref
    assert _step_sequences(7, True) == ref


# ---------------------------------------------------------------- real ranks
@pytest.mark.slow(reason="real gloo ranks: SimpleFSDP trained eagerly and compiled on 2 ranks, three steps")
@pytest.mark.multirank
@pytest.mark.parametrize("dynamic", [False, True, None], ids=["static", "dynamic", "automatic"])
def test_uneven_local_batches_train_equal_to_eager_on_two_ranks(rank_pool_2, dynamic):
    """Local batches 64/64, then 1/64, then 64/64 (the issue's probe, default pipeline): loss and
    gradients equal eager's on every rank, and each graph issues the same collectives on both
    ranks though rank 0 compiled other batch sizes (no hang, no gloo size mismatch)."""
    results = rank_pool_2.run(jobs.uneven_batches_train_like_eager, dynamic, timeout=600)
    assert results[0]["graphs"] > results[1]["graphs"]  # rank 0 compiled its batch of 1 too
    for graph, seqs in results[0]["sequences"].items():
        assert len(seqs) == 1, (graph, seqs)  # every batch size compiled to the same collectives
        assert seqs == results[1]["sequences"][graph], graph
    assert all(r["lowered"] for r in results)  # the gloo lowering ran, alike on both
