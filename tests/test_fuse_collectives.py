"""fuse_collectives: every row of the fusion table proven numerically on random shapes and
dims (reference interpreter, world sizes 2 and 4, fp32 and bf16), and every refusal."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.testing.equivalence import check_equivalent
from commfuse.testing.fake_pg import fake_process_group
from commfuse.testing.graphs import _copy

c10d = torch.ops._c10d_functional
SEEDS = (0, 1, 2, 3, 4, 5)
WORLDS = (2, 4)


# -- building blocks (what DTensor / hand-written SP code traces to) ------------------------
def AG(x, d, g):
    return funcol.all_gather_single(x, d, g)


def RS(x, op, d, g):
    return funcol.reduce_scatter_single(x, op, d, g)


def A2A(x, s, c, g):
    """Equal-split all_to_all from split dim s to concat dim c: dim-0 collective + shuffles."""
    n = dist.get_world_size(g)
    if s != 0:
        x = torch.cat(torch.chunk(x, n, s), 0)
    out = funcol.all_to_all_single(x.contiguous(), None, None, g)
    if c != 0:
        out = torch.cat(torch.chunk(out, n, 0), c)
    return out


def _out_shape(kind, shape, n, dims):
    shape = list(shape)
    if kind == "ag":
        shape[dims[0]] *= n
    elif kind == "rs":
        shape[dims[0]] //= n
    else:
        s, c = dims
        shape[s] //= n
        shape[c] *= n
    return shape


def _apply(kind, x, dims, op, g):
    if kind == "ag":
        return AG(x, dims[0], g)
    if kind == "rs":
        return RS(x, op, dims[0], g)
    return A2A(x, dims[0], dims[1], g)


def _random_case(rng: random.Random, first: str, second: str, n: int):
    """A random input shape and dims for the pair, with exactly the divisibility the two
    collectives need (other dims get small sizes, often not divisible by n)."""
    rank = rng.choice((2, 3))
    ndims = {"ag": 1, "rs": 1, "a2a": 2}
    d1 = [rng.randrange(rank) for _ in range(ndims[first])]
    d2 = [rng.randrange(rank) for _ in range(ndims[second])]
    shape = [rng.choice((1, 2, 3)) for _ in range(rank)]
    if first in ("rs", "a2a"):
        shape[d1[0]] *= n
    mid = _out_shape(first, shape, n, d1)
    if second in ("rs", "a2a") and mid[d2[0]] % n:
        shape[d2[0]] *= n  # every output dim scales with the same input dim
    assert _out_shape(first, shape, n, d1)[d2[0]] % n == 0 or second == "ag"
    return shape, d1, d2


def _trace(fn, shapes, dtype=torch.float32):
    return make_fx(fn, tracing_mode="fake")(*[torch.randn(s, dtype=dtype) for s in shapes])


def _kinds(gm) -> Counter:
    return Counter(c.kind.value for c in CollectiveIR(gm).collectives)


def _run(gm, passes=("fuse_collectives",)):
    commfuse.optimize(gm, commfuse.Config(passes=list(passes), strict=True))
    return commfuse.last_report(gm).passes[-1]


# (first, second) -> count key and the collectives left (as a function of the dims)
EXPECTED = {
    ("rs", "ag"): ("fused_rs_ag", lambda d1, d2: {"all_reduce": 1}),
    ("ag", "rs"): ("fused_ag_rs", lambda d1, d2: {} if d1[0] == d2[0] else {"all_to_all": 1}),
    ("ag", "ag"): ("fused_ag_ag", lambda d1, d2: {"all_gather": 1}),
    ("ag", "a2a"): ("fused_ag_a2a", lambda d1, d2: {} if d2[0] == d1[0] else {"all_to_all": 1}),
    ("a2a", "a2a"): ("fused_a2a_a2a", lambda d1, d2: {} if d2[0] == d1[1] else {"all_to_all": 1}),
    ("rs", "a2a"): ("fused_rs_a2a", lambda d1, d2: {"reduce_scatter": 1}),
    ("a2a", "ag"): ("fused_a2a_ag", lambda d1, d2: {"all_gather": 1}),
    ("a2a", "rs"): ("fused_a2a_rs", lambda d1, d2: {} if d2[0] == d1[1] else {"all_to_all": 1}),
}
NAMES = {"ag": "all_gather", "rs": "reduce_scatter", "a2a": "all_to_all"}


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("pair", list(EXPECTED), ids=lambda p: "+".join(p))
def test_fusion_is_equivalent(pair, n):
    first, second = pair
    key, left = EXPECTED[pair]
    seen_dims = set()
    for seed in SEEDS:
        rng = random.Random(f"{first}+{second}:{n}:{seed}")
        shape, d1, d2 = _random_case(rng, first, second, n)
        ops = ["sum", "avg", "max", "min"] if (first, second) != ("ag", "rs") else ["sum", "avg", "max"]
        op1, op2 = rng.choice(ops), rng.choice(ops)
        dtype = torch.bfloat16 if seed in (2, 5) else torch.float32
        with fake_process_group(n):
            g = dist.group.WORLD

            def f(x):
                return _apply(second, _apply(first, x, d1, op1, g), d2, op2, g)  # noqa: B023 - traced in this iteration

            gm = _trace(f, [shape], dtype)
            before = _copy(gm)
            assert _kinds(before) == Counter({NAMES[first]: 1, NAMES[second]: 1}) or first == second
            rec = _run(gm)
        where = f"seed {seed}: x{shape} {first}{d1} + {second}{d2} ops {op1}/{op2}"
        assert rec.counts[key] == 1, (where, rec.counts, rec.refusals)
        assert sum(rec.counts.values()) == 1 and not rec.refusals, (where, rec.counts, rec.refusals)
        assert _kinds(gm) == Counter(left(d1, d2)), (where, gm.graph)
        check_equivalent(before, gm, n)
        seen_dims.add((tuple(d1), tuple(d2)))
    assert len(seen_dims) > 1  # the seeds exercise different dim combinations


# Every dim combination once for the rows with special cases (same/different dims,
# the N*N pre-permutation), at 4 ranks where chunk order mistakes cannot hide.
@pytest.mark.parametrize(
    "s1, c1, s2, c2",
    [(0, 1, 0, 1), (0, 1, 1, 0), (1, 0, 1, 1), (0, 0, 0, 1), (1, 1, 0, 0), (0, 1, 2, 0), (2, 2, 2, 1)],
)
def test_a2a_a2a_dims(s1, c1, s2, c2):
    n = 4
    shape = [2, 3, 1]
    shape[s1] *= n
    mid = _out_shape("a2a", shape, n, (s1, c1))
    if mid[s2] % n:
        shape[s2] *= n
    with fake_process_group(n):
        g = dist.group.WORLD
        gm = _trace(lambda x: A2A(A2A(x, s1, c1, g), s2, c2, g), [shape])
        before = _copy(gm)
        rec = _run(gm)
    assert rec.counts["fused_a2a_a2a"] == 1, rec.refusals
    assert sum(_kinds(gm).values()) == (0 if s2 == c1 else 1)
    check_equivalent(before, gm, n)


@pytest.mark.parametrize("dr, s, c", [(0, 0, 1), (1, 1, 0), (0, 1, 0), (1, 0, 1), (0, 0, 0)])
def test_rs_a2a_dims(dr, s, c):
    n = 4
    shape = [3, 2]
    shape[dr] *= n
    if _out_shape("rs", shape, n, (dr,))[s] % n:
        shape[s] *= n
    with fake_process_group(n):
        g = dist.group.WORLD
        gm = _trace(lambda x: A2A(RS(x, "sum", dr, g), s, c, g), [shape])
        before = _copy(gm)
        rec = _run(gm)
    assert rec.counts["fused_rs_a2a"] == 1, rec.refusals
    assert _kinds(gm) == Counter({"reduce_scatter": 1})
    check_equivalent(before, gm, n)


def test_fused_results_fuse_again_and_views_are_seen_through():
    """AG_0 + RS_1(avg) -> A2A_{1->0}, which then fuses with the next A2A; the pair is
    adjacent through a same-shape view and a clone."""
    n = 4
    with fake_process_group(n):
        g = dist.group.WORLD

        def f(x):
            y = RS(AG(x, 0, g), "avg", 1, g)
            y = y.view(y.shape).clone()
            return A2A(y, 2, 1, g) * 2

        gm = _trace(f, [(2, 8, 4)])
        before = _copy(gm)
        rec = _run(gm)
    assert rec.counts["fused_ag_rs"] == 1 and rec.counts["fused_a2a_a2a"] == 1, (rec.counts, rec.refusals)
    assert _kinds(gm) == Counter({"all_to_all": 1})
    check_equivalent(before, gm, n)


def test_split_then_fuse_restores_the_all_reduce():
    n = 2
    with fake_process_group(n):
        g = dist.group.WORLD
        gm = _trace(lambda x: funcol.all_reduce(x, "sum", g) + 1, [(4, 6)])
        before = _copy(gm)
        commfuse.optimize(gm, commfuse.Config(passes=["split_all_reduce", "fuse_collectives"], strict=True))
        rec = commfuse.last_report(gm).passes[-1]
    assert rec.counts["fused_rs_ag"] == 1
    assert _kinds(gm) == Counter({"all_reduce": 1})
    check_equivalent(before, gm, n)


def test_input_mutated_after_the_first_collective():
    """The fused form reads the input where the first collective did."""
    n = 2
    with fake_process_group(n):
        g = dist.group.WORLD

        def f(x):
            y = AG(x, 1, g)
            x.mul_(3)
            return RS(y, "sum", 0, g), x

        gm = _trace(f, [(4, 3)])
        before = _copy(gm)
        rec = _run(gm)
    assert rec.counts["fused_ag_rs"] == 1, rec.refusals
    check_equivalent(before, gm, n)


# -- refusals -----------------------------------------------------------------------------
def _refused(gm, needle):
    before_kinds = _kinds(gm)
    before_code = gm.code
    rec = _run(gm)
    assert not any(rec.counts.values()), rec.counts
    assert gm.code == before_code and _kinds(gm) == before_kinds
    assert any(": not fused: " in r and needle in r for r in rec.refusals), rec.refusals
    return rec


def _groups_of(gm) -> list[str]:
    return [c.group.name for c in CollectiveIR(gm).collectives]


@pytest.mark.parametrize("second_on_world", [False, True], ids=["new_group", "world"])
def test_fuses_groups_with_the_same_ranks_under_other_names(second_on_world):
    """Two groups of the same ranks in the same order (torchtitan's EP group beside TP) are
    one group: the pair fuses, issued on the first collective's group."""
    n = 4
    with fake_process_group(n):
        g1 = dist.new_group([0, 1, 2, 3])
        g2 = dist.group.WORLD if second_on_world else dist.new_group([0, 1, 2, 3])
        assert g1.group_name != g2.group_name
        gm = _trace(lambda x: RS(AG(x, 0, g1), "sum", 1, g2), [(2, 8)])
        before = _copy(gm)
        rec = _run(gm)
        names = {g1.group_name: list(range(n)), g2.group_name: list(range(n))}
    assert rec.counts["fused_ag_rs"] == 1, rec.refusals
    assert _kinds(gm) == Counter({"all_to_all": 1})
    assert _groups_of(gm) == [g1.group_name]
    check_equivalent(before, gm, n, groups=names)


def test_fuses_subgroups_of_a_split_world_with_the_same_blocks():
    """Two partitions into the same blocks: on every rank both groups are its own block, in
    the same order, so the pair fuses (on every block at once)."""
    n = 4
    with fake_process_group(n):
        # Rank 0 sees only its own block of each partition: two different group names.
        sub_a = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])[0]
        sub_b = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])[0]
        assert sub_a.group_name != sub_b.group_name
        gm = _trace(lambda x: AG(AG(x, 0, sub_a), 1, sub_b), [(2, 3)])
        before = _copy(gm)
        rec = _run(gm)
        blocks = {sub_a.group_name: [[0, 1], [2, 3]], sub_b.group_name: [[0, 1], [2, 3]]}
    assert rec.counts["fused_ag_ag"] == 1, rec.refusals
    assert _kinds(gm) == Counter({"all_gather": 1})
    assert _groups_of(gm) == [sub_a.group_name]
    check_equivalent(before, gm, n, groups=blocks)


