"""Collective IR tagging and dimension types, on graphs traced with the fake process group."""

from __future__ import annotations

import pytest
import torch
from expecttest import TestCase
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.ir import CollectiveIR, CollectiveKind, DimType, OpCategory
from commfuse.testing.fake_pg import fake_process_group
from commfuse.testing.graphs import capture_aot_graphs

from _graphs import SPBlock, parallelize_sp, summary, trace_all_kinds

OD, CD, ND = DimType.OD, DimType.CD, DimType.ND


class TestCollectiveKinds(TestCase):
    def test_every_functional_collective_kind(self):
        with fake_process_group(8):
            gm = trace_all_kinds()
            report = commfuse.analyze(gm)
        self.assertExpectedInline(
            summary(report),
            """\
all_reduce: all_reduce g0/8 dim=None in=[[8, 16]] out=[[8, 16]] logged=512 wire=896 role=tp(inferred)
all_gather_into_tensor: all_gather g0/8 dim=1 in=[[8, 16]] out=[[64, 16]] logged=512 wire=3584 role=sp(inferred)
reduce_scatter_tensor: reduce_scatter g0/8 dim=1 in=[[128, 2]] out=[[16, 2]] logged=128 wire=896 role=sp(inferred)
all_to_all_single: all_to_all g0/8 dim=0->0 in=[[16, 16]] out=[[16, 16]] logged=1024 wire=896 role=ep(inferred)
broadcast: broadcast g0/8 dim=None in=[[8, 16]] out=[[8, 16]] logged=512 wire=512 role=unknown(unknown)
all_reduce_coalesced: all_reduce g0/8 dim=None in=[[8, 16], [16, 16]] out=[[8, 16], [16, 16]] logged=1536 wire=2688 role=tp(inferred)
all_gather_into_tensor_coalesced: all_gather g0/8 dim=0 in=[[8, 16], [16, 16]] out=[[64, 16], [128, 16]] logged=1536 wire=10752 role=fsdp(inferred)
reduce_scatter_tensor_coalesced: reduce_scatter g0/8 dim=0 in=[[16, 16], [16, 16]] out=[[2, 16], [2, 16]] logged=256 wire=1792 role=unknown(unknown)
isend: send g0/8 dim=None in=[[8, 16]] out=[[0]] logged=512 wire=512 role=pp(inferred)
irecv: recv g0/8 dim=None in=[[8, 16]] out=[[8, 16]] logged=512 wire=0 role=pp(inferred)""",
        )
        self.assertEqual(report.total.count, 10)
        self.assertEqual(
            set(report.by_kind),
            {k.value for k in CollectiveKind} - {"batch_p2p", "many_to_many_scatter", "reduce", "p2p"},
        )
        self.assertEqual(report.by_group["0"].count, 10)

    def test_report_is_json(self):
        import json

        with fake_process_group(8):
            report = commfuse.analyze(trace_all_kinds())
        data = json.loads(report.to_json())
        self.assertEqual(len(data["collectives"]), 10)
        self.assertEqual(data["by_kind"]["all_gather"]["count"], 2)
        self.assertIn("0", data["sequence_hashes"])

    def test_group_roles_given_by_user_win(self):
        with fake_process_group(8):
            gm = trace_all_kinds()
            report = commfuse.analyze(gm, commfuse.Config(group_roles={"0": "dp"}))
        self.assertEqual({c.role for c in report.collectives}, {"dp"})
        self.assertEqual({c.role_source for c in report.collectives}, {"user"})

    def test_unknown_group_keeps_size_from_the_op(self):
        # A graph read without the process group alive: size comes from the op arguments.
        with fake_process_group(8):
            gm = trace_all_kinds()
        ir = CollectiveIR(gm)
        ag = next(c for c in ir.collectives if c.kind is CollectiveKind.ALL_GATHER)
        self.assertEqual(ag.group.size, 8)
        self.assertIsNone(ag.group.ranks)


@pytest.fixture(scope="module")
def tp_sp_graphs():
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (4,))
        torch.manual_seed(0)
        m = parallelize_sp(SPBlock(), mesh)
        graphs = capture_aot_graphs(m, torch.randn(2, 2, 16, requires_grad=True))
        reports = {k: commfuse.analyze(graphs[k], graph=k) for k in ("joint", "forward", "backward")}
    return graphs, reports


def test_tp_sp_joint_graph_sees_dim1_collectives(tp_sp_graphs):
    _, reports = tp_sp_graphs
    TestCase().assertExpectedInline(
        summary(reports["joint"]),
        """\
all_gather_into_tensor: all_gather g0/4 dim=1 in=[[2, 2, 16]] out=[[8, 2, 16]] logged=256 wire=768 role=sp(inferred)
reduce_scatter_tensor: reduce_scatter g0/4 dim=1 in=[[8, 2, 16]] out=[[2, 2, 16]] logged=256 wire=768 role=sp(inferred)
all_gather_into_tensor_1: all_gather g0/4 dim=1 in=[[2, 2, 16]] out=[[8, 2, 16]] logged=256 wire=768 role=sp(inferred)
reduce_scatter_tensor_1: reduce_scatter g0/4 dim=1 in=[[8, 2, 16]] out=[[2, 2, 16]] logged=256 wire=768 role=sp(inferred)""",
    )
    # The logical output of the SP gather is the cat along dim 1, the logical input of the scatter the
    # tensor before the split along dim 1.
    c = reports["joint"].collectives
    assert c[0].logical_output.startswith("cat") and c[1].logical_input.startswith("view")


