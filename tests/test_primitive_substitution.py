"""Centauri primitive substitution (Table 2): the three scalable forms, the rooted reduce op,
their cost model, refusals, and (multirank) compiled training against eager on gloo ranks.

Graph-level tests trace under the fake process group, check the rewritten code with
FileCheck and check every rewrite on the 4-rank reference interpreter, bitwise (the
reference reduces in canonical order and the rooted reduces' -0.0 selection is exact).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck
from torch.utils.checkpoint import CheckpointPolicy

import commfuse
from commfuse.costmodel.analytic import AnalyticCostModel
from commfuse.costmodel.collectives import AlphaBeta, CollectiveModel, CollectiveParams
from commfuse.costmodel.topology import Topology
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.ir.kinds import CollectiveKind as K
from commfuse.transforms import primitive_substitution as ps
from commfuse.costmodel.profile import CostProfile
from commfuse.passmgr.context import PassContext
from commfuse.passmgr.cost import CostPolicy
from commfuse.testing.equivalence import check_equivalent
from commfuse.testing.fake_pg import fake_process_group
from commfuse.testing.graphs import _copy

import _jobs_primitive_substitution as jobs

c10d = torch.ops._c10d_functional
W = c10d.wait_tensor.default
N = 4
FORCED = "primitive_substitution_forced"


def _trace(fn, *shapes, dtype=torch.float32):
    args = [
        torch.randn(s).to(dtype) if dtype.is_floating_point else torch.randint(0, 7, s, dtype=dtype)
        for s in shapes
    ]
    return make_fx(fn, tracing_mode="fake")(*args)


def _run(gm, passes, **cfg):
    commfuse.optimize(gm, commfuse.Config(passes=passes, strict=True, **cfg))
    return {p.name: p for p in commfuse.last_report(gm).passes}[passes[0]]


def _kinds(gm) -> list[str]:
    return [c.kind.value for c in CollectiveIR(gm).collectives]


# ---------------------------------------------------------------- the three forms
def _ag_dim0(x):
    return W(c10d.all_gather_into_tensor.default(x, N, "0")) * 2


def _ag_dim1(x):  # DTensor's shuffle: dim-0 gather + split/cat
    return funcol.all_gather_single(x, 1, dist.group.WORLD) + 1


def _rs_dim0_sum(x):
    return W(c10d.reduce_scatter_tensor.default(x, "sum", N, "0")) * 3


def _rs_dim1_avg(x):
    return funcol.reduce_scatter_single(x, "avg", 1, dist.group.WORLD) - 1


def _rs_max(x):
    return W(c10d.reduce_scatter_tensor.default(x, "max", N, "0")) + 0


def _ar_sum(x):
    return W(c10d.all_reduce.default(x, "sum", "0")).relu()


FORMS = {
    # name: (program, input shape, form, kinds after, FileCheck patterns)
    "ag_dim0": (
        _ag_dim0,
        (2, 3),
        ps.ROOTED_BROADCASTS,
        ["broadcast"] * N,
        [*(f"broadcast.default(x_1, {r}, '0')" for r in range(N)), "aten.cat.default(["],
    ),
    "ag_dim1": (
        _ag_dim1,
        (2, 3, 2),
        ps.ROOTED_BROADCASTS,
        ["broadcast"] * N,
        [*(f"broadcast.default(x_1, {r}, '0')" for r in range(N)), "], 1)"],
    ),
    "rs_dim0_sum": (
        _rs_dim0_sum,
        (8, 3),
        ps.ROOTED_REDUCES,
        ["reduce"] * N,
        [
            "aten.split.Tensor(x_1, 2)",
            *(
                f"reduce_to_root.default({g}, {r}, 'sum', 4, '0')"
                for r, g in enumerate(["getitem", "getitem_1", "getitem_2", "getitem_3"])
            ),
            "aten.add.Tensor",
            "aten.mul",
        ],
    ),
    "rs_dim1_avg": (
        _rs_dim1_avg,
        (2, 8, 3),
        ps.ROOTED_REDUCES,
        ["reduce"] * N,
        [
            "aten.split.Tensor(x_1, 2, 1)",
            "reduce_to_root.default(getitem",
            ", 3, 'sum', 4, '0')",
            "aten.add.Tensor",
            "aten.div.Tensor(add_2, 4)",
        ],
    ),
    "rs_max": (_rs_max, (4, 5), ps.ROOTED_REDUCES, ["reduce"] * N, ["'max', 4, '0'"]),
    "ar_sum": (
        _ar_sum,
        (8, 4),
        ps.RS_AG,
        ["reduce_scatter", "all_gather"],
        ["reduce_scatter_tensor.default(x_1, 'sum', 4, '0')", "all_gather_into_tensor.default"],
    ),
}


@pytest.mark.parametrize("case", sorted(FORMS))
def test_form_rewrites_and_is_bitwise_equivalent(case):
    fn, shape, form, kinds, patterns = FORMS[case]
    with fake_process_group(N):
        gm = _trace(fn, shape)
        before = _copy(gm)
        rec = _run(gm, [FORCED])
        assert rec.changed and rec.counts[form] == 1 and not rec.refusals, rec
        (decision,) = rec.decisions
        assert decision["form"] == form and decision["original_us"] > 0 and decision["substitute_us"] > 0
        assert _kinds(gm) == kinds
        fc = FileCheck()
        for p in patterns:
            fc = fc.check(p)
        fc.run(gm.code)
        # the original collective is gone (no double communication)
        if form != ps.RS_AG:
            FileCheck().check_not("all_gather_into_tensor").check_not("reduce_scatter_tensor").run(gm.code)
        check_equivalent(before, gm, N, exact=True)


def test_sp_chain_gather_matmul_scatter_all_substituted():
    """A gather feeding compute feeding a scatter (an SP block): the second rewrite sees the
    first one's output, not the stale IR record."""

    def f(x, w):
        g = funcol.all_gather_single(x, 1, dist.group.WORLD)
        h = torch.tanh(g @ w)
        s = funcol.reduce_scatter_single(h, "sum", 1, dist.group.WORLD)
        return funcol.all_reduce(s * s, "avg", dist.group.WORLD)

    with fake_process_group(N):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 2, 4), torch.randn(4, 4))
        before = _copy(gm)
        rec = _run(gm, [FORCED])
        assert rec.counts == {ps.RS_AG: 1, ps.ROOTED_BROADCASTS: 1, ps.ROOTED_REDUCES: 1}
        assert _kinds(gm) == ["broadcast"] * N + ["reduce"] * N + ["reduce_scatter", "all_gather"]
        check_equivalent(before, gm, N, exact=True)