def test_refuses_the_same_ranks_in_another_order():
    """Group-rank order decides which chunk each rank gets: [0,1,2,3] and [1,0,2,3] differ."""
    with fake_process_group(4):
        g1 = dist.new_group([0, 1, 2, 3])
        g2 = dist.new_group([1, 0, 2, 3], sort_ranks=False)
        assert dist.get_process_group_ranks(g2) == [1, 0, 2, 3]
        gm = _trace(lambda x: RS(AG(x, 0, g1), "sum", 1, g2), [(2, 8)])
        rec = _refused(gm, "groups differ in members")
    (r,) = rec.refusals
    assert r.split(": not fused: ")[0].count("+") == 1
    assert f"group {g1.group_name} (size 4, ranks [0,1,2,3])" in r, r
    assert f"group {g2.group_name} (size 4, ranks [1,0,2,3])" in r, r


def test_refuses_different_groups_of_unknown_ranks():
    """Names no live process group has: ranks unknown, so only equal names would do."""
    with fake_process_group(4):

        def f(x):
            y = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 4, "elsewhere_a"))
            return c10d.wait_tensor(c10d.all_gather_into_tensor(y, 4, "elsewhere_b"))

        gm = _trace(f, [(2, 3)])
        assert [c.group.ranks for c in CollectiveIR(gm).collectives] == [None, None]
        rec = _refused(
            gm,
            "groups differ (names 'elsewhere_a' vs 'elsewhere_b'; "
            "ranks of 'elsewhere_a' and 'elsewhere_b' unknown)",
        )
    assert len(rec.refusals) == 1


