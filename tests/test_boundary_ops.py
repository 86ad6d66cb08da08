"""commfuse's boundary ops: commfuse::m2ms and commfuse::stage_transfer.

Single process: schemas, fake kernels and tracing (make_fx forward and joint fw+bw, with and
without trace_position), argument parsing, bad input. Real gloo ranks: values against a
literal transcription of the spec (tests/_jobs_boundary_ops.py::ref_m2ms), gradients as the
reverse scatter, opposite issue orders (1F1B), torch.compile.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse
from commfuse.core.torch_private import c10d_functional
from commfuse.ops import (
    M2MS,
    M2MS_AUTOGRAD,
    STAGE_TRANSFER,
    STAGE_TRANSFER_AUTOGRAD,
    m2ms,
    parse_m2ms,
    parse_stage_transfer,
    stage_transfer,
    trace_as_rank,
    trace_position,
)
from commfuse.testing.fake_pg import fake_process_group

import _jobs_boundary_ops as jobs

WAIT = c10d_functional.wait_tensor.default

# 4 ranks; A = {0, 1, 2}, B = {1, 2, 3} (overlapping): rank 0 only sends, 3 only receives.
SRC, DST = [0, 1, 2], [1, 2, 3]
MAT = [[1, 2, 3], [4, 0, 1], [2, 5, 0]]
ROW = {r: sum(MAT[SRC.index(r)]) if r in SRC else 0 for r in range(4)}
COL = {r: sum(row[DST.index(r)] for row in MAT) if r in DST else 0 for r in range(4)}


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


# ------------------------------------------------------------------------------- registration


def test_ops_are_registered_with_the_spec_schemas():
    assert str(M2MS._schema) == (
        "commfuse::m2ms(Tensor x, int dim, int[] splits, int[] src, int[] dst, "
        "int group_size, str group_name) -> Tensor"
    )
    assert str(M2MS_AUTOGRAD._schema).startswith("commfuse::m2ms_autograd(Tensor x, int dim, int[] splits")
    assert str(STAGE_TRANSFER._schema) == (
        "commfuse::stage_transfer(Tensor x, int[] src, int[] dst, int group_size, str group_name) -> Tensor"
    )
    assert str(STAGE_TRANSFER_AUTOGRAD._schema).startswith(
        "commfuse::stage_transfer_autograd(Tensor x, int[] src"
    )
    assert commfuse.ops.boundary.m2ms is m2ms and "ops" in commfuse.__all__


# ---------------------------------------------------------------------------- fake / tracing


def _forward(x, y):
    g = torch.distributed.group.WORLD
    a = m2ms(x * 2, 0, MAT, SRC, DST, g)
    b = stage_transfer(y, [0, 1], [1, 2], g.group_name)
    return a, b


@pytest.mark.parametrize("rank", range(4))
def test_make_fx_forward_traces_async_ops_with_this_ranks_shapes(rank):
    with fake_process_group(4, rank=rank):
        gm = make_fx(_forward, tracing_mode="fake")(torch.randn(ROW[rank], 3), torch.randn(2, 5))
        (m,), (s,) = _calls(gm, M2MS), _calls(gm, STAGE_TRANSFER)
        assert m.args[1:] == (0, [1, 2, 3, 4, 0, 1, 2, 5, 0], SRC, DST, 4, "0")
        assert s.args[1:] == ([0, 1], [1, 2], 4, "0")
        waits = _calls(gm, WAIT)
        assert [w.args[0] for w in waits] == [m, s]
        assert tuple(m.meta["val"].shape) == (COL[rank], 3)
        assert tuple(s.meta["val"].shape) == (2, 5)
        assert not _calls(gm, M2MS_AUTOGRAD)


def test_fake_kernel_under_trace_position():
    """Rank 0 (in A only) traces as each member of B, as a non-member, and ignores a
    context on another group; trace_position reads the input as src[p], the output as dst[p]."""
    with fake_process_group(4, rank=0):
        g = torch.distributed.group.WORLD
        for r in DST:
            with trace_as_rank(g.group_name, r):
                # the traced rank's input has the traced rank's row size
                y = make_fx(lambda x: m2ms(x, 0, MAT, SRC, DST, g), tracing_mode="fake")(
                    torch.randn(ROW[r], 3)
                )
            assert tuple(_calls(y, M2MS)[0].meta["val"].shape) == (COL[r], 3)
        for pos in range(len(DST)):
            with trace_position(g.group_name, pos):
                # a pipeline rank at position pos: sends as SRC[pos], receives as DST[pos]
                y = make_fx(lambda x: m2ms(x, 0, MAT, SRC, DST, g), tracing_mode="fake")(
                    torch.randn(ROW[SRC[pos]], 3)
                )
            assert tuple(_calls(y, M2MS)[0].meta["val"].shape) == (COL[DST[pos]], 3)
        with trace_position(None, None):
            y = make_fx(lambda x: m2ms(x, 0, MAT, SRC, DST, g), tracing_mode="fake")(torch.randn(0, 3))
        assert tuple(_calls(y, M2MS)[0].meta["val"].shape) == (0, 3)
        with trace_position("another-group", 2):  # not this op's group: rank 0's own view
            y = make_fx(lambda x: m2ms(x, 0, MAT, SRC, DST, g), tracing_mode="fake")(torch.randn(ROW[0], 3))
        assert tuple(_calls(y, M2MS)[0].meta["val"].shape) == (COL[0], 3)
        with trace_position(None, 5), pytest.raises(ValueError, match="position 5 is outside src"):
            make_fx(lambda x: m2ms(x, 0, MAT, SRC, DST, g), tracing_mode="fake")(torch.randn(0, 3))
        with trace_as_rank(g.group_name, DST[0]), pytest.raises(ValueError, match="x has size 6 along dim 0"):
            # traced as dst[0] = rank 1 (row 5): rank 0's own input does not fit
            make_fx(lambda x: m2ms(x, 0, MAT, SRC, DST, g), tracing_mode="fake")(torch.randn(ROW[0], 3))


def test_trace_position_on_disjoint_stages_and_its_backward():
    """Pipeline stages [0, 1] -> [2, 3]: rank 0 traces the whole boundary at position 1,
    sending as rank 1 and receiving as rank 3; the backward gets rank 1's input shape."""
    mat = [[1, 2], [3, 4]]  # rows: src 0, 1; columns: dst 2, 3
    with fake_process_group(4, rank=0):
        g = torch.distributed.group.WORLD

        def f(x):
            out = m2ms(x, 0, mat, [0, 1], [2, 3], g)
            return torch.autograd.grad((out * out).sum(), [x])

        with trace_position(None, 1):
            gm = make_fx(f, tracing_mode="fake")(torch.randn(3 + 4, 2, requires_grad=True))
        fw, bw = _calls(gm, M2MS_AUTOGRAD)
        assert tuple(fw.meta["val"].shape) == (2 + 4, 2)
        assert tuple(bw.meta["val"].shape) == (3 + 4, 2)


