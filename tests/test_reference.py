"""Reference semantics: the interpreter against hand-computed values, its error reports,
and (multirank) against real 4-rank gloo runs for every collective kind."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from commfuse.ir import kinds as ir_kinds
from commfuse.ir.kinds import CollectiveArgs, CollectiveKind, CollectiveOpSpec, register_collective_op
from commfuse.reference import (
    CollectiveMismatchError,
    DeadlockError,
    GroupResolutionError,
    InFlightMutationError,
    ReferenceInterpreter,
    UnknownCollectiveError,
    register_semantics,
    run_reference,
    unregister_semantics,
)
from commfuse.testing import crosscheck as cc
from commfuse.testing import assert_bitwise_equal_tree, assert_close_tree
from commfuse.testing.fake_pg import fake_process_group

c10d = torch.ops._c10d_functional
W = c10d.wait_tensor.default


def _trace(fn, *args, world=4, rank=0, setup=None):
    with fake_process_group(world, rank=rank):
        extra = setup(rank) if setup else ()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return make_fx(lambda *a: fn(*extra, *a), tracing_mode="fake")(*args)


def _rank_inputs(n, *shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(*s, generator=g) for s in shapes] for _ in range(n)]


# -- semantics against hand-computed values ------------------------------------------
def test_all_reduce_ops_and_canonical_order():
    def f(x):
        return [W(c10d.all_reduce.default(x, op, "0")) for op in ("sum", "avg", "max", "min", "product")]

    gm = _trace(f, torch.randn(3, 2))
    ins = _rank_inputs(4, (3, 2))
    outs = run_reference(gm, ins)
    xs = [i[0] for i in ins]
    expected_sum = ((xs[0] + xs[1]) + xs[2]) + xs[3]  # group-rank order, one rounding per step
    for r in range(4):
        s, a, mx, mn, p = outs[r]
        assert torch.equal(s, expected_sum)
        assert torch.equal(a, expected_sum / 4)
        assert torch.equal(mx, torch.stack(xs).amax(0)) and torch.equal(mn, torch.stack(xs).amin(0))
        assert torch.allclose(p, xs[0] * xs[1] * xs[2] * xs[3])
    assert outs[0][0] is not outs[1][0]  # ranks never share result tensors


def test_gather_scatter_alltoall_broadcast_by_hand():
    def f(x):
        ag = W(c10d.all_gather_into_tensor.default(x, 4, "0"))
        rs = W(c10d.reduce_scatter_tensor.default(x, "sum", 4, "0"))
        a2a = W(c10d.all_to_all_single.default(x, [1, 1, 1, 1], [1, 1, 1, 1], "0"))
        bc = W(c10d.broadcast.default(x, 3, "0"))
        return ag, rs, a2a, bc

    gm = _trace(f, torch.randn(4, 2))
    ins = [[torch.full((4, 2), float(r)) + torch.arange(4.0).view(4, 1) * 10] for r in range(4)]
    outs = run_reference(gm, ins)
    xs = [i[0] for i in ins]
    total = xs[0] + xs[1] + xs[2] + xs[3]
    for r in range(4):
        ag, rs, a2a, bc = outs[r]
        assert torch.equal(ag, torch.cat(xs))
        assert torch.equal(rs, total[r : r + 1])
        assert torch.equal(a2a, torch.stack([xs[j][r] for j in range(4)]))
        assert torch.equal(bc, xs[3])


def test_subgroup_partition_runs_one_graph_on_all_ranks():
    def setup(rank):
        pgs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        return ([p for p in pgs if isinstance(p, dist.ProcessGroup)][0],)

    def f(pg, x):
        return W(c10d.all_reduce.default(x, "sum", pg.group_name))

    gm = _trace(f, torch.randn(2), setup=setup)
    (name,) = {n.args[2] for n in gm.graph.nodes if n.target is c10d.all_reduce.default}
    ins = _rank_inputs(4, (2,))
    outs = run_reference(gm, ins, groups={name: [[0, 2], [1, 3]]})
    assert torch.equal(outs[0], ins[0][0] + ins[2][0]) and torch.equal(outs[2], outs[0])
    assert torch.equal(outs[1], ins[1][0] + ins[3][0]) and torch.equal(outs[3], outs[1])
    with pytest.raises(GroupResolutionError, match=r"rank 1 .* not a member.*partition"):
        run_reference(gm, ins, groups={name: [0, 2]})
    with pytest.raises(GroupResolutionError, match=f"group '{name}' is not in the group mapping"):
        run_reference(gm, ins, groups={"0": "world"})
    with pytest.raises(
        CollectiveMismatchError, match="group_size"
    ):  # wrong mapping caught by the op's group size
        gm2 = _trace(lambda x: W(c10d.all_gather_into_tensor.default(x, 2, "0")), torch.randn(2))
        run_reference(gm2, ins)


def test_inplace_collective_writes_its_buffer():
    def f(x):
        buf = x.clone()
        r = W(c10d.all_reduce_.default(buf, "max", "0"))
        return r, buf  # buf read after the wait: sees the result

    gm = _trace(f, torch.randn(3))
    ins = _rank_inputs(4, (3,))
    outs = run_reference(gm, ins)
    expected = torch.stack([i[0] for i in ins]).amax(0)
    assert torch.equal(outs[2][0], expected) and torch.equal(outs[2][1], expected)
    assert not torch.equal(ins[2][0], expected)  # inputs are cloned, never mutated


def test_uninitialised_memory_is_nan():
    gm = _trace(lambda x: torch.empty_like(x) + x, torch.randn(2))
    assert torch.isnan(run_reference(gm, _rank_inputs(2, (2,)))[0]).all()


# -- errors --------------------------------------------------------------------------
def _per_rank(fn_for_rank, *args, world=4, setup=None):
    return [_trace(fn_for_rank(r), *args, world=world, rank=r, setup=setup) for r in range(world)]


def test_mismatched_collectives_are_reported():
    gms = _per_rank(
        lambda r: lambda x: W(c10d.all_reduce.default(x, "sum" if r != 2 else "max", "0")), torch.randn(2)
    )
    with pytest.raises(
        CollectiveMismatchError, match=r"reduce_op differs between ranks: \['sum', 'sum', 'max', 'sum'\]"
    ):
        run_reference(gms, _rank_inputs(4, (2,)))
    gms = _per_rank(
        lambda r: (
            lambda x: W(c10d.all_reduce.default(x, "sum", "0")) if r else W(c10d.broadcast.default(x, 0, "0"))
        ),
        torch.randn(2),
    )
    with pytest.raises(CollectiveMismatchError, match="issue different collectives"):
        run_reference(gms, _rank_inputs(4, (2,)))


def test_deadlock_is_reported_not_hung():
    def setup(rank):
        pgs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        return ([p for p in pgs if isinstance(p, dist.ProcessGroup)][0],)

    def fn_for_rank(r):
        def f(pg, x):
            if r == 0:  # rank 0 orders its two collectives differently from rank 1
                a = W(c10d.all_reduce.default(x, "sum", "0"))
                return W(c10d.all_reduce.default(a, "sum", pg.group_name))
            a = W(c10d.all_reduce.default(x, "sum", pg.group_name))
            return W(c10d.all_reduce.default(a, "sum", "0"))

        return f

    gms = _per_rank(fn_for_rank, torch.randn(2), setup=setup)
    with pytest.raises(
        DeadlockError, match=r"rank 0 is blocked at node all_reduce .*group '0' \[0, 1, 2, 3\]"
    ):
        run_reference(gms, _rank_inputs(4, (2,)), groups={"0": "world", "1": [0, 1], "2": [2, 3]})

    gms = _per_rank(
        lambda r: lambda x: W(c10d.isend.default(x, 1, 0, "0")) if r == 0 else x + 0, torch.randn(2), world=2
    )
    with pytest.raises(DeadlockError, match="rank 0 sent 1 message.* to rank 1 .*never received"):
        run_reference(gms, _rank_inputs(2, (2,)))


def test_unknown_collective_names_the_op_and_custom_kind_can_be_registered():
    lib = torch.library.Library("commfuse_reftest", "FRAGMENT")
    lib.define("m2ms(Tensor x, str group_name) -> Tensor")
    lib.impl("m2ms", lambda x, g: x.clone(), "CompositeExplicitAutograd")
    lib.impl("m2ms", lambda x, g: torch.empty_like(x), "Meta")
    op = torch.ops.commfuse_reftest.m2ms.default
    register_collective_op(
        op, CollectiveOpSpec(CollectiveKind.M2MS, lambda a, k: CollectiveArgs((a[0],), a[1]))
    )
    try:
        gm = _trace(lambda x: W(op(x, "0")), torch.randn(2))
        with pytest.raises(
            UnknownCollectiveError, match=r"commfuse_reftest::m2ms .*kind 'many_to_many_scatter'.*register"
        ):
            run_reference(gm, _rank_inputs(2, (2,)))

        def reversed_gather(calls):  # test semantics: every rank gets the inputs in reverse rank order
            return [torch.cat([c.tensors[0] for c in reversed(calls)]) for _ in calls]

        register_semantics(CollectiveKind.M2MS, reversed_gather)
        try:
            ins = _rank_inputs(2, (2,))
            out = run_reference(gm, ins)
            assert torch.equal(out[0], torch.cat([ins[1][0], ins[0][0]]))
        finally:
            unregister_semantics(CollectiveKind.M2MS)
    finally:
        ir_kinds._REGISTRY.pop(op, None)


def test_unregistered_communication_op_is_refused():
    from commfuse.ir import kinds

    with fake_process_group(2):
        gm = make_fx(
            lambda x, o: c10d.all_gather_into_tensor_out.default(x, 2, "0", out=o), tracing_mode="fake"
        )(torch.randn(2), torch.randn(4))
    # Every _c10d_functional op is registered today: take one out to see the refusal.
    spec = kinds._REGISTRY.pop(c10d.all_gather_into_tensor_out.default)
    try:
        with pytest.raises(
            UnknownCollectiveError, match="all_gather_into_tensor_out communicates but is not a registered"
        ):
            ReferenceInterpreter(gm, 2)
    finally:
        kinds._REGISTRY[c10d.all_gather_into_tensor_out.default] = spec


# -- every crosscheck case also runs without gloo (fast smoke) --------------------------
@pytest.mark.parametrize("case", sorted(cc.CASES))
def test_crosscheck_case_runs_on_reference(case):
    graphs, groups, inputs = cc.trace_case(case)
    outs = run_reference(graphs, inputs, groups=groups)
    assert len(outs) == cc.WORLD_SIZE and all(isinstance(o, list) and o for o in outs)


def test_crosscheck_covers_every_collective_op():
    """Every op in the collective table (but the autograd variants, which trace to the
    plain ones) appears in some crosscheck case."""
    seen = set()
    for case in cc.CASES:
        graphs, _, _ = cc.trace_case(case)
        for gm in graphs if isinstance(graphs, list) else [graphs]:
            seen |= {n.target for n in gm.graph.nodes if n.op == "call_function"}
    table = {op for op in ir_kinds._REGISTRY if op.namespace == "_c10d_functional"}
    assert table and table <= seen, sorted(str(op) for op in table - seen)


# -- against real gloo ranks -------------------------------------------------------------
@pytest.fixture(scope="module")
def gloo_results(rank_pool_4):
    return rank_pool_4.run(cc.gloo_job, None, 0, timeout=180)


# every case as one SPMD graph and as one graph per rank (rank-dependent programs: per rank only)
_GLOO_PARAMS = [
    pytest.param(case, per_rank, id=f"{case}-{'graph_per_rank' if per_rank else 'one_graph'}")
    for case in sorted(cc.CASES)
    for per_rank in (False, True)
    if per_rank or not cc.CASES[case].per_rank
]


@pytest.mark.multirank
@pytest.mark.parametrize("case, per_rank", _GLOO_PARAMS)
def test_reference_matches_gloo(gloo_results, case, per_rank):
    spec = cc.CASES[case]
    graphs, groups, inputs = cc.trace_case(case, per_rank=per_rank)
    outs = run_reference(graphs, inputs, groups=groups)
    for r in range(cc.WORLD_SIZE):
        if spec.exact:
            assert_bitwise_equal_tree(outs[r], gloo_results[r][case], msg=f"{case} on rank {r}")
        else:
            assert_close_tree(
                outs[r], gloo_results[r][case], msg=f"{case} on rank {r}", summands=cc.WORLD_SIZE
            )


def test_input_modified_while_in_flight_is_a_race():
    c = c10d

    def f(x):
        work = c.all_gather_into_tensor.default(x, 2, "0")
        x.add_(1)  # x is read by the in-flight gather: modifying it before the wait is a race
        return W(work)

    gm = _trace(f, torch.randn(2), world=2)
    with pytest.raises(
        InFlightMutationError, match=r"all_gather_into_tensor .*modified before its wait wait_tensor"
    ):
        run_reference(gm, _rank_inputs(2, (2,)))

    def ok(x):
        y = W(c.all_gather_into_tensor.default(x, 2, "0"))
        x.add_(1)
        return y

    gm = _trace(ok, torch.randn(2), world=2)
    ins = _rank_inputs(2, (2,))
    assert torch.equal(run_reference(gm, ins)[1], torch.cat([ins[0][0], ins[1][0]]))


def test_collective_results_are_contiguous_like_the_real_ops():
    """The real functional collectives allocate contiguous outputs (on gloo too: broadcast and
    all_reduce clone their input contiguously), so a traced graph may `view` a gathered permuted
    tensor; the reference's results allow the same (torch.cat of permuted inputs keeps their
    strides, a plain clone too)."""

    def f(x):
        g = W(c10d.all_gather_into_tensor.default(x.permute(0, 2, 1), 2, "0"))
        a = W(c10d.all_to_all_single.default(x.permute(1, 0, 2), [2, 2], [2, 2], "0"))
        b = W(c10d.broadcast.default(x.transpose(1, 2), 0, "0"))
        return g.view(-1), a.view(-1), b

    gm = _trace(f, torch.randn(1, 4, 3), world=2)
    ins = _rank_inputs(2, (1, 4, 3))
    outs = run_reference(gm, ins)
    assert torch.equal(outs[1][0], torch.cat([i[0].permute(0, 2, 1) for i in ins]).reshape(-1))
    assert outs[1][2].is_contiguous() and torch.equal(outs[1][2], ins[0][0].transpose(1, 2))