# ---------------------------------------------------------------- the API the search uses
def _ctx(gm, topology=None):
    return PassContext(gm, commfuse.Config(), topology=topology)


def test_plan_is_pure_and_apply_returns_the_new_starts_in_order():
    with fake_process_group(N):
        gm = _trace(_rs_dim1_avg, (2, 8, 3))
        code = gm.code
        ctx = _ctx(gm)
        (c,) = ctx.ir.collectives
        assert ps.substitute_forms(c) == [ps.ROOTED_REDUCES]
        assert isinstance(ps.plan_primitive_substitution(ctx, c), str)  # the cost model says no
        plan = ps.plan_primitive_substitution(ctx, c, form=ps.ROOTED_REDUCES)
        assert isinstance(plan, ps.PrimitivePlan)
        assert (plan.kind, plan.form, plan.dim, plan.group_size) == (
            K.REDUCE_SCATTER,
            ps.ROOTED_REDUCES,
            1,
            N,
        )
        assert plan.substitute_us > plan.original_us > 0
        assert gm.code == code  # planning never mutates
        starts = ps.apply_primitive_substitution(ctx, c, plan)
        gm.graph.lint()
        gm.recompile()
        assert [s.args[1] for s in starts] == list(range(N))  # roots in graph order
        assert all(s.meta["recompute"] is CheckpointPolicy.MUST_SAVE for s in starts)  # never recomputed
        nodes = list(gm.graph.nodes)
        assert [n for n in nodes if n in starts] == starts

    with fake_process_group(N):
        gm = _trace(_ar_sum, (8, 4))
        ctx = _ctx(gm)
        (c,) = ctx.ir.collectives
        starts = ps.apply_primitive_substitution(
            ctx, c, ps.plan_primitive_substitution(ctx, c, form=ps.RS_AG)
        )
        assert [s.target for s in starts] == [
            c10d.reduce_scatter_tensor.default,
            c10d.all_gather_into_tensor.default,
        ]


