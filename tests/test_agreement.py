"""Cross-rank agreement: disagreement is an error within the timeout, never a hang."""

from __future__ import annotations

import os

import pytest

from commfuse.agreement import first_difference, first_group_disagreement

from _multirank_jobs import (
    agreement_on_a_2x2_mesh,
    agreement_on_a_dropless_moe,
    agreement_on_two_pipeline_stages,
    inductor_cache_hit_on_rank0_only,
    planted_disagreement,
    simulated_cache_hit_rank1,
)


def test_first_difference_names_the_collective():
    a = {"forward": [["all_reduce", "0", "sum", "float32", ["[4]"]], ["all_gather", "0", None, "float32", ["[2]"]]]}
    b = {"forward": [["all_gather", "0", None, "float32", ["[2]"]], ["all_reduce", "0", "sum", "float32", ["[4]"]]]}
    msg = first_difference(a, b).format(A="rank 0", B="rank 1")
    assert msg == ("forward graph, collective #0: rank 0 issues all_reduce(group 0, float32, in [4], sum) "
                   "but rank 1 issues all_gather(group 0, float32, in [2])")
    assert first_difference(a, a) is None
    assert first_difference(a, {"backward": []}) is None  # graphs only one side compiled are not compared
    assert "no collective" in first_difference(a, {"forward": a["forward"][:1]})


@pytest.mark.slow(reason="compiles on 2 gloo ranks until the planted disagreement raises")
@pytest.mark.multirank
def test_planted_rank_disagreement_raises_instead_of_hanging(rank_pool_2):
    msgs = rank_pool_2.run(planted_disagreement, 30.0, timeout=120)
    for m in msgs:
        assert m.startswith("cross-rank collective disagreement"), m
        assert "collective #0: rank 0 issues all_reduce(group" in m and "rank 1 issues all_gather(group" in m


@pytest.mark.multirank
def test_rank_without_record_still_joins_the_exchange(rank_pool_2):
    outs = rank_pool_2.run(simulated_cache_hit_rank1, timeout=120)
    # all_reduce of 2*ones(4) over 2 ranks = 4 each -> 16; all_gather of 3*ones(2) -> 4 values of 3 -> 12
    assert outs == [28.0, 28.0]


def _set_inductor_cache_dir(path: str | None) -> None:
    """Rank job: point Inductor's cache at ``path`` again (None: its default)."""
    if path is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path


@pytest.mark.slow(reason="cold Inductor compiles on 2 gloo ranks, twice")
@pytest.mark.multirank
def test_inductor_cache_hit_on_one_rank_does_not_hang(rank_pool_2, tmp_path):
    # The job points each rank's Inductor cache at a directory of its own and leaves it there;
    # the pool does not restore the environment, so without this every later Inductor compile
    # on these ranks would miss the run's shared cache (tests/conftest.py), and the two ranks
    # would each compile every kernel instead of one compiling while the other waits for it.
    try:
        results = rank_pool_2.run(inductor_cache_hit_on_rank0_only, str(tmp_path), timeout=500)
    finally:
        rank_pool_2.run(_set_inductor_cache_dir, os.environ.get("TORCHINDUCTOR_CACHE_DIR"), timeout=60)
    r0, r1 = results
    assert r0[1]["out"] == r1[1]["out"] == r0[2]["out"] == r1[2]["out"] == 28.0
    assert r0[2]["hooks_ran"] == 0, "rank 0 should have hit its compile cache in round 2"
    assert r1[2]["hooks_ran"] > 0


# -- by group membership ------------------------------------------------------------------------
def _sig(kind, name, ranks, shape="[4]", dtype="float32", op=None):
    return [kind, name, op, dtype, [shape], ranks]


def _mesh_2x2(tp_kind_of_rank3="all_reduce"):
    """rank -> graphs of a TP x DP step on a 2 x 2 mesh; each TP and DP group has its own name."""
    tp = {0: ("1", [0, 1]), 1: ("1", [0, 1]), 2: ("2", [2, 3]), 3: ("2", [2, 3])}
    dp = {0: ("3", [0, 2]), 2: ("3", [0, 2]), 1: ("4", [1, 3]), 3: ("4", [1, 3])}
    out = {}
    for r in range(4):
        kind = tp_kind_of_rank3 if r == 3 else "all_reduce"
        out[r] = {"forward": [_sig(kind, *tp[r], op="sum" if kind == "all_reduce" else None),
                              _sig("all_reduce", *dp[r], op="sum")]}
    return out


