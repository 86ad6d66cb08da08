"""Cross-rank agreement: disagreement is an error within the timeout, never a hang."""

from __future__ import annotations

import pytest

from commfuse.agreement import first_difference

from _multirank_jobs import inductor_cache_hit_on_rank0_only, planted_disagreement, simulated_cache_hit_rank1


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


@pytest.mark.slow(reason="cold Inductor compiles on 2 gloo ranks, twice")
@pytest.mark.multirank
def test_inductor_cache_hit_on_one_rank_does_not_hang(rank_pool_2, tmp_path):
    results = rank_pool_2.run(inductor_cache_hit_on_rank0_only, str(tmp_path), timeout=500)
    r0, r1 = results
    assert r0[1]["out"] == r1[1]["out"] == r0[2]["out"] == r1[2]["out"] == 28.0
    assert r0[2]["hooks_ran"] == 0, "rank 0 should have hit its compile cache in round 2"
    assert r1[2]["hooks_ran"] > 0