def test_refuses_intermediate_with_other_users():
    with fake_process_group(2):
        g = dist.group.WORLD

        def f(x):
            y = AG(x, 0, g)
            return RS(y, "sum", 1, g), y.sum()

        gm = _trace(f, [(2, 4)])
        _refused(gm, "intermediate value has other users")


def test_refuses_unequal_all_to_all_splits():
    with fake_process_group(2):
        g = dist.group.WORLD

        def f(x):
            y = funcol.all_to_all_single(x, [1, 3], [1, 3], g)
            return funcol.all_to_all_single(y, None, None, g)

        gm = _trace(f, [(4, 3)])
        _refused(gm, "unequal")


def test_refuses_non_divisible_dims():
    """A dim-1 gather then a raw dim-0 reduce_scatter of a dim the group size does not divide."""
    with fake_process_group(2):

        def f(x):
            y = AG(x, 1, dist.group.WORLD)
            return c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", 2, "0"))

        gm = _trace(f, [(3, 4)])
        _refused(gm, "not divisible")


def test_refuses_pairs_not_in_the_table_and_coalesced():
    with fake_process_group(2):
        g = dist.group.WORLD

        def f(x):
            a = funcol.all_reduce(funcol.all_reduce(x, "sum", g), "sum", g)
            b = RS(RS(x, "sum", 0, g), "sum", 0, g)
            c = funcol.all_gather_single_coalesced([x, x], g)
            return a, b, AG(c[0], 1, g), c[1]

        gm = _trace(f, [(4, 4)])
        rec = _refused(gm, "not in the fusion table (all_reduce + all_reduce)")
    assert any("not in the fusion table (reduce_scatter + reduce_scatter)" in r for r in rec.refusals)
    assert any("is coalesced" in r for r in rec.refusals), rec.refusals


# -- real gloo ranks ----------------------------------------------------------------------
@pytest.mark.slow(reason="trains on real gloo ranks against eager, the joint graph compiled per rank")
@pytest.mark.multirank
def test_same_members_under_two_names_train_like_unfused_on_2_ranks(rank_pool_2):
    """A pair on two groups of the same ranks fuses (forward and backward) and outputs,
    gradients and parameters match the eager, unfused program."""
    import _jobs_fuse_collectives as jobs

    results = rank_pool_2.run(jobs.same_members_fuse_like_unfused, timeout=300)
    got = results[0]
    assert all(r["graphs"] == got["graphs"] for r in results), results  # every rank decided the same
    (joint,) = got["graphs"].values()
    # forward AG_0 (first group) + RS_1 (second); backward AG_1 (second) + RS_0 (first)
    assert joint["counts"] == {"fused_ag_rs": 2}, joint
    assert not joint["refusals"], joint
