"""`commfuse calibrate`: the fits are exact on exact data, and a tiny real sweep on the
2-rank gloo pool produces a profile every rank can load."""

from __future__ import annotations

import pytest

from commfuse.tools.calibrate import Sample, calibrate, fit_alpha_beta, fit_collectives, fit_compute
from commfuse.costmodel.profile import CostProfile
from commfuse.ir.kinds import CollectiveKind


@pytest.mark.parametrize("a,b", [(100.0, 0.001), (0.0, 0.5), (42.0, 0.0)])
def test_alpha_beta_fit_recovers_exact_lines(a, b):
    xs = [1024.0 * 4**i for i in range(6)]
    fa, fb = fit_alpha_beta(xs, [a + b * x if a + b * x > 0 else 1e-9 for x in xs])
    assert fa == pytest.approx(a, rel=1e-6, abs=1e-6) and fb == pytest.approx(b, rel=1e-6, abs=1e-9)


def test_fits_become_profile_params():
    coll = [Sample("all_reduce", x, [10 + 0.01 * x] * 3) for x in (1e3, 1e4, 1e5)]
    params = fit_collectives(coll, group_size=2)
    (f,) = params.fits
    assert f.kind is CollectiveKind.ALL_REDUCE and f.group_size == 2
    assert f.time_us(5e4) == pytest.approx(510.0)
    comp = fit_compute(
        [Sample("matmul", x, [2 + 1e-6 * x] * 3) for x in (1e5, 1e6, 1e7)] + [Sample("view", 0, [1.5] * 3)]
    )
    assert comp.fits["matmul"].unit == "flops" and comp.fits["conv"] == comp.fits["matmul"]
    assert comp.view_us == 1.5


@pytest.mark.slow(reason="micro-benchmarks ops and collectives on gloo ranks")
@pytest.mark.multirank
def test_calibrate_smoke_writes_loadable_profile(tmp_path, rank_pool_2):
    res = calibrate(2, sizes=(1024, 16384), warmup=1, reps=2, log=None)
    path = tmp_path / "p.json"
    res.profile.save(path)
    loaded = CostProfile.load(path)
    assert loaded.fingerprint() == res.profile.fingerprint()
    assert {f.kind.value for f in loaded.collective.fits} >= {"all_reduce", "all_gather", "reduce_scatter"}
    model = loaded.build_model()
    assert model.collectives.time("all_reduce", 4096, 2).time_us > 0


@pytest.mark.slow(reason="compiles a TP Llama twice on 2 gloo ranks")
@pytest.mark.multirank
def test_the_committed_profile_changes_decisions_and_every_rank_makes_the_same(rank_pool_2):
    """A compile priced with this machine's calibrated profile orders the TP Llama's collectives
    differently from the nominal model's, and both ranks decide the same."""
    from benchmarks.calibrated_decisions import PROFILE, decisions_job

    per_rank = rank_pool_2.run(decisions_job, ["llama_tp:s"], str(PROFILE), timeout=300)
    assert per_rank[0] == per_rank[1]
    runs = per_rank[0]["llama_tp:s"]
    differ = [
        (a["graph"], a["pass"]) for a, b in zip(runs["nominal"], runs["calibrated"], strict=True) if a != b
    ]
    assert ("backward", "schedule_overlap") in differ, differ