def test_tp_sp_forward_and_backward_graphs(tp_sp_graphs):
    _, reports = tp_sp_graphs
    fw, bw = reports["forward"], reports["backward"]
    assert [(c.kind, c.logical_dim) for c in fw.collectives] == [("all_gather", 1), ("reduce_scatter", 1)]
    assert [(c.kind, c.logical_dim) for c in bw.collectives] == [("all_gather", 1), ("reduce_scatter", 1)]
    # Forward + backward together are the joint graph's collectives, in the same per-group order.
    joint_kinds = [c.kind for c in reports["joint"].collectives]
    assert joint_kinds == [c.kind for c in fw.collectives] + [c.kind for c in bw.collectives]


def test_dim_types_through_views(tp_sp_graphs):
    graphs, _ = tp_sp_graphs
    gm = graphs["joint"]
    ir = CollectiveIR(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    dims = ir.dims
    ln = nodes["native_layer_norm"]
    assert dims[ln].category is OpCategory.NORM and dims[ln].out == (OD, OD, ND)
    # The gathered normalised activation keeps H non-splittable through split/cat and view([B*S, H]).
    ag = ir.collectives[0]
    assert dims.out(ag.logical_output) == (OD, OD, ND)
    view = next(iter(ag.logical_output.users))
    assert dims[view].category is OpCategory.VIEW and dims.out(view) == (OD, ND)
    addmm = next(u for u in view.users if u.target is torch.ops.aten.addmm.default)
    assert dims[addmm].category is OpCategory.MATMUL
    assert dims[addmm].inputs[1] == (OD, CD) and dims[addmm].inputs[2] == (CD, OD)
    # t(weight) swaps the dims of the weight.
    t = addmm.args[2]
    assert dims[t].category is OpCategory.VIEW
    relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    assert dims[relu].category is OpCategory.ELEMENTWISE and set(dims.out(relu)) == {OD}


def test_dim_types_permute_softmax_and_opaque():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        s = torch.softmax(x @ w, dim=-1)  # [4, 6, 8]
        p = s.permute(2, 0, 1)  # softmax dim moves to the front
        r = p.reshape(8, 24)
        c = torch.cumsum(x, dim=1)  # not understood -> non-splittable everywhere
        m = x.sum(dim=1)
        return r, c, m

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 6, 5), torch.randn(5, 8))
    dims = CollectiveIR(gm).dims
    by_target = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    aten = torch.ops.aten
    assert dims.out(by_target[aten._softmax.default]) == (OD, OD, ND)
    assert dims.out(by_target[aten.permute.default]) == (ND, OD, OD)
    assert (
        dims.out(by_target[aten.view.default if aten.view.default in by_target else aten.reshape.default])[0]
        == ND
    )
    assert dims.out(by_target[aten.cumsum.default]) == (ND, ND, ND)
    s = dims[by_target[aten.sum.dim_IntList]]
    assert s.inputs[0] == (OD, CD, OD) and s.out == (OD, OD)


def test_symbolic_shapes_stay_symbolic():
    from torch.fx.experimental.proxy_tensor import make_fx

    import torch.distributed._functional_collectives as funcol
    import torch.distributed as dist

    with fake_process_group(4):

        def f(x):
            return funcol.all_gather_tensor(x, 0, dist.group.WORLD) * 2

        gm = make_fx(f, tracing_mode="symbolic")(torch.randn(6, 8))
        report = commfuse.analyze(gm)
    (c,) = report.collectives
    assert isinstance(c.input_shapes[0][0], str)  # e.g. "s0"
    assert "s" in str(c.logged_bytes) and c.wire_bytes is not None


def _capture_example(name: str, world: int):
    from commfuse.models import llama, moe, simple_fsdp

    mesh = init_device_mesh("cpu", (world,))
    if name == "moe":
        m = moe.parallelize_moe(moe.build_moe(dim=16, num_experts=world * 2, ffn_dim=32, seed=0), mesh)
        x = moe.make_inputs(world * 2, 4, 16, rank=0, world_size=world).inputs
    else:
        cfg = llama.LlamaConfig(n_layers=1, dim=32, n_heads=4, ffn_dim=64)
        m = simple_fsdp.data_parallel(llama.build_llama(cfg, seed=0), mesh, "fully_shard")
        x = simple_fsdp.make_inputs(cfg, world * 2, 8, rank=0, world_size=world).inputs
    return capture_aot_graphs(m, x)