def test_groups_are_compared_by_membership_not_by_name():
    assert first_group_disagreement(_mesh_2x2()) is None
    msg = first_group_disagreement(_mesh_2x2("all_gather"))
    assert msg == ("on the group of ranks [2, 3]: forward graph, collective #0: rank 2 issues "
                   "all_reduce(group 2, float32, in [4], sum) but rank 3 issues all_gather(group 2, float32, in [4])")


def test_what_may_differ_between_ranks():
    world = [0, 1, 2, 3]
    # pipeline stages: different graphs, the transfer on the shared world group agrees
    stages = {r: {"forward": ([_sig("all_reduce", "tp0", [0, 1], op="sum"), _sig("p2p", "0", world)] if r < 2 else
                              [_sig("p2p", "0", world), _sig("all_gather", "tp1", [2, 3])])} for r in range(4)}
    assert first_group_disagreement(stages) is None
    # a send pairs with its peer's receive
    assert first_group_disagreement({0: {"forward": [_sig("send", "0", [0, 1])]},
                                     1: {"forward": [_sig("recv", "0", [0, 1])]}}) is None
    # data-dependent sizes (a dropless MoE's all_to_all) compare without their sizes, not without their dtype
    a2a = {r: {"forward": [_sig("all_to_all", "0", world, shape=f"[u{r}, 16]")]} for r in range(4)}
    assert first_group_disagreement(a2a) is None
    a2a[2]["forward"][0][3] = "bfloat16"
    assert "rank 0 issues all_to_all(group 0, float32" in first_group_disagreement(a2a)
    # fixed sizes must agree
    fixed = {r: {"forward": [_sig("all_to_all", "0", world, shape=f"[{4 + (r == 1)}, 16]")]} for r in range(4)}
    assert "collective #0: rank 0 issues all_to_all(group 0, float32, in [4, 16])" in first_group_disagreement(fixed)
    # a member that compiled the graph but issues nothing on the group is a difference
    silent = _mesh_2x2()
    silent[1]["forward"] = silent[1]["forward"][1:]
    assert first_group_disagreement(silent).startswith("on the group of ranks [0, 1]: forward graph, collective #0")
    assert "rank 1 issues no collective" in first_group_disagreement(silent)
    # a graph one member took from a compile cache is not compared
    cached = _mesh_2x2("all_gather")
    cached[3] = {}
    assert first_group_disagreement(cached) is None


@pytest.mark.multirank
@pytest.mark.slow(reason="compiles four small programs on 4 gloo ranks with the agreement exchange")
def test_agreement_on_4_ranks_by_group_membership(rank_pool_4):
    ok = rank_pool_4.run(agreement_on_a_2x2_mesh, False, timeout=120)
    assert [r["error"] for r in ok] == [None] * 4, ok
    assert ok[0]["tp_group"] != ok[2]["tp_group"]  # the two TP groups are named differently
    # (x0*2 + x1*2 + 1) summed over the DP pair: ranks {0,1} -> 2+1 = 3, ranks {2,3} -> 10+1 = 11; 3+11 = 14 per element
    assert all(r["out"] == 28.0 for r in ok), ok
    planted = rank_pool_4.run(agreement_on_a_2x2_mesh, True, timeout=120)
    for r in planted:  # every rank stops, before any collective could hang
        assert r["error"] is not None and r["error"].startswith("cross-rank collective disagreement"), r
        # the first differing collective on that group (the default pipeline may have rewritten rank 2's all_reduce)
        assert "on the group of ranks [2, 3]: inference graph, collective #0: rank 2 issues " in r["error"], r
        assert "but rank 3 issues all_gather(" in r["error"], r
    stages = rank_pool_4.run(agreement_on_two_pipeline_stages, timeout=120)
    assert [r["error"] for r in stages] == [None] * 4, stages
    moe = rank_pool_4.run(agreement_on_a_dropless_moe, timeout=300)
    assert all(len(r["losses"]) == 2 and min(r["losses"]) > 0 for r in moe), moe
    assert any("u" in s for r in moe for s in r["a2a_shapes"]), moe  # the sizes really were data-dependent
