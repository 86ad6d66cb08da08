"""group_partition (Centauri §3.1): sub-groups at set-up, the hierarchical sequences, refusals.

Graph-level tests trace under the fake process group (world 8 = 2 nodes x 4, world 4 =
2 x 2), check the emitted sequence with FileCheck and run before/after on the reference
interpreter with the sub-group aliases mapped to their partitions. Integer-valued float
inputs make every sum exact, so the reduce_scatter / all_reduce sequences are compared
bitwise too. The 4-rank gloo runs (2 "nodes" x 2) compare training with the unoptimised
program.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

import commfuse
from commfuse.costmodel import Topology
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.passmgr.context import PassContext
from commfuse.transforms.group_partition import GroupPlan, apply_group_partition, plan_group_partition
from commfuse.passmgr.verifier import verify_graph
from commfuse.testing.equivalence import check_equivalent
from commfuse.session import hierarchy_layout, mesh_blocks, reset, subgroup_names
from commfuse.testing.fake_pg import fake_process_group
from commfuse.testing.graphs import _copy

from _jobs_group_partition import TOPO_2x2, compiled_matches_eager, counting_new_group, setup_counts

# Latency-bound CPU topology: the hierarchical sequences are predicted faster on small tensors.
TOPO_2x4 = Topology(
    name="test-2x4",
    num_nodes=2,
    ranks_per_node=4,
    intra_node_bandwidth_GBps=100.0,
    inter_node_bandwidth_GBps=1.0,
    intra_node_latency_us=1.0,
    inter_node_latency_us=5.0,
    collective_launch_us=0.1,
)
# Launch-bound: one more collective never pays.
TOPO_SLOW_LAUNCH = TOPO_2x2.model_copy(update={"collective_launch_us": 500.0})
W = "0"  # the world's group name in a fake world


@pytest.fixture(autouse=True)
def _fresh_session():
    reset()
    yield
    reset()


def _topo(world: int) -> Topology:
    return TOPO_2x4 if world == 8 else TOPO_2x2


def _ints(gm, world, seed=0):
    """Per-rank integer-valued float inputs: sums in any order are exact."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(seed * 31 + r)
        out.append(
            [
                torch.randint(-8, 8, tuple(n.meta["val"].shape), generator=g).float()
                for n in gm.graph.nodes
                if n.op == "placeholder"
            ]
        )
    return out


def _groups(session) -> dict:
    return {W: "world", **session.reference_groups()}


def _run_pass(gm, topo, **cfg):
    commfuse.optimize(gm, commfuse.Config(passes=["group_partition"], strict=True, topology=topo, **cfg))
    (rec,) = [p for p in commfuse.last_report(gm).passes if p.name == "group_partition"]
    return rec