def test_moe_graph_tagging():
    with fake_process_group(8):
        graphs = _capture_example("moe", 8)
        fw = commfuse.analyze(graphs["forward"])
        bw = commfuse.analyze(graphs["backward"])
    a2a = [c for c in fw.collectives if c.kind == "all_to_all"]
    assert len(a2a) == 2 and {c.role for c in a2a} == {"ep"} and {c.group_size for c in a2a} == {8}
    # Dispatch and combine exchange equal shares: wire = 7/8 of the buffer.
    assert all(c.wire_bytes * 8 == c.logged_bytes * 7 for c in a2a)
    kinds = sorted(c.kind for c in bw.collectives)
    assert kinds == ["all_reduce", "all_reduce", "all_to_all", "all_to_all"]
    # The replicated router/norm gradients are DP all_reduces of gradients.
    assert {c.role for c in bw.collectives if c.kind == "all_reduce"} == {"dp"}


def test_simple_fsdp_graph_tagging():
    with fake_process_group(8):
        graphs = _capture_example("fsdp", 8)
        fw = commfuse.analyze(graphs["forward"])
        bw = commfuse.analyze(graphs["backward"])
    assert fw.collectives and {(c.kind, c.role, c.logical_dim) for c in fw.collectives} == {
        ("all_gather", "fsdp", 0)
    }
    assert bw.collectives and {(c.kind, c.role, c.reduce_op) for c in bw.collectives} == {
        ("reduce_scatter", "fsdp", "avg")
    }
    # Every parameter is gathered once in forward and its gradient reduce-scattered once in backward.
    assert len(fw.collectives) == len(bw.collectives)
    ag = fw.collectives[0]
    assert ag.logged_bytes * 7 == ag.wire_bytes  # all_gather: logged = send count, wire = (N-1) x send


@pytest.mark.parametrize("batch", [1, 2])
def test_gather_as_single_view_and_slice_shuffles(batch):
    """The two other layouts torch 2.13 emits: a view when leading local dims are 1, and slice+cat
    in the autograd collectives' backward."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        full = funcol.all_gather_tensor_autograd(x, 1, dist.group.WORLD)  # x: [1, s, h] -> view form
        y = full.tanh()
        (g,) = torch.autograd.grad(y.sum(), [x])  # backward: reduce_scatter along dim 1
        return y, g

    with fake_process_group(4):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(batch, 2, 8, requires_grad=True))
        report = commfuse.analyze(gm)
    layouts = {n.target for c in CollectiveIR(gm).collectives for n in c.layout_nodes}
    if batch == 1:
        assert layouts == {torch.ops.aten.view.default}
    got = [(c.kind, c.logical_dim, c.role) for c in report.collectives]
    assert got == [("all_gather", 1, "sp"), ("reduce_scatter", 1, "sp")], (got, gm.code)


def test_dead_slice_piece_is_not_a_shuffle():
    """Fuzzer find (seed 11, program 78, with the slice matcher): a wait whose N slices include a
    dead one must not crash the IR (it is not a shuffle: the pieces are not all consumed)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        w = funcol.all_to_all_single(x, None, None, dist.group.WORLD)
        _dead = w[:, 0:8]
        return w[:, 8:16] + 1

    with fake_process_group(2):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 16))
        assert any(n.target is torch.ops.aten.slice.Tensor and not n.users for n in gm.graph.nodes)
        (c,) = commfuse.analyze(gm).collectives
    assert (c.kind, c.logical_dim, c.logical_concat_dim) == ("all_to_all", 0, 0)


def test_group_same_members():
    """Equal names, or known ranks equal in group-rank order; unknown ranks: the name alone."""
    from commfuse.ir import GroupInfo

    tp = GroupInfo("1", 4, (0, 1, 2, 3))
    assert tp.same_members(GroupInfo("1", 4, None))  # one name, one group
    assert tp.same_members(GroupInfo("7", 4, (0, 1, 2, 3)))  # another name, the same ranks
    assert not tp.same_members(GroupInfo("7", 4, (1, 0, 2, 3)))  # the same set in another order
    assert not tp.same_members(GroupInfo("7", 2, (0, 1)))
    assert not tp.same_members(GroupInfo("7", 4, None))  # ranks unknown on one side
    assert not GroupInfo("a", 4, None).same_members(GroupInfo("b", 4, None))
    assert GroupInfo("a", None, None).same_members(GroupInfo("a", None, None))


@pytest.mark.parametrize(
    "splits,rank_local",
    [
        ((None, None), False),  # equal splits: the traced op carries the even division of dim 0
        (([2, 2, 2, 2], [2, 2, 2, 2]), False),  # the same division, written out
        (([2, 2, 2, 2], [1, 3, 2, 2]), True),  # what this rank receives: another rank's may differ
    ],
)
def test_all_to_all_split_sizes_derived_from_the_shape_are_not_rank_local(splits, rank_local):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    from commfuse.analysis.rank_local import rank_local_reason

    out_splits, in_splits = splits
    with fake_process_group(4):
        gm = make_fx(
            lambda x: funcol.all_to_all_single(x, out_splits, in_splits, dist.group.WORLD) + 1,
            tracing_mode="fake",
        )(torch.randn(8, 3))
        ir = CollectiveIR(gm)
    (c,) = ir.collectives
    assert c.extra["rank_local_sizes"] is rank_local
    assert (rank_local_reason(ir.collectives, gm) is not None) is rank_local