def test_rooted_reduce_in_the_ir():
    with fake_process_group(N):
        gm = _trace(_rs_dim0_sum, (8, 3))
        _run(gm, [FORCED])
        ir = CollectiveIR(gm)
        for c in ir.collectives:
            assert (c.kind, c.group.size, c.reduce_op, len(c.waits)) == (K.REDUCE, N, "sum", 1)
            assert c.input_bytes == 2 * 3 * 4 and c.wire_bytes == c.logged_bytes == c.input_bytes
        # one total order, the roots in rank order: every rank issues the same sequence
        assert [c.start.args[1] for c in ir.collectives] == list(range(N))


# ---------------------------------------------------------------- refusals
def _coalesced(x, y):
    a, b = c10d.all_gather_into_tensor_coalesced.default([x, y], N, "0")
    return W(a), W(b)


def _inplace(x):
    buf = x.clone()
    return W(c10d.all_reduce_.default(buf, "sum", "0")) * 1


@pytest.mark.parametrize(
    "fn, shapes, dtype, reason",
    [
        (
            lambda x: W(c10d.all_reduce.default(x, "sum", "0")) + 1,
            [(3, 5)],
            torch.float32,
            "divisible by the group size",
        ),
        (
            lambda x: W(c10d.all_reduce.default(x, "product", "0")) + 1,
            [(8, 4)],
            torch.float32,
            "reduce op 'product'",
        ),
        (
            lambda x: W(c10d.reduce_scatter_tensor.default(x, "product", N, "0")) + 1,
            [(8, 4)],
            torch.float32,
            "reduce op 'product' is not substituted",
        ),
        (
            lambda x: W(c10d.reduce_scatter_tensor.default(x, "band", N, "0")) + 1,
            [(8, 4)],
            torch.int32,
            "reduce op 'band' is not substituted",
        ),
        (
            lambda x: W(c10d.reduce_scatter_tensor.default(x, "avg", N, "0")) + 1,
            [(8, 4)],
            torch.int64,
            "'avg' on integer dtype",
        ),
        (_coalesced, [(2, 3), (1, 4)], torch.float32, "coalesced or in-place"),
        (_inplace, [(8, 4)], torch.float32, "coalesced or in-place"),
    ],
)
def test_refusals_leave_the_graph_unchanged(fn, shapes, dtype, reason):
    with fake_process_group(N):
        gm = _trace(fn, *shapes, dtype=dtype)
        code = gm.code
        for name in (FORCED, "primitive_substitution"):
            rec = _run(gm, [name])
            assert not rec.changed and gm.code == code
            assert len(rec.refusals) == len(CollectiveIR(gm).collectives)
            assert reason in rec.refusals[0], rec.refusals


def test_non_scalable_and_mismatched_forms_are_refused_by_name():
    with fake_process_group(N):
        gm = _trace(_ag_dim0, (2, 3))
        ctx = _ctx(gm)
        (c,) = ctx.ir.collectives
        for form in ps.NON_SCALABLE:
            why = ps.plan_primitive_substitution(ctx, c, form=form)
            assert isinstance(why, str) and "not scalable" in why
        why = ps.plan_primitive_substitution(ctx, c, form=ps.ROOTED_REDUCES)
        assert "does not apply to all_gather" in why
        assert ps.substitute_forms(c) == [ps.ROOTED_BROADCASTS]