# ---------------------------------------------------------------- layout and set-up
def _centauri_subgroups(r: int, dims: tuple[int, ...]) -> list[set[int]]:
    """Centauri's G'_i for rank r on the mesh `dims`, straight from the index formula."""

    def index(q):
        return [(q // math.prod(dims[k + 1 :])) % dims[k] for k in range(len(dims))]

    world = math.prod(dims)
    return [
        {q for q in range(world) if all(index(q)[j] == index(r)[j] for j in range(len(dims)) if j != i)}
        for i in range(len(dims))
    ]


@pytest.mark.parametrize("a,b", [(2, 2), (2, 4), (4, 2), (3, 2)])
def test_blocks_follow_the_index_formula(a, b):
    parent = tuple(range(a * b))
    intra, inter = mesh_blocks(parent, a, b)
    for r in parent:
        g_inter, g_intra = _centauri_subgroups(r, (a, b))  # dim 0 = nodes varies: inter-node group
        assert set(next(x for x in intra if r in x)) == g_intra
        assert set(next(x for x in inter if r in x)) == g_inter
    assert hierarchy_layout(parent, Topology(num_nodes=a, ranks_per_node=b)) == (a, b)


@pytest.mark.parametrize(
    "ranks,reason",
    [
        ((0, 1, 2, 3), "group inside one node"),
        ((0, 4), "one rank per node"),
        ((0, 1, 2, 4), r"uneven ranks per node \(\[3, 1\]\)"),
        ((4, 5, 0, 1), "not ascending"),
    ],
)
def test_layout_refusals(ranks, reason):
    import re

    assert re.search(reason, hierarchy_layout(ranks, TOPO_2x4))
    assert hierarchy_layout((0, 2, 4, 6), TOPO_2x4) == (2, 2)  # strided: 2 ranks on each node


def test_setup_creates_every_subgroup_once_in_one_order_on_every_rank():
    """World (2x4) and the dp dim of a (dp=4, tp=2) mesh: same new_group sequence on ranks 0
    and 5; blocks already created are reused; a second setup creates nothing."""
    from torch.distributed.device_mesh import init_device_mesh

    seqs, sessions = {}, {}
    for rank in (0, 5):
        with fake_process_group(8, rank=rank):
            mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
            calls, again = [], []
            with counting_new_group(calls):
                s = commfuse.setup(topology=TOPO_2x4, mesh=mesh)
            with counting_new_group(again):
                commfuse.setup(topology=TOPO_2x4, mesh=mesh)
            seqs[rank] = calls
            sessions[rank] = s
            assert again == []
            dp_name = mesh.get_group("dp").group_name
            assert s.group_roles[dp_name] == "dp"
            dp_ranks = tuple(dist.get_process_group_ranks(mesh.get_group("dp")))
            sg = s.subgroups[dp_ranks]
            assert s.group_roles[sg.intra_name] == s.group_roles[sg.inter_name] == "dp"
            reset()
    world_intra = [[0, 1, 2, 3], [4, 5, 6, 7]]
    world_inter = [[0, 4], [1, 5], [2, 6], [3, 7]]
    dp_intra = [[0, 2], [4, 6], [1, 3], [5, 7]]  # dp inter blocks ({0,4}, ...) are the world's: reused
    assert seqs[0] == seqs[5] == world_intra + world_inter + dp_intra
    s0, s5 = sessions[0], sessions[5]
    assert sorted(s0.subgroups) == [(0, 1, 2, 3, 4, 5, 6, 7), (0, 2, 4, 6)]
    assert sorted(s5.subgroups) == [(0, 1, 2, 3, 4, 5, 6, 7), (1, 3, 5, 7)]
    assert (s5.subgroups[tuple(range(8))].intra, s5.subgroups[tuple(range(8))].inter) == (
        (4, 5, 6, 7),
        (1, 5),
    )
    # the world's aliases are the same names on every rank; each alias stands for its partition
    assert (
        s0.subgroups[tuple(range(8))].intra_name
        == s5.subgroups[tuple(range(8))].intra_name
        == "commfuse.intra.0:8"
    )
    assert s0.reference_groups()["commfuse.intra.0:8"] == world_intra
    assert s0.reference_groups()[subgroup_names((0, 2, 4, 6))[0]] == dp_intra
    assert s0.reference_groups()[subgroup_names((1, 3, 5, 7))[1]] == [[0, 4], [2, 6], [1, 5], [3, 7]]


def test_setup_rejects_bad_groups_by_field():
    with fake_process_group(4):
        with pytest.raises(commfuse.ConfigError, match="groups:"):
            commfuse.setup(topology=TOPO_2x2, groups=[[[0, 9]]])
        with pytest.raises(commfuse.ConfigError, match="groups:"):
            commfuse.setup(topology=TOPO_2x2, groups=["ab"])


# ---------------------------------------------------------------- sequences
def _trace(fn, *shapes):
    return make_fx(fn, tracing_mode="fake")(*[torch.randn(s) for s in shapes])


def _ag(dim):
    return lambda x: funcol.all_gather_tensor(x, dim, dist.group.WORLD) * 2


def _rs(dim, op="sum"):
    return lambda x: funcol.reduce_scatter_tensor(x, op, dim, dist.group.WORLD) + 1


def _ar(op="sum"):
    return lambda x: funcol.all_reduce(x, op, dist.group.WORLD) - 1


def _apply(gm, topo, order):
    ctx = PassContext(
        gm, commfuse.Config(topology=topo), topology=topo, session=commfuse.session.current_session()
    )
    (c,) = ctx.ir.collectives
    code = gm.code
    plan = plan_group_partition(ctx, c, order=order)
    assert isinstance(plan, GroupPlan), plan
    assert gm.code == code  # planning is pure
    starts = apply_group_partition(ctx, c, plan)
    gm.graph.lint()
    gm.recompile()
    return plan, starts


def _rewritten_on_the_last_rank(fn, shape, world, order):
    """Set up sub-groups, trace ``fn`` and apply ``order``'s plan to its one collective, in the
    fake world already entered as its last rank; returns the session, the graph before and after,
    the plan, the new starts and the (intra, inter) aliases."""
    topo = _topo(world)
    s = commfuse.setup(topology=topo)
    gm = _trace(fn, shape)
    before = _copy(gm)
    plan, starts = _apply(gm, topo, order)
    assert verify_graph(gm).ok, verify_graph(gm).problems
    return s, gm, before, plan, starts, subgroup_names(tuple(range(world)))


# (kind, order) -> the collectives in graph order (kind, level) and whether a block reorder appears
SEQUENCES = {
    ("ag", "inter_first"): ([("all_gather_into_tensor", "inter"), ("all_gather_into_tensor", "intra")], True),
    ("ag", "intra_first"): (
        [("all_gather_into_tensor", "intra"), ("all_gather_into_tensor", "inter")],
        False,
    ),
    ("rs", "intra_first"): ([("reduce_scatter_tensor", "intra"), ("reduce_scatter_tensor", "inter")], True),
    ("rs", "inter_first"): ([("reduce_scatter_tensor", "inter"), ("reduce_scatter_tensor", "intra")], False),
    ("ar", "intra_first"): (
        [("reduce_scatter_tensor", "intra"), ("all_reduce", "inter"), ("all_gather_into_tensor", "intra")],
        False,
    ),
    ("ar", "inter_first"): (
        [("reduce_scatter_tensor", "inter"), ("all_reduce", "intra"), ("all_gather_into_tensor", "inter")],
        False,
    ),
}


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("kind,order", list(SEQUENCES))
@pytest.mark.parametrize("dim", [0, 1])
def test_sequence_text_and_exact_values(world, kind, order, dim):
    fn, shape = {
        "ag": (_ag(dim), (2, 3, 4)),
        "rs": (_rs(dim), (world * 2, world, 3)),
        "ar": (_ar(), (world, 2, 3)),
    }[kind]
    if kind == "ar" and dim == 1:
        fn, shape = _ar(), (3, 4, 5)  # dim 0 not divisible: the split moves to dim 1
    with fake_process_group(world, rank=world - 1):
        s, gm, before, plan, starts, (intra, inter) = _rewritten_on_the_last_rank(fn, shape, world, order)
        seq, reorder = SEQUENCES[(kind, order)]
        assert [(n.target.__name__.split(".")[0], n.args[-1]) for n in starts] == [
            (op, intra if lvl == "intra" else inter) for op, lvl in seq
        ]
        assert plan.dim == (dim if kind != "ar" else (0 if shape[0] % 2 == 0 else 1))
        fc = FileCheck()
        if kind == "rs" and reorder:
            fc.check("transpose")  # blocks pre-permuted before the first reduce_scatter
        for op, lvl in seq:
            fc.check(f"{op}.default(").check(f"'{intra if lvl == 'intra' else inter}'")
        if kind == "ag" and reorder:
            fc.check("transpose")  # blocks (l', i') back to group-rank order
        fc.check_not("'0'").run(gm.code)  # nothing left on the flat group
        assert ("transpose" in gm.code) == reorder
        # the IR resolves the aliases to this rank's sub-groups (the last rank: node 1, local b-1)
        b = world // 2
        assert {c.group.ranks for c in CollectiveIR(gm).collectives} == {
            tuple(range(b, world)),
            (b - 1, world - 1),
        }
        check_equivalent(before, gm, world, groups=_groups(s), exact=True, inputs=_ints(before, world))


A2A_SEQUENCES = {  # order -> the levels in graph order, and the block reorders (transposes) around them
    "intra_first": (["intra", "inter"], 2),
    "inter_first": (["inter", "intra"], 2),
}


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("order", list(A2A_SEQUENCES))
@pytest.mark.parametrize("split_dim", [0, 1])
def test_all_to_all_two_level_exchange_text_bytes_and_exact_values(world, order, split_dim):
    """Each level exchanges the whole buffer (the bytes per level derived in the module docstring);
    the received blocks come out in group-rank order, bitwise."""

    def fn(x):
        g = dist.group.WORLD
        if split_dim == 0:
            return funcol.all_to_all_single(x, None, None, g) * 2
        # DTensor's Shard(1) -> Shard(0) form: dim-1 chunks, exchanged along dim 0
        return (
            funcol.all_to_all_single(torch.cat(torch.chunk(x, world, 1), 0).contiguous(), None, None, g) * 2
        )

    shape = (world * 2, 3) if split_dim == 0 else (2, world * 3)
    with fake_process_group(world, rank=world - 1):
        s, gm, before, plan, starts, (intra, inter) = _rewritten_on_the_last_rank(fn, shape, world, order)
        levels, transposes = A2A_SEQUENCES[order]
        assert [(n.target.__name__.split(".")[0], n.args[-1]) for n in starts] == [
            ("all_to_all_single", intra if lvl == "intra" else inter) for lvl in levels
        ]
        assert gm.code.count("aten.transpose") == transposes
        nbytes = math.prod(shape) * 4
        assert [lv.message_bytes for lv in plan.levels] == [nbytes, nbytes]
        assert [lv.size for lv in plan.levels] == [world // 2 if lvl == "intra" else 2 for lvl in levels]
        FileCheck().check_not("'0'").run(gm.code)  # nothing left on the flat group
        check_equivalent(before, gm, world, groups=_groups(s), exact=True, inputs=_ints(before, world))


def test_all_to_all_is_partitioned_by_the_pass_where_latency_dominates():
    with fake_process_group(8):
        commfuse.setup(topology=TOPO_2x4)
        gm = _trace(lambda x: funcol.all_to_all_single(x, None, None, dist.group.WORLD) + 1, (16, 2))
        rec = _run_pass(gm, TOPO_2x4)
        assert rec.changed and rec.counts["partitioned"] == 1, rec.refusals
        (d,) = rec.decisions
        assert d["kind"] == "all_to_all" and d["message_bytes"] == [128, 128]
        assert d["predicted_hierarchical_us"] < d["predicted_flat_us"]


@pytest.mark.parametrize("op", ["avg", "max"])
def test_reduce_ops_avg_and_max(op):
    with fake_process_group(8):
        s = commfuse.setup(topology=TOPO_2x4)
        for fn, shape in ((_rs(1, op), (2, 16)), (_ar(op), (8, 3))):
            gm = _trace(fn, shape)
            before = _copy(gm)
            rec = _run_pass(gm, TOPO_2x4)
            assert rec.counts["partitioned"] == 1, rec.refusals
            check_equivalent(before, gm, 8, groups=_groups(s), exact=True, inputs=_ints(before, 8))


def test_the_pass_on_a_graph_with_every_kind_and_a_chain():
    """Pass-chosen orders, a gather of a gathered tensor (the second rewrite must read the first's
    result), a view-form dim-1 gather (local dims before it are 1) and an all_to_all."""

    def f(x, y, z, u):
        g = dist.group.WORLD
        a = funcol.all_gather_tensor(funcol.all_gather_tensor(x, 0, g) * 3, 1, g)
        b = funcol.reduce_scatter_tensor(y, "sum", 0, g)
        c = funcol.all_reduce(z, "sum", g)
        v = funcol.all_gather_tensor(u, 1, g)
        e = funcol.all_to_all_single(y, None, None, g)
        return a, b, c, v, e

    with fake_process_group(4):
        s = commfuse.setup(topology=TOPO_2x2)
        gm = _trace(f, (2, 3), (8, 2), (4, 2), (1, 2, 3))
        before = _copy(gm)
        rec = _run_pass(gm, TOPO_2x2)
        assert rec.counts["partitioned"] == 6 and not rec.refusals, rec.refusals
        assert rec.counts["predicted_hierarchical_us"] < rec.counts["predicted_flat_us"]
        assert len(rec.decisions) == 6 and all(d["mesh"] == [2, 2] for d in rec.decisions)
        kinds = [(c.kind.value, c.group.name) for c in CollectiveIR(gm).collectives]
        assert not any(g == W for _, g in kinds)  # nothing stays flat
        assert len(kinds) == 2 * 2 + 2 + 3 + 2 + 2
        check_equivalent(before, gm, 4, groups=_groups(s), exact=True, inputs=_ints(before, 4))


def test_rewritten_graph_is_identical_on_every_rank():
    """Aliases named after the parent's ranks: ranks trace and rewrite the same text, so the
    cross-rank agreement check (which compares group names) sees equal sequences."""
    codes, hashes = set(), set()
    for rank in (0, 3, 6):
        with fake_process_group(8, rank=rank):
            commfuse.setup(topology=TOPO_2x4)
            gm = _trace(lambda x, y: (_ag(1)(x), _rs(0)(y)), (2, 3), (16, 2))
            rec = _run_pass(gm, TOPO_2x4)
            assert rec.counts["partitioned"] == 2
            codes.add(gm.code)
            hashes.add(verify_graph(gm).order_hash)
            reset()
    assert len(codes) == 1 and len(hashes) == 1


def test_strided_mesh_dim_group_uses_its_own_subgroups():
    """The dp dim of a (dp=4, tp=2) mesh on 2 nodes x 4: ranks {0,2,4,6} = 2 nodes x 2."""
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(8, rank=2):
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        s = commfuse.setup(topology=TOPO_2x4, mesh=mesh)
        dp = mesh.get_group("dp")
        gm = make_fx(lambda x: funcol.reduce_scatter_tensor(x, "avg", 0, dp) * 2, tracing_mode="fake")(
            torch.randn(8, 3)
        )
        before = _copy(gm)
        rec = _run_pass(gm, TOPO_2x4)
        assert rec.counts["partitioned"] == 1, rec.refusals
        intra, inter = subgroup_names((0, 2, 4, 6))
        assert {c.group.name: c.group.ranks for c in CollectiveIR(gm).collectives} == {
            intra: (0, 2),
            inter: (2, 6),
        }
        groups = {dp.group_name: [[0, 2, 4, 6], [1, 3, 5, 7]], **s.reference_groups()}
        check_equivalent(before, gm, 8, groups=groups, exact=True, inputs=_ints(before, 8))


# ---------------------------------------------------------------- refusals
def _refused(fn, shapes, world=4, topo=TOPO_2x2, setup=True, group=None, **cfg):
    with fake_process_group(world):
        if setup:
            commfuse.setup(topology=topo)
        gm = make_fx(fn(group() if group else dist.group.WORLD), tracing_mode="fake")(
            *[torch.randn(s) for s in shapes]
        )
        code = gm.code
        rec = _run_pass(gm, topo, **cfg)
        assert not rec.changed and gm.code == code
        return rec.refusals


@pytest.mark.parametrize(
    "case,expected",
    [
        ("intra_node", "group inside one node"),
        ("one_per_node", "one rank per node"),
        ("not_set_up", "sub-groups not set up"),
        ("not_divisible", "no dim of shape [3, 5] is divisible"),
        ("all_to_all", "all_to_all with unequal (or data-dependent) splits"),
        ("coalesced", "coalesced or in-place"),
        ("no_topology", "no topology"),
        ("product", "reduce op 'product'"),
        ("not_faster", "not faster"),
    ],
)
def test_refusals_leave_the_graph_and_say_why(case, expected):
    ag = lambda g: lambda x: funcol.all_gather_tensor(x, 0, g)  # noqa: E731
    kw: dict = {}
    fn, shapes = ag, [(2, 3)]
    if case == "intra_node":
        kw = dict(world=8, topo=TOPO_2x4, group=lambda: dist.new_group([0, 1, 2, 3]))
    elif case == "one_per_node":
        kw = dict(world=8, topo=TOPO_2x4, group=lambda: dist.new_group([0, 4]))
    elif case == "not_set_up":
        kw = dict(setup=False)
    elif case == "not_divisible":
        fn, shapes = (lambda g: lambda x: funcol.all_reduce(x, "sum", g)), [(3, 5)]
    elif case == "all_to_all":
        fn, shapes = (
            (lambda g: lambda x: funcol.all_to_all_single(x, [1, 1, 1, 1], [2, 1, 0, 1], g)),
            [(4, 2)],
        )
    elif case == "coalesced":
        fn, shapes = (
            (lambda g: lambda x, y: funcol.all_gather_into_tensor_coalesced([x, y], g)),
            [(2, 2), (2, 2)],
        )
    elif case == "no_topology":
        kw = dict(setup=False, topo=None)
    elif case == "product":
        fn, shapes = (lambda g: lambda x: funcol.all_reduce(x, "product", g)), [(4, 2)]
    elif case == "not_faster":
        kw = dict(topo=TOPO_SLOW_LAUNCH)
    refusals = _refused(fn, shapes, **kw)
    assert refusals and all(expected in r for r in refusals), refusals
    if case == "not_faster":  # both predictions are reported
        assert "predicted" in refusals[0] and "vs flat" in refusals[0]


def test_subgroups_for_another_layout_are_refused():
    """Sub-groups set up for 2 nodes x 2 do not make a group partitionable under a topology
    that puts the 4 ranks on one node: the pass checks ctx.topology, not the session alone."""
    with fake_process_group(4):
        commfuse.setup(topology=TOPO_2x2)
        gm = _trace(_ag(0), (2, 3))
        rec = _run_pass(gm, Topology(num_nodes=1, ranks_per_node=4))
        assert not rec.changed and "group inside one node" in rec.refusals[0]


def test_the_fuzz_target_is_registered_with_a_multi_node_topology():
    from commfuse.fuzz.targets import fuzz_target

    t = fuzz_target("group_partition")
    assert t.registered and t.topology is not None and t.topology.num_nodes == 2
    assert t.topology.ranks_per_node >= 2


# ---------------------------------------------------------------- 4 gloo ranks (2 nodes x 2)
@pytest.mark.multirank
def test_subgroups_created_once_identically_on_every_rank(rank_pool_4):
    res = rank_pool_4.run(setup_counts)
    expected = [[0, 1], [2, 3], [0, 2], [1, 3]]
    for r, out in enumerate(res):
        assert out["first"] == expected and out["second"] == [], (r, out)
        assert out["same_groups"]
        assert out["names"] == ("commfuse.intra.0:4", "commfuse.inter.0:4")
        assert out["intra"] == tuple(expected[r // 2]) and out["inter"] == (r % 2, r % 2 + 2)
        assert out["resolved"] == (out["intra"], out["inter"])


@pytest.mark.multirank
@pytest.mark.parametrize(
    "workload,expected",
    [
        (
            "fsdp",
            {"forward": 4, "backward": 4},
        ),  # all_gathers / gradient reduce_scatters of 2 weights + 2 biases
        ("dp", {"backward": 4}),  # gradient all_reduces of 2 weights + 2 biases
        ("tp", {"forward": 1, "backward": 1}),  # sequence all_gather (dim 1) and its reduce_scatter
        ("ep", {"forward": 2, "backward": 2}),  # dispatch and combine all_to_all, and their gradients
    ],
)
def test_training_matches_unoptimised_program_on_2_nodes_x_2(rank_pool_4, workload, expected):
    """Forward outputs, gradients and SGD-updated parameters equal eager's (fp32 policy, asserted
    in the job); no group created while compiling; the flat collectives are gone."""
    res = rank_pool_4.run(compiled_matches_eager, workload, timeout=240)
    for r, out in enumerate(res):
        assert out["created"] == [[0, 1], [2, 3], [0, 2], [1, 3]], (r, out["created"])
        assert out["counts"]["joint"]["partitioned"] == sum(expected.values()), (
            r,
            out["counts"],
            out["refusals"],
        )
        for graph, n in expected.items():
            kinds = out["kinds"][graph]
            assert not any(k.endswith("@" + out["world"]) for k in kinds), kinds  # nothing flat left
            assert sum("@commfuse." in k for k in kinds) >= 2 * n, kinds
        if workload == "tp":  # DTensor's dim-1 shuffles: the sequence runs along the sequence dim
            assert out["dims"] == [("all_gather", 1), ("reduce_scatter", 1)], out["dims"]
    assert len({str(o["kinds"]) for o in res}) == 1  # every rank issues the same sequence, same names