def _joint(x, w, y):
    g = torch.distributed.group.WORLD
    out = m2ms(x, -1, MAT, SRC, DST, g)
    z = stage_transfer(y, [0, 1, 2], [1, 2, 3], g)
    loss = (out * w).sum() + (z * z).sum()
    return torch.autograd.grad(loss, [x, y])


def _joint_graph(rank, traced_as=None):
    args = (
        torch.randn(2, ROW[traced_as if traced_as is not None else rank], requires_grad=True),
        torch.randn(2, COL[traced_as if traced_as is not None else rank]),
        torch.randn(3, 4, requires_grad=True),
    )
    if traced_as is None:
        return make_fx(_joint, tracing_mode="fake")(*args)
    with trace_as_rank("0", traced_as):
        return make_fx(_joint, tracing_mode="fake")(*args)


@pytest.mark.parametrize("rank", range(4))
def test_joint_trace_backward_is_the_reverse_scatter(rank):
    with fake_process_group(4, rank=rank):
        gm = _joint_graph(rank)
        fw, bw = _calls(gm, M2MS_AUTOGRAD)
        p_fw, p_bw = parse_m2ms(fw), parse_m2ms(bw)
        assert (p_fw.src, p_fw.dst, p_fw.dim) == (tuple(SRC), tuple(DST), 1)
        assert (p_bw.src, p_bw.dst, p_bw.dim) == (tuple(DST), tuple(SRC), 1)
        assert p_bw.splits == tuple(zip(*p_fw.splits, strict=True))  # transposed
        assert tuple(fw.meta["val"].shape) == (2, COL[rank])
        assert tuple(bw.meta["val"].shape) == (2, ROW[rank])  # the gradient has x's shape
        s_fw, s_bw = _calls(gm, STAGE_TRANSFER_AUTOGRAD)
        assert (parse_stage_transfer(s_bw).src, parse_stage_transfer(s_bw).dst) == ((1, 2, 3), (0, 1, 2))
        assert tuple(s_bw.meta["val"].shape) == (3, 4)
        assert not _calls(gm, M2MS) and not _calls(gm, WAIT)  # autograd variants wait inside


@pytest.mark.parametrize("traced_as", [1, 2, 3])
def test_joint_trace_as_another_member_keeps_forward_and_backward_consistent(traced_as):
    """Rank 0 traces as rank `traced_as`; the backward (received on A, where the traced rank
    sits at another position or nowhere) gets the traced rank's input shape."""
    with fake_process_group(4, rank=0):
        gm = _joint_graph(0, traced_as=traced_as)
        fw, bw = _calls(gm, M2MS_AUTOGRAD)
        assert tuple(fw.meta["val"].shape) == (2, COL[traced_as])
        assert tuple(bw.meta["val"].shape) == (2, ROW[traced_as])


