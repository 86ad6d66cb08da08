"""fuse_collectives across groups: an adjacent pair on the two dims of a 2-D mesh (Chimera's
TP+EP / SP+EP transitions, N1 != N2 included) becomes one many-to-many scatter on the group that
spans the plane; proven on every rank with the reference interpreter, bytes checked against
Chimera's Table 2, refusals named, and a 2 x 2 gloo run trained against eager."""

from __future__ import annotations

from collections import Counter

import contextlib

import pytest
import torch.distributed as dist

import commfuse
from commfuse import session
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.testing.equivalence import check_equivalent
from commfuse.testing.fake_pg import fake_process_group
from commfuse.testing.graphs import _copy

from test_fuse_collectives import A2A, AG, RS, _kinds, _trace

FLOAT = 4


def _mesh(n1: int, n2: int):
    """Rank k*n2 + i sits at position k of its A-block (a column) and i of its B-block (a row)."""
    rows = [[k * n2 + i for i in range(n2)] for k in range(n1)]
    a_blocks = [[rows[k][i] for k in range(n1)] for i in range(n2)]
    return a_blocks, rows


def _wire(gm) -> int:
    return sum(c.wire_bytes for c in CollectiveIR(gm).collectives)


@contextlib.contextmanager
def _declared_mesh(a_blocks, b_blocks, *, declare=True):
    """A fake world of every rank in the blocks; this rank's group of each partition, with both
    partitions declared to commfuse (``commfuse.setup(groups=...)``) unless ``declare`` is off."""
    with fake_process_group(sum(len(b) for b in a_blocks)):
        ga = dist.new_subgroups_by_enumeration(a_blocks)[0]
        gb = dist.new_subgroups_by_enumeration(b_blocks)[0]
        if declare:
            session.setup(groups=[a_blocks, b_blocks])
        try:
            yield ga, gb
        finally:
            session.reset()


def _fuse_in(gm, passes=("fuse_collectives",)):
    commfuse.optimize(gm, commfuse.Config(passes=list(passes), strict=True))
    return commfuse.last_report(gm).passes[-1]


def _fuse(n1, n2, build, shape, *, declare=True, world_group=True):
    """Trace ``build(ga, gb)`` on a fake world of n1*n2 ranks (groups: the mesh's two dims),
    run fuse_collectives with the mesh declared, check every rank against the unfused graph."""
    a_blocks, b_blocks = _mesh(n1, n2)
    n = n1 * n2
    with _declared_mesh(a_blocks, b_blocks, declare=declare) as (ga, gb):
        gm = _trace(build(ga, gb), [shape])
        before = _copy(gm)
        rec = _fuse_in(gm)
        groups = {
            ga.group_name: a_blocks,
            gb.group_name: b_blocks,
            dist.group.WORLD.group_name: [list(range(n))],
        }
        if any(rec.counts.values()):
            check_equivalent(before, gm, n, groups=groups)
        wire = (_wire(before), _wire(gm))  # the groups resolve inside the fake world only
    return wire, gm, rec


def _ag_a2a(ga, gb):
    return lambda x: A2A(AG(x, 1, ga), 0, 2, gb)


def _a2a_rs(ga, gb):
    return lambda x: RS(A2A(x, 0, 1, gb), "sum", 2, ga)


@pytest.mark.parametrize("n1, n2", [(2, 2), (4, 2), (2, 4)], ids=lambda v: str(v))
def test_gather_then_exchange_on_two_mesh_dims_is_one_scatter(n1, n2):
    """AG over A (N1 ranks) + A2A over B (N2 ranks) -> one m2ms on the world; every rank's
    values unchanged. Bytes per rank: (N1-1)|x| + N1|x|(N2-1)/N2 before, (N1*N2-1)|x|/N2 after
    (each rank sends its 1/N2 pieces once per receiver): 75% at [2, 2], 70% at [4, 2] and
    [2, 4], inside Table 2's 66.7-100% for TP+EP."""
    shape = (2 * n2, 3, 2)
    (before, after), gm, rec = _fuse(n1, n2, _ag_a2a, shape)
    assert rec.counts["m2ms_ag_a2a"] == 1 and not rec.refusals, (rec.counts, rec.refusals)
    assert _kinds(gm) == Counter({"many_to_many_scatter": 1})
    x = FLOAT * 2 * n2 * 3 * 2
    assert before == (n1 - 1) * x + n1 * x * (n2 - 1) // n2
    assert after == (n1 * n2 - 1) * x // n2
    assert 2 / 3 <= after / before < 1


