"""Reference semantics of commfuse::moe_layer and its backward (group-synchronous ops):
against real 4-rank gloo runs of the op, by hand, the interpreter's error reports, and the
equivalence helpers' inputs for graphs that use it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from commfuse.moe import MOE_LAYER, MOE_LAYER_BACKWARD
from commfuse.ops.moe_layer.op import moe_backward, moe_forward
from commfuse.ops.moe_layer.routing import assign, capacity_can_bind, router_probs, top_k_gates
from commfuse.reference import (
    CollectiveMismatchError,
    DeadlockError,
    ReferenceSemanticsError,
    run_reference,
)
from commfuse.testing import crosscheck as cc
from commfuse.testing.equivalence import check_equivalent, random_inputs
from commfuse.testing import assert_close_tree
from commfuse.testing.fake_pg import fake_process_group

c10d = torch.ops._c10d_functional
W = c10d.wait_tensor.default
H, F = 8, 8


def _trace(fn, *args, world=4, rank=0):
    with fake_process_group(world, rank=rank):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return make_fx(fn, tracing_mode="fake")(*args)


def _weights(e_local, seed, n_ranks=4):
    g = torch.Generator().manual_seed(seed)
    return [
        [
            torch.randn(e_local, H, F, generator=g) / H**0.5,
            torch.randn(e_local, H, F, generator=g) / H**0.5,
            torch.randn(e_local, F, H, generator=g) / F**0.5,
        ]
        for _ in range(n_ranks)
    ]


def _moe_inputs(n, tokens, e_local, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    router = torch.randn(e_local * n, H, generator=g) / H**0.5
    ws = _weights(e_local, seed, n)
    return [[torch.randn(tokens, H, generator=g), router.clone(), *ws[r]] for r in range(n)]


# -- against real gloo ranks ---------------------------------------------------------------
@pytest.fixture(scope="module")
def gloo_moe(rank_pool_4):
    return rank_pool_4.run(cc.gloo_job, list(cc.MOE_CASES), 0, timeout=180)


_PARAMS = [
    pytest.param(case, per_rank, id=f"{case}-{'graph_per_rank' if per_rank else 'one_graph'}")
    for case in cc.MOE_CASES
    for per_rank in (False, True)
    if per_rank or not cc.MOE_CASES[case].per_rank
]


@pytest.mark.multirank
@pytest.mark.parametrize("case, per_rank", _PARAMS)
def test_moe_reference_matches_gloo(gloo_moe, case, per_rank):
    graphs, groups, inputs = cc.trace_case(case, per_rank=per_rank)
    ops = {n.target for gm in (graphs if isinstance(graphs, list) else [graphs]) for n in gm.graph.nodes}
    assert MOE_LAYER in ops or MOE_LAYER_BACKWARD in ops
    outs = run_reference(graphs, inputs, groups=groups)
    for r in range(cc.WORLD_SIZE):
        assert_close_tree(outs[r], gloo_moe[r][case], msg=f"{case} on rank {r}", summands=cc.WORLD_SIZE)


def test_moe_cases_cover_the_semantics():
    """The gloo cases run forward and backward (the op, and autograd through it), dropless and
    binding capacity, top_k 1 and 2, on sub-groups and with uneven token counts; the capacity
    cases do drop tokens (else they would test the dropless path twice)."""

    def value(node, env):  # a graph input, seen through detach / alias
        while node.op != "placeholder":
            (node,) = node.all_input_nodes
        return env[node]

    seen = set()
    for name in cc.MOE_CASES:
        graphs, _, inputs = cc.trace_case(name)
        gm = graphs[0] if isinstance(graphs, list) else graphs
        env = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs[0], strict=True))
        for n in gm.graph.nodes:
            if n.target not in (MOE_LAYER, MOE_LAYER_BACKWARD):
                continue
            off = 3 if n.target is MOE_LAYER_BACKWARD else 0
            k, cf, tg, group = n.args[5 + off : 9 + off]
            seen.add(("fwd" if off == 0 else "bwd", k, "capacity" if cf > 0 else "dropless"))
            if cf > 0 and group:
                x, rw = value(n.args[off], env), value(n.args[off + 1], env)
                _, experts = top_k_gates(router_probs(x, rw)[1], k)
                kept = assign(experts, rw.shape[0], cf, tg).token.numel()
                assert capacity_can_bind(cf, k, rw.shape[0]) and kept < x.shape[0] * k, name
    for d in ("fwd", "bwd"):
        for k in (1, 2):
            for mode in ("dropless", "capacity"):
                assert (d, k, mode) in seen, (d, k, mode)


# -- semantics by hand -----------------------------------------------------------------------
def _fwd_graph(k, cf, tg, group="0"):
    return lambda x, rw, w1, w3, w2: list(MOE_LAYER(x, rw, w1, w3, w2, k, cf, tg, group))


def test_forward_is_the_single_process_layer_with_all_experts():
    ins = _moe_inputs(4, 8, 2)
    gm = _trace(_fwd_graph(2, 1.0, 2), *ins[0])
    outs = run_reference(gm, ins)
    full = [torch.cat([ins[r][i] for r in range(4)]) for i in (2, 3, 4)]
    for r in range(4):
        expected = moe_forward(ins[r][0], ins[r][1], *full, 2, 1.0, 2, "")
        for a, e in zip(outs[r], expected, strict=True):
            assert torch.equal(a, e)
    # no expert parallelism: every rank alone, its own (full) experts
    full_ins = [[ins[r][0], ins[r][1], *full] for r in range(4)]
    gm = _trace(_fwd_graph(2, 0.0, 1, ""), *full_ins[0])
    outs = run_reference(gm, full_ins)
    assert all(torch.equal(outs[r][0], moe_forward(*full_ins[r], 2, 0.0, 1, "")[0]) for r in range(4))


def test_backward_sums_expert_gradients_over_ranks_and_scales_them():
    ins = _moe_inputs(2, 6, 2, seed=3)
    g = torch.Generator().manual_seed(9)
    grads = [
        [torch.randn(6, H, generator=g), torch.randn(4, generator=g), torch.randn((), generator=g)]
        for _ in range(2)
    ]
    scale = [0.5, 3.0]

    def f(r):
        return lambda go, gp, gz, x, rw, w1, w3, w2: list(
            MOE_LAYER_BACKWARD(go, gp, gz, x, rw, w1, w3, w2, 1, 0.0, 1, "0", scale[r])
        )

    gms = [_trace(f(r), *grads[r], *ins[r], world=2, rank=r) for r in range(2)]
    outs = run_reference(gms, [grads[r] + ins[r] for r in range(2)])
    full = [torch.cat([ins[r][i] for r in range(2)]) for i in (2, 3, 4)]
    single = [moe_backward(*grads[r], *ins[r][:2], *full, 1, 0.0, 1, "", 1.0) for r in range(2)]
    for r in range(2):
        assert torch.equal(outs[r][0], single[r][0]) and torch.equal(outs[r][1], single[r][1])
        for k in (2, 3, 4):
            expected = (single[0][k] + single[1][k])[2 * r : 2 * r + 2] * scale[r]
            assert torch.equal(outs[r][k], expected)


# -- errors ------------------------------------------------------------------------------------
def test_ranks_must_agree_on_router_and_attributes():
    ins = _moe_inputs(4, 8, 1)
    gm = _trace(_fwd_graph(1, 1.0, 1), *ins[0])
    bad = [list(i) for i in ins]
    bad[2][1] = bad[2][1] + 1e-3
    with pytest.raises(
        CollectiveMismatchError, match=r"router_w differs between ranks .*rank 2 node moe_layer"
    ):
        run_reference(gm, bad)
    gms = [_trace(_fwd_graph(2 if r == 3 else 1, 1.0, 1), *ins[r], rank=r) for r in range(4)]
    with pytest.raises(CollectiveMismatchError, match=r"top_k differs between ranks: \[1, 1, 1, 2\]"):
        run_reference(gms, ins)
    # capacity buffers are exchanged with equal splits: every rank must route as many tokens
    uneven = [[torch.randn(8 if r else 4, H), *ins[r][1:]] for r in range(4)]
    gms = [_trace(_fwd_graph(1, 1.0, 1), *uneven[r], rank=r) for r in range(4)]
    with pytest.raises(CollectiveMismatchError, match="capacity buffers differ between ranks"):
        run_reference(gms, uneven)
    gms = [_trace(_fwd_graph(1, 0.0, 1), *uneven[r], rank=r) for r in range(4)]  # dropless: fine
    assert [o[0].shape[0] for o in run_reference(gms, uneven)] == [4, 8, 8, 8]
    with pytest.raises(CollectiveMismatchError, match="4 experts but the 4 ranks hold 2 local experts"):
        wide = [[i[0], i[1], *(torch.cat([w, w]) for w in i[2:])] for i in ins]
        run_reference(_trace(_fwd_graph(1, 1.0, 1), *wide[0]), wide)
    with pytest.raises(
        ReferenceSemanticsError, match=r"rank 0 node moe_layer .*do not split into token_groups=3"
    ):
        run_reference(_trace(_fwd_graph(1, 1.0, 3), *ins[0]), ins)


def test_rank_that_never_reaches_the_layer_is_a_deadlock():
    ins = _moe_inputs(4, 8, 1)

    def f(r):
        if r == 1:
            return lambda x, rw, w1, w3, w2: [x * 2]
        return _fwd_graph(1, 0.0, 1)

    gms = [_trace(f(r), *ins[r], rank=r) for r in range(4)]
    with pytest.raises(DeadlockError, match=r"rank 0 is blocked at node moe_layer .*waiting for ranks \[1\]"):
        run_reference(gms, ins)

    def g(r):  # rank 2 issues an all_reduce on the group where the others run the layer
        if r == 2:
            return lambda x, rw, w1, w3, w2: [W(c10d.all_reduce.default(x, "sum", "0"))]
        return _fwd_graph(1, 0.0, 1)

    gms = [_trace(g(r), *ins[r], rank=r) for r in range(4)]
    with pytest.raises(CollectiveMismatchError, match="issue different collectives"):
        run_reference(gms, ins)


# -- equivalence helpers on graphs with the layer ------------------------------------------------
def _joint_sp_moe(x, rw, w1, w3, w2):
    """Sequence-parallel tokens gathered on the group that is also the EP group, then the layer."""
    import torch.distributed._functional_collectives as funcol

    full = funcol.all_gather_single_autograd(x, 0, dist.group.WORLD)
    out, ps, t1, z = MOE_LAYER(torch.tanh(full), rw, w1, w3, w2, 2, 1.0, 4, dist.group.WORLD.group_name)
    return [out, ps, t1, z]


def test_random_inputs_replicate_the_router_of_every_moe_layer():
    gm = _trace(
        _joint_sp_moe,
        torch.randn(2, H),
        torch.randn(4, H),
        torch.randn(1, H, F),
        torch.randn(1, H, F),
        torch.randn(1, F, H),
    )
    ins = random_inputs(gm, 4, seed=1)
    assert all(torch.equal(ins[r][1], ins[0][1]) for r in range(4))  # the router (2nd argument)
    assert not torch.equal(ins[1][0], ins[0][0]) and not torch.equal(
        ins[1][2], ins[0][2]
    )  # the rest per rank
    outs = check_equivalent(gm, gm, 4, seed=1, exact=True)
    assert len(outs) == 4 and outs[0][0].shape == (8, H)