def test_trace_as_rank_and_position_validation():
    with fake_process_group(4, rank=3):
        g = torch.distributed.group.WORLD
        with trace_as_rank("0", 2):
            y = make_fx(lambda x: m2ms(x, 0, MAT, SRC, DST, g), tracing_mode="fake")(torch.randn(ROW[2], 3))
        assert tuple(_calls(y, M2MS)[0].meta["val"].shape) == (COL[2], 3)
    with pytest.raises(ValueError, match="position must be a non-negative int"):
        with trace_position(None, -1):
            pass
    with pytest.raises(ValueError, match="group_name must be a str or None"):
        with trace_position(3, 0):
            pass


def test_parse_from_args_and_helpers():
    a = parse_m2ms((torch.empty(6, 2), -2, [1, 2, 3, 4, 0, 1, 2, 5, 0], SRC, DST, 4, "g"))
    assert a.dim == 0 and a.splits == ((1, 2, 3), (4, 0, 1), (2, 5, 0))
    assert a.row(1) == (4, 0, 1) and a.row(3) == (0, 0, 0)
    assert a.column(2) == (2, 0, 5) and a.column(0) == (0, 0, 0)
    assert a.sent_units(1) == 1 and a.received_units(1) == 1 + 2  # its own piece (4) is no traffic
    assert a.send_peers(1) == (3,)  # the piece to itself is local, the piece to 2 is empty
    assert a.recv_peers(2) == (0,)
    assert a.unit_numel((6, 2)) == 2
    kw = parse_m2ms(
        (torch.empty(2, 3),),
        {"dim": 1, "splits": [3], "src": [0], "dst": [1], "group_size": 2, "group_name": "g"},
    )
    assert kw.dim == 1 and kw.splits == ((3,),)
    s = parse_stage_transfer((torch.empty(2), [0, 1], [1, 2], 4, "g"))
    assert (
        s.sends_to(1) == 2
        and s.receives_from(1) == 0
        and s.sends_to(3) is None
        and s.receives_from(0) is None
    )
    assert s.pairs() == ((0, 1), (1, 2))


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda g: m2ms(torch.zeros(6, 2), 0, [1, 2, 3], SRC, DST, g),
            "splits has 3 entries, expected len\\(src\\)",
        ),
        (
            lambda g: m2ms(torch.zeros(6, 2), 0, [[1, 2], [3, 4], [5, 6]], SRC, DST, g),
            "splits row 0 has 2 entries",
        ),
        (lambda g: m2ms(torch.zeros(6, 2), 0, [[1, 2, 3]], SRC, DST, g), "splits has 1 rows"),
        (
            lambda g: m2ms(torch.zeros(6, 2), 0, [[1, -2, 7], [4, 0, 1], [2, 5, 0]], SRC, DST, g),
            "splits\\[1\\] = -2 is negative",
        ),
        (
            lambda g: m2ms(torch.zeros(6, 2), 0, [[1, 2.0, 3], [4, 0, 1], [2, 5, 0]], SRC, DST, g),
            "splits\\[1\\] must be an int",
        ),
        (lambda g: m2ms(torch.zeros(6, 2), 0, MAT, [0, 1, 1], DST, g), "src holds rank 1 twice"),
        (
            lambda g: m2ms(torch.zeros(6, 2), 0, MAT, SRC, [1, 2, 4], g),
            "dst holds rank 4, outside the group of 4",
        ),
        (lambda g: m2ms(torch.zeros(6, 2), 0, MAT, [-1, 1, 2], DST, g), "src holds rank -1"),
        (lambda g: m2ms(torch.zeros(6, 2), 0, [], [], DST, g), "src is empty"),
        (lambda g: m2ms(torch.zeros(6, 2), 2, MAT, SRC, DST, g), "dim 2 is out of range"),
        (lambda g: m2ms(torch.zeros(()), 0, MAT, SRC, DST, g), "x must have at least one dimension"),
        (lambda g: m2ms([1, 2], 0, MAT, SRC, DST, g), "x must be a Tensor"),
        (
            lambda g: m2ms(torch.zeros(6, 2), 0, MAT, SRC, DST, "no-such-group"),
            "group 'no-such-group' names no process",
        ),
        (
            lambda g: m2ms(torch.zeros(6, 2), 0, MAT, SRC, DST, 3),
            "group must be a ProcessGroup or a group name",
        ),
        (lambda g: m2ms(torch.zeros(6, 2), 0, MAT, "0,1", DST, g), "src must be a list of group ranks"),
        (lambda g: stage_transfer(torch.zeros(2), [0, 1], [1], g), "src has 2 ranks and dst 1"),
        (lambda g: stage_transfer(torch.zeros(2), [0, 1], [2, 2], g), "dst holds rank 2 twice"),
        (lambda g: stage_transfer(torch.zeros(2), [0], [7], g), "dst holds rank 7, outside the group of 4"),
        (
            lambda g: M2MS(torch.zeros(6, 2), 0, [1] * 9, SRC, DST, 0, "0"),
            "group_size must be a positive int",
        ),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(call, match):
    with fake_process_group(4, rank=0) as g:
        with pytest.raises(ValueError, match=match):
            call(g)