@pytest.mark.parametrize("n1, n2", [(2, 2), (4, 2), (2, 4)], ids=lambda v: str(v))
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_exchange_then_scatter_on_two_mesh_dims_is_one_scatter(n1, n2, op):
    """The backward's pair: A2A over B + RS over A -> one m2ms and a local reduction."""
    shape = (2 * n2, 3, 2 * n1)
    (before, after), gm, rec = _fuse(n1, n2, lambda ga, gb: lambda x: RS(A2A(x, 0, 1, gb), op, 2, ga), shape)
    assert rec.counts["m2ms_a2a_rs"] == 1 and not rec.refusals, (rec.counts, rec.refusals)
    assert _kinds(gm) == Counter({"many_to_many_scatter": 1})
    w = FLOAT * 2 * n2 * 3 * 2 * n1
    assert before == w * (n2 - 1) // n2 + w * (n1 - 1) // n1
    assert after == (n1 * n2 - 1) * w // (n1 * n2)


def test_pairs_on_two_mesh_dims_are_refused_with_the_reason():
    # the other ranks' blocks unknown: no decision that every rank would share
    _, gm, rec = _fuse(2, 2, _ag_a2a, (4, 3, 2), declare=False)
    assert not any(rec.counts.values()) and _kinds(gm) == Counter({"all_gather": 1, "all_to_all": 1})
    assert any("on the other ranks are unknown" in r for r in rec.refusals), rec.refusals
    # the exchange splits the gathered dim: each rank's pieces would differ
    _, gm, rec = _fuse(2, 2, lambda ga, gb: lambda x: A2A(AG(x, 1, ga), 1, 0, gb), (2, 4, 2))
    assert not any(rec.counts.values())
    assert any("splits the gathered dim" in r for r in rec.refusals), rec.refusals
    # a pair with no fused form across groups (all_gather + reduce_scatter)
    _, gm, rec = _fuse(2, 2, lambda ga, gb: lambda x: RS(AG(x, 1, ga), "sum", 0, gb), (2, 4, 2))
    assert any("no fused form across groups" in r for r in rec.refusals), rec.refusals


def test_a_plane_without_a_process_group_is_refused():
    """On 8 ranks as 2 x 2 x 2, the plane of two dims is half the world: no group spans it
    unless one was created before compiling."""
    n = 8
    a_blocks = [[0, 2], [1, 3], [4, 6], [5, 7]]
    b_blocks = [[0, 1], [2, 3], [4, 5], [6, 7]]
    with _declared_mesh(a_blocks, b_blocks) as (ga, gb):
        gm = _trace(_ag_a2a(ga, gb), [(4, 3, 2)])
        rec = _fuse_in(gm)
        assert not any(rec.counts.values())
        assert any("no process group spans their plane (ranks 0,1,2,3)" in r for r in rec.refusals), (
            rec.refusals
        )
        planes = dist.new_subgroups_by_enumeration([[0, 1, 2, 3], [4, 5, 6, 7]])[0]
        gm = _trace(_ag_a2a(ga, gb), [(4, 3, 2)])
        before = _copy(gm)
        rec = _fuse_in(gm)
        assert rec.counts["m2ms_ag_a2a"] == 1, rec.refusals
        assert [c.group.name for c in CollectiveIR(gm).collectives] == [planes.group_name]
        check_equivalent(
            before,
            gm,
            n,
            groups={
                ga.group_name: a_blocks,
                gb.group_name: b_blocks,
                planes.group_name: [[0, 1, 2, 3], [4, 5, 6, 7]],
            },
        )