@pytest.mark.parametrize(
    "topology",
    [
        None,
        Topology.preset("cpu-gloo", num_nodes=2),
        Topology.preset("dgx-h100", num_nodes=2),
        Topology.preset("pcie-8gpu"),
    ],
    ids=["default", "cpu-gloo-2x2", "dgx-h100-2x8", "pcie-8gpu"],
)
def test_cost_model_refuses_standalone_substitutes(topology):
    """Standalone, each substitute moves the same bytes in more launches: predicted slower on
    every preset, so the pass keeps every collective and reports both predictions."""
    world = topology.world_size if topology is not None else N

    def f(x, y, z):
        a = W(c10d.all_gather_into_tensor.default(x, world, "0"))
        b = W(c10d.reduce_scatter_tensor.default(y, "sum", world, "0"))
        return a, b, W(c10d.all_reduce.default(z, "sum", "0"))

    for rows in (world, 1024 * world):  # tiny and ~MB-sized
        with fake_process_group(world):
            gm = _trace(f, (rows, 64), (rows * world, 64), (rows, 64))
            code = gm.code
            rec = _run(gm, ["primitive_substitution"], topology=topology)
            assert not rec.changed and gm.code == code
            assert len(rec.refusals) == 3
            for line in rec.refusals:
                assert "cost model:" in line and "not faster than" in line and " us" in line, line


def test_cost_model_applies_where_the_substitute_is_predicted_faster(monkeypatch):
    """A calibrated profile in which the all_gather is slow (a fitted 1 ms) makes the rooted
    broadcasts cheaper: the pass applies them and records both predictions."""
    topo = Topology.preset("dgx-h100")
    params = CollectiveParams(
        fits=[AlphaBeta(kind=K.ALL_GATHER, group_size=N, alpha_us=1000.0, beta_us_per_byte=0.0)]
    )
    monkeypatch.setattr(CostPolicy, "model", property(lambda self: AnalyticCostModel(topo, "nccl", params)))
    with fake_process_group(N):
        gm = _trace(lambda x, y: (_ag_dim0(x), _rs_dim0_sum(y)), (2, 3), (8, 3))
        before = _copy(gm)
        rec = _run(gm, ["primitive_substitution"])
        assert rec.counts == {ps.RS_AG: 0, ps.ROOTED_BROADCASTS: 1, ps.ROOTED_REDUCES: 0}
        (d,) = rec.decisions
        assert d["original_us"] == 1000.0 and d["substitute_us"] < 1000.0
        assert len(rec.refusals) == 1 and "reduce_scatter kept: cost model" in rec.refusals[0]
        assert _kinds(gm) == ["broadcast"] * N + ["reduce_scatter"]
        check_equivalent(before, gm, N, exact=True)


def test_a_cost_profile_prices_the_decisions(tmp_path):
    """``Config.cost_profile``: the same calibrated numbers from a profile file (what
    ``python -m commfuse calibrate`` writes) reach the pass through the cost policy, and the
    report names the profile; without it the nominal DGX-H100 model keeps the all_gather."""
    fits = CollectiveParams(
        fits=[AlphaBeta(kind=K.ALL_GATHER, group_size=N, alpha_us=1000.0, beta_us_per_byte=0.0)]
    )
    path = tmp_path / "slow_all_gather.json"
    CostProfile(topology="dgx-h100", backend="nccl", collective=fits).save(path)
    topo = Topology.preset("dgx-h100")
    with fake_process_group(N):
        gm = _trace(lambda x: _ag_dim0(x), (2, 3))
        rec = _run(gm, ["primitive_substitution"], topology=topo)
        assert rec.counts[ps.ROOTED_BROADCASTS] == 0
        gm = _trace(lambda x: _ag_dim0(x), (2, 3))
        before = _copy(gm)
        rec = _run(gm, ["primitive_substitution"], topology=topo, cost_profile=str(path))
        assert rec.counts[ps.ROOTED_BROADCASTS] == 1 and rec.decisions[0]["original_us"] == 1000.0
        assert "slow_all_gather.json" in commfuse.last_report(gm).topology
        check_equivalent(before, gm, N, exact=True)


def test_a_cost_profile_that_cannot_be_read_names_the_field(tmp_path):
    bad = tmp_path / "profile.json"
    bad.write_text('{"topology": "dgx-h100"}')  # no backend
    with pytest.raises(ValueError, match="cost_profile: cost profile: invalid profile file"):
        commfuse.Config(cost_profile=str(bad))
    with pytest.raises(ValueError, match="cost_profile: cost profile: cannot read"):
        commfuse.Config(cost_profile=str(tmp_path / "missing.json"))
    good = tmp_path / "good.json"
    CostProfile(topology="dgx-h100", backend="nccl").save(good)
    key = commfuse.Config(cost_profile=str(good)).cache_key()
    CostProfile(topology="dgx-h100", backend="nccl", contention_kappa=0.5).save(good)
    assert commfuse.Config(cost_profile=str(good)).cache_key() != key  # the cache keys on the content


