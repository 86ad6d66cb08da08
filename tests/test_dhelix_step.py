"""DHelix strand interleaving in the training step (issue #11): the fused train-step partition and
the ``dhelix_interleave`` pass, checked numerically against the plain accumulation loop on real
gloo ranks, plus graph-level checks of the plan on one process."""

from __future__ import annotations

import copy

import pytest
import torch

import commfuse
from commfuse.models import llama
from commfuse.train_step import compile_train_step


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp_sp", "moe"])
def test_interleaved_step_equals_plain_loop_on_4_ranks(rank_pool_4, layout):
    import _jobs_dhelix as jobs

    results = rank_pool_4.run(jobs.dhelix_step_matches_loop, layout, [2, 4], timeout=900)
    seen = results[0]
    for m, s in seen.items():
        assert s["passes_failed"] == [], s
        assert s["partitions"] == ["fused"], s
        assert s["changed"] and s["kept"] == "interleaved", s
        assert s["pairs"] > 0, s
        assert [len(u) for u in s["units"]] and sum(len(u) for u in s["units"]) == m, s
        # same plan on every rank (the digest hashes the chosen node order)
        assert {r[m]["digest"] for r in results} == {s["digest"]}, [r[m]["digest"] for r in results]
        # peak memory of the interleaved step within 10% of the non-interleaved one (simulated)
        assert s["peak_interleaved"] <= 1.10 * s["peak_sequential"], s