@pytest.mark.multirank
@pytest.mark.parametrize("declared_by", ["setup", "dtensor"])
def test_tp_to_ep_transition_trains_like_eager_on_a_2x2_mesh(rank_pool_4, declared_by):
    """4 gloo ranks, mesh ep x tp = 2 x 2, known from commfuse.setup(mesh=) or only from a DTensor
    weight on the mesh's tp slice: the default backend fuses the forward's AG(tp) + A2A(ep) and
    the backward's A2A(ep) + RS(tp) into many-to-many scatters; loss, gradients and parameters
    equal eager's; every rank decided the same."""
    import _jobs_fuse_across_groups as jobs

    results = rank_pool_4.run(jobs.tp_to_ep_trains_like_eager, declared_by, timeout=300)
    graphs = results[0]["graphs"]
    assert all(r["graphs"] == graphs for r in results), results
    assert graphs["joint"]["counts"] == {"m2ms_ag_a2a": 1, "m2ms_a2a_rs": 1}, (graphs, results[0]["refusals"])
    assert graphs["forward"]["kinds"] == graphs["backward"]["kinds"] == ["many_to_many_scatter"], graphs
    # bytes each rank sent, as the runtime recorder counted them: forward x [4, 6, 8] fp32 (768 B):
    # 3 of 4 pieces of 384 B; backward gradient [4, 12, 8] (1536 B): 3 of 4 pieces of 384 B.
    # Unfused: all_gather 768 + all_to_all 768, and the same again backward (3072 B).
    x, w = 4 * 6 * 8 * 4, 4 * 12 * 8 * 4
    for r in results:
        assert r["recorded_sent"] == {"many_to_many_scatter": 3 * x // 2 + 3 * w // 4}, r["recorded_sent"]
    assert 3 * x // 2 + 3 * w // 4 == 0.75 * (x + x + w // 2 + w // 2)


def test_the_fused_scatter_keeps_the_graph_the_same_on_every_rank():
    """Every rank sends every rank equal pieces: one graph serves all ranks, so the passes that
    decide from costs (bucketing, the partition search) still run on it; a scatter with unequal
    pieces gives each rank its own graph and keeps them off."""
    from commfuse.analysis.rank_local import rank_local_reason
    from commfuse.ops import m2ms

    with _declared_mesh(*_mesh(2, 2)) as (ga, gb):
        gm = _trace(_ag_a2a(ga, gb), [(4, 3, 2)])
        _fuse_in(gm)
        ir = CollectiveIR(gm)
        assert [c.kind.value for c in ir.collectives] == ["many_to_many_scatter"]
        assert rank_local_reason(ir.collectives, gm) is None
        world = dist.group.WORLD
        uneven = _trace(lambda x: m2ms(x, 0, [[1, 2, 1, 0]] * 4, [0, 1, 2, 3], [0, 1, 2, 3], world), [(4, 3)])
        assert "ranks may run different graphs" in rank_local_reason(CollectiveIR(uneven).collectives, uneven)


def test_tensor_parallel_all_reduce_then_exchange_becomes_reduce_scatter_and_one_scatter():
    """Table 2's TP+EP row: the TP all_reduce before the expert exchange. Chimera splits it
    (reduce_scatter + all_gather) and fuses the gather with the exchange on the other mesh dim:
    reduce_scatter on tp + one many-to-many scatter, every rank's values unchanged."""
    import torch.distributed._functional_collectives as funcol

    n1, n2 = 2, 2
    a_blocks, b_blocks = _mesh(n1, n2)
    with _declared_mesh(a_blocks, b_blocks) as (ga, gb):
        gm = _trace(lambda x: A2A(funcol.all_reduce(x, "sum", ga), 1, 2, gb), [(4, 4, 2)])
        before = _copy(gm)
        _fuse_in(gm, passes=("chimera",))
        kinds = _kinds(gm)
        wire = (_wire(before), _wire(gm))
        check_equivalent(
            before,
            gm,
            n1 * n2,
            groups={
                ga.group_name: a_blocks,
                gb.group_name: b_blocks,
                dist.group.WORLD.group_name: [list(range(n1 * n2))],
            },
        )
    assert kinds == Counter({"reduce_scatter": 1, "many_to_many_scatter": 1}), kinds
    x = 4 * 4 * 4 * 2  # bytes of one rank's input
    # all_reduce 2(N1-1)/N1 |x| + all_to_all (N2-1)/N2 |x|  ->  reduce_scatter (N1-1)/N1 |x| + the m2ms of
    # the shard y = x/N1: (N1 N2 - 1)|y|/N2. 83% of the pair's bytes, inside Table 2's 66.7-100% for TP+EP
    # (Table 2's 67% "real demand" leaves the exchange's output sharded over TP; here every TP rank gets
    # the tokens the unfused program gave it).
    assert wire == (x + x // 2, x // 2 + 3 * (x // n1) // n2), wire


@pytest.mark.parametrize("n1, n2", [(2, 2), (4, 2), (2, 4)], ids=lambda v: str(v))
@pytest.mark.parametrize("dims", [(1, 2), (1, 1)], ids=["other_dim", "same_dim"])
def test_two_gathers_or_two_scatters_on_two_mesh_dims_are_one_collective_on_the_plane(n1, n2, dims):
    """AG on A + AG on B -> one all_gather on the plane's group; RS on A + RS on B (one reduce op)
    -> one reduce_scatter on it. The same bytes per rank, one collective instead of two."""
    d1, d2 = dims
    (before, after), gm, rec = _fuse(n1, n2, lambda ga, gb: lambda x: AG(AG(x, d1, ga), d2, gb), (2, 3, 2))
    assert rec.counts["plane_ag_ag"] == 1 and _kinds(gm) == Counter({"all_gather": 1}), rec.refusals
    assert before == after
    shape = (2, 2 * n1 * n2, 2 * n2)
    for op in ("sum", "avg", "max"):
        (before, after), gm, rec = _fuse(
            n1, n2, lambda ga, gb, op=op: lambda x: RS(RS(x, op, d1, ga), op, d2, gb), shape
        )
        assert rec.counts["plane_rs_rs"] == 1 and _kinds(gm) == Counter({"reduce_scatter": 1}), rec.refusals
        assert before == after
    _, gm, rec = _fuse(n1, n2, lambda ga, gb: lambda x: RS(RS(x, "sum", d1, ga), "max", d2, gb), shape)
    assert any("are not one reduction" in r for r in rec.refusals), rec.refusals