def test_input_size_mismatch_is_caught_when_tracing():
    with fake_process_group(4, rank=3) as g:  # rank 3 is not in src: its x must be empty along dim
        with pytest.raises(ValueError, match="x has size 2 along dim 0, but group rank 3 is not in src"):
            make_fx(lambda x: m2ms(x, 0, MAT, SRC, DST, g), tracing_mode="fake")(torch.zeros(2, 3))


# ------------------------------------------------------------------------------ real gloo ranks


def _bad(records):
    return [
        r for r in records if not all(v for k, v in r.items() if k.endswith(("equal", "_ok", "contiguous")))
    ]


@pytest.mark.multirank
def test_m2ms_values_every_case_layout_and_dtype(rank_pool_4):
    """Even, uneven, empty pieces/rows/columns, disjoint, overlapping, identical groups, a
    rank in neither group, unsorted lists, 1->N and N->1; dims 0, 1, -1, staged and direct;
    float32 / bfloat16 / int64; bitwise against the spec; async op with the input clobbered
    before the wait, and the wrapper."""
    results = rank_pool_4.run(jobs.m2ms_numerics, ["float32", "bfloat16", "int64"])
    n = len(jobs.M2MS_CASES) * len(jobs.LAYOUTS) * 3
    for rank, records in enumerate(results):
        assert len(records) == n
        assert not _bad(records), f"rank {rank}: {_bad(records)[:3]}"
        assert all(r["shape"] == r["want_shape"] for r in records)
    # the cases really exercise empty outputs and non-members
    assert any(r["shape"][r["dim"]] == 0 for r in results[0])


@pytest.mark.multirank
def test_m2ms_over_all_ranks_is_all_to_all_single(rank_pool_4):
    assert rank_pool_4.run(jobs.m2ms_matches_all_to_all) == [True] * 4


@pytest.mark.multirank
def test_m2ms_on_a_subgroup_uses_group_ranks(rank_pool_4):
    res = rank_pool_4.run(jobs.m2ms_on_subgroup)
    assert res[0] is None
    assert [r["group_rank"] for r in res[1:]] == [0, 1, 2] and all(r["equal"] for r in res[1:])


@pytest.mark.multirank
def test_m2ms_gradient_is_the_reverse_scatter(rank_pool_4):
    for rank, records in enumerate(rank_pool_4.run(jobs.m2ms_gradients)):
        assert records and not _bad(records), f"rank {rank}: {_bad(records)[:3]}"
        assert max(r["adjoint_gap"] for r in records) < 1e-9


@pytest.mark.multirank
def test_stage_transfer_values_and_gradients(rank_pool_4):
    for rank, records in enumerate(rank_pool_4.run(jobs.stage_transfer_cases)):
        assert len(records) == 12 and not _bad(records), f"rank {rank}: {_bad(records)}"
        assert sum("grad_equal" in r for r in records) == 8


@pytest.mark.multirank
def test_transfers_issued_in_opposite_orders_on_the_two_sides(rank_pool_4):
    for res in rank_pool_4.run(jobs.opposite_issue_orders, timeout=60):
        assert res == {"m2ms_fwd": True, "m2ms_bwd": True, "p2p_fwd": True, "p2p_bwd": True}


@pytest.mark.multirank
def test_fake_kernel_on_a_live_group_and_size_check(rank_pool_4):
    assert rank_pool_4.run(jobs.fake_shapes_under_real_group) == [(6, 5), (4, 5), (0, 5), (0, 5)]
    msgs = rank_pool_4.run(jobs.size_mismatch_raises)
    assert all(f"group rank {r} is src[{r}] and sends sum(splits row) = 4" in m for r, m in enumerate(msgs))


@pytest.mark.multirank
def test_torch_compile_aot_eager_matches_eager(rank_pool_2):
    for res in rank_pool_2.run(jobs.compile_matches_eager, timeout=240):
        assert res == {
            "loss_equal": True,
            "grad_equal": True,
            "frames": 1,
            "has_m2ms": True,
            "has_stage_transfer": True,
        }