# ---------------------------------------------------------------- the reduce's cost model
def test_reduce_cost_formulas_and_fit_reuse():
    S = 1 << 20
    nccl = CollectiveModel(Topology.preset("dgx-h100"), "nccl")
    assert set(nccl.candidates(K.REDUCE, S, 8)) == {"ring"}
    # the same pipelined chain as the broadcast, towards the root
    assert nccl.time(K.REDUCE, S, 8).time_us == nccl.time(K.BROADCAST, S, 8).time_us
    gloo = CollectiveModel(Topology.preset("cpu-gloo", num_nodes=2), "gloo")
    e = gloo.time(K.REDUCE, S, 4)
    assert e.algorithm == "ring-reduce-scatter+gather" and e.wire_bytes == round(2 * 3 / 4 * S)
    assert gloo.time(K.REDUCE, 2 * S, 4).time_us > e.time_us
    # without a fit of its own, reduce reuses broadcast's (NCCL) / all_reduce's (gloo)
    fits = CollectiveParams(
        fits=[
            AlphaBeta(kind=K.BROADCAST, group_size=4, alpha_us=7.0, beta_us_per_byte=0.0),
            AlphaBeta(kind=K.ALL_REDUCE, group_size=4, alpha_us=11.0, beta_us_per_byte=0.0),
        ]
    )
    assert CollectiveModel(Topology.preset("dgx-h100"), "nccl", fits).time(K.REDUCE, S, 4).time_us == 7.0
    assert (
        CollectiveModel(Topology.preset("cpu-gloo", num_nodes=2), "gloo", fits).time(K.REDUCE, S, 4).time_us
        == 11.0
    )


# ---------------------------------------------------------------- real ranks
@pytest.mark.multirank
def test_simple_fsdp_gathers_and_scatters_as_rooted_forms_match_eager(rank_pool_4):
    """SimpleFSDP (fully_shard): the weight all_gathers become broadcasts of distinct roots in
    forward, the gradient reduce_scatters rooted reduces in backward; 2 SGD steps on 4 gloo
    ranks match eager (outputs, loss, grads, params)."""
    results = rank_pool_4.run(jobs.simple_fsdp_mlp_matches_eager, "fully_shard", timeout=240)
    for res in results:
        assert res["counts"] == [{ps.RS_AG: 0, ps.ROOTED_BROADCASTS: 2, ps.ROOTED_REDUCES: 2}]
        assert res["kinds"]["forward"] == {"broadcast": 2 * N}
        assert res["kinds"]["backward"] == {"reduce": 2 * N}


@pytest.mark.multirank
def test_dp_gradient_all_reduce_as_rs_ag_matches_eager(rank_pool_4):
    results = rank_pool_4.run(jobs.simple_fsdp_mlp_matches_eager, "replicate", "sum", timeout=240)
    for res in results:
        assert res["counts"] == [{ps.RS_AG: 2, ps.ROOTED_BROADCASTS: 0, ps.ROOTED_REDUCES: 0}]
        assert res["kinds"]["backward"] == {"all_gather": 2, "reduce_scatter": 2}


@pytest.mark.slow(reason="cold Inductor compiles")
@pytest.mark.multirank
def test_inductor_runs_the_rooted_forms(rank_pool_2):
    """The rooted reduce is a custom op with a real kernel: Inductor runs it as a fallback kernel
    (waited by its wait_tensor lowering) next to the functional broadcasts."""
    for res in rank_pool_2.run(jobs.inductor_compiles_rooted_forms, timeout=300):
        assert res["counts"] == [{ps.RS_AG: 0, ps.ROOTED_BROADCASTS: 1, ps.ROOTED_REDUCES: 1}]
        assert res["kinds"] == {"inference": ["broadcast", "reduce"]}
