"""Tests of the benchmark runner (benchmarks/): registries, metrics, and one end-to-end run.

The end-to-end test runs the runner's cheapest path, ``benchmarks/run.py --suite smoke
--workloads llama_tp_sp:s`` (one small workload, eager vs commfuse, one 2-layer scaling point),
in a fresh process and checks that the JSON has every field for every workload x baseline
and that the tables, plots and Markdown are written. ``COMMFUSE_BENCH_SUITE`` and
``COMMFUSE_BENCH_WORKLOADS`` (comma-separated, empty: all of the suite's) choose another run,
e.g. ``COMMFUSE_BENCH_SUITE=quick COMMFUSE_BENCH_WORKLOADS=`` for the whole quick suite
(docs/benchmarks.md). Numbers are not asserted: they are measurements.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.baselines import baseline_names, get_baseline  # noqa: E402
from benchmarks.measure import GraphCollectives, KindTotals, RankMeasurement  # noqa: E402
from benchmarks.metrics import METRICS, RunRecord, compute_metrics, step_times  # noqa: E402
from benchmarks.report import scaling_summary  # noqa: E402
from benchmarks.scaling import growth_exponent  # noqa: E402
from benchmarks.suites import SUITES, get_suite  # noqa: E402
from benchmarks.workloads import get_workload, workload_names  # noqa: E402


# ------------------------------------------------------------- registries


def test_every_suite_resolves():
    for suite in SUITES.values():
        pairs = suite.matrix()
        assert pairs, suite.name
        for w, b in pairs:
            get_workload(w)
            get_baseline(b)


def test_every_family_in_quick_suite():
    families = {get_workload(w).family.name for w in get_suite("quick").workloads}
    assert families == {
        "llama_tp_sp",
        "llama_tp",
        "moe_ep",
        "simple_fsdp",
        "dp",
        "moe_tp_ep",
        "moe_sp_ep_sp",
        "moe_style_sp_ep_sp",
        "simple_fsdp_ga",
    }


def test_single_pass_baselines_follow_the_pass_registry():
    from commfuse.passes import available_passes
    from commfuse.transforms.chimera import STEPS
    from commfuse.transforms.registry import DEFAULT_PIPELINE

    names = set(baseline_names())
    for p in available_passes():
        assert f"commfuse:{p}" in names and f"commfuse-eager:{p}" in names
        assert f"commfuse-eager:{p}" in get_suite("full").baselines
    # quick: the default pipeline's passes (and chimera's steps) only, to stay within CI's time
    quick = {b.split(":", 1)[1] for b in get_suite("quick").baselines if b.startswith("commfuse-eager:")}
    assert quick == {"none", *DEFAULT_PIPELINE, *STEPS}


def test_quick_suite_has_no_inductor_full_suite_does():
    assert not get_suite("quick").uses_inductor
    full = get_suite("full")
    assert {"inductor", "inductor+comm", "commfuse"} <= {b for _, b in full.matrix()}


def test_unknown_names_are_reported():
    with pytest.raises(KeyError, match="known"):
        get_workload("nope:s")
    with pytest.raises(KeyError, match="known"):
        get_baseline("nope")
    assert "llama_tp_sp:s" in workload_names()


# ---------------------------------------------------------------- metrics


def _record() -> RunRecord:
    graphs = [
        GraphCollectives("forward", 10, {"all_gather": KindTotals(2, 100, 50)}, KindTotals(2, 100, 50), {}),
        GraphCollectives(
            "backward", 12, {"reduce_scatter": KindTotals(2, 100, 50)}, KindTotals(2, 100, 50), {}
        ),
    ]
    r0 = RankMeasurement(
        0, 2, first_step_s=3.0, step_s=[0.010, 0.020, 0.030, 0.040], peak_alloc_bytes=1000, graphs=graphs
    )
    r1 = RankMeasurement(
        1, 2, first_step_s=3.5, step_s=[0.015, 0.010, 0.030, 0.050], peak_alloc_bytes=2000, graphs=graphs
    )
    return RunRecord("llama_tp_sp:s", "eager", 2, [r0, r1])


def test_metrics_from_raw_numbers():
    rec = _record()
    assert step_times(rec) == [0.015, 0.020, 0.030, 0.050]  # slowest rank per step
    m = compute_metrics(rec)
    assert set(m) == set(METRICS)
    assert m["step_ms_median"] == pytest.approx(25.0)
    assert m["step_ms_iqr"] == pytest.approx(35.0 - 18.75)
    assert m["compile_s"] == pytest.approx(3.5 - 0.025)
    assert m["peak_alloc_bytes"] == 2000
    assert m["logged_bytes"] == 200 and m["wire_bytes"] == 100
    assert m["collectives"] == {
        "all_gather": {"count": 2, "logged_bytes": 100, "wire_bytes": 50},
        "reduce_scatter": {"count": 2, "logged_bytes": 100, "wire_bytes": 50},
    }
    assert m["unrecognised_collectives"] == 0


def test_simulated_step_time_is_not_made_up():
    rec = _record()  # no simulated number in the raw measurements: None, printed n/a
    m = compute_metrics(rec)
    assert m["sim_step_dgx_h100x2"] is None
    assert METRICS["sim_step_dgx_h100x2"].fmt(None) == "n/a"
    rec.ranks[0].sim_step_us = 123.0  # rank 0's number (SPMD), us -> ms
    assert compute_metrics(rec)["sim_step_dgx_h100x2"] == pytest.approx(0.123)


def test_simulated_step_of_graphs_with_unknown_c10d_ops_is_none():
    from torch.fx.experimental.proxy_tensor import make_fx

    from benchmarks.baselines import CompiledGraph
    from benchmarks.simulated import simulate_dgx_step

    assert simulate_dgx_step([]) == (None, "no executed graphs captured")
    gm = make_fx(lambda x: x * 2)(torch.ones(4))
    us, note = simulate_dgx_step([CompiledGraph("forward", gm)])
    assert us is not None and us >= 0 and "dgx-h100 x2" in note
    with gm.graph.inserting_before(gm.graph.output_node()):
        gm.graph.call_function(torch.ops.c10d.barrier.default, ())  # a c10d op the IR has no spec for
    us, note = simulate_dgx_step([CompiledGraph("forward", gm)])
    assert us is None and "does not recognise" in note


@pytest.mark.multirank
def test_commfuse_baseline_has_a_simulated_step_time(rank_pool_2):
    """A commfuse baseline keeps the graphs it compiled; rank 0 prices them on DGX-H100 x2."""
    from benchmarks.measure import measure
    from benchmarks.simulated import simulate_dgx_step  # noqa: F401  (importable in the ranks)

    ranks = rank_pool_2.run(measure, "moe_ep:s", "commfuse-eager", 0, 1, timeout=300)
    assert ranks[0].sim_step_us is not None and ranks[0].sim_step_us > 0, ranks[0].sim_note
    assert "forward" in ranks[0].sim_note and "backward" in ranks[0].sim_note
    assert ranks[1].sim_step_us is None  # computed once, on rank 0
    rec = RunRecord("moe_ep:s", "commfuse-eager", 2, ranks)
    value = compute_metrics(rec)["sim_step_dgx_h100x2"]
    assert isinstance(value, float) and value == pytest.approx(ranks[0].sim_step_us / 1e3)
    assert METRICS["sim_step_dgx_h100x2"].fmt(value) != "n/a"


def test_failed_run_has_every_metric_as_none():
    rec = RunRecord("llama_tp_sp:s", "eager", 2, error="boom")
    assert compute_metrics(rec) == {name: None for name in METRICS}


def test_growth_exponent_and_goal_summary():
    assert growth_exponent([4, 8, 16, 32], [1.0, 2.0, 4.0, 8.0]) == pytest.approx(1.0)
    assert growth_exponent([4, 8, 16], [1.0, 4.0, 16.0]) == pytest.approx(2.0)
    pts = [
        {"mode": "commfuse-eager", "layers": n, "pipeline_s": 0.1 * n, "error": None, "compile_s": 1.0}
        for n in (4, 8)
    ]
    pts.append({"mode": "inductor", "layers": 8, "compile_s": 100.0, "pipeline_s": None, "error": None})
    (line,) = scaling_summary({"scaling": {"points": pts}})
    assert "0.80 s" in line and "0.8% of it" in line and "exponent" in line


@pytest.mark.slow(reason="schedules three blocks with Inductor's and commfuse's schedulers")
def test_overlap_vs_inductor_small_shapes():
    """The commfuse vs Inductor overlap comparison on tiny shapes: every row, a valid Inductor schedule, shared estimates."""
    from benchmarks.overlap_vs_inductor import KINDS, ROWS, overlap_tables, run_overlap_vs_inductor

    doc = run_overlap_vs_inductor(small=True)
    text = overlap_tables(doc)
    assert [b["block"] for b in doc["blocks"]] == ["llama_tp_sp", "simple_fsdp", "moe_sp_ep_sp"]
    for b in doc["blocks"]:
        assert f"\n{b['block']}:" in text
        for row in ROWS:
            assert set(b["rows"][row]) == {*KINDS, "block"}, (b["block"], row)
            assert f"  {row} " in text
        for kind in KINDS:
            before, ind = b["rows"]["input"][kind], b["rows"]["inductor"][kind]
            # a reorder keeps every collective; Inductor's FSDP pre-bucketing may merge some (fewer, same bytes)
            assert set(ind["multiset"]) == set(before["multiset"]), (b["block"], kind)
            for key, got in ind["multiset"].items():
                assert got["bytes"] == before["multiset"][key]["bytes"], (b["block"], kind, key)
                assert 1 <= got["count"] <= before["multiset"][key]["count"], (b["block"], kind, key)
            assert ind["not_estimated"] == [], (b["block"], kind)  # Inductor ran on the judge's times only
            assert b["rows"]["commfuse_reorder"][kind]["multiset"] == before["multiset"]  # a pure reorder
    calls = doc["estimate_calls"]
    assert all(calls.get(c, 0) > 0 for c in ("collective", "compute", "wait", "free")), calls
    assert calls["collective"] >= sum(
        b["rows"]["inductor"][k]["collectives"] for b in doc["blocks"] for k in KINDS
    )
    for ours in ("commfuse", "commfuse_reorder"):
        for scope in ("per_block", "per_graph"):
            v = doc["verdict"][ours][scope]
            assert v["of"] == (3 if scope == "per_block" else 6) and isinstance(v["pass"], bool)
    assert text.count("-> PASS") + text.count("-> FAIL") == 4


# ------------------------------------------------------------- end to end


@pytest.mark.slow(
    reason="runs benchmarks/run.py end to end in a subprocess (gloo ranks, a scaling point, plots)"
)
@pytest.mark.multirank
def test_suite_runs_and_json_is_complete(tmp_path):
    suite = get_suite(os.environ.get("COMMFUSE_BENCH_SUITE", "smoke"))
    only = [w for w in os.environ.get("COMMFUSE_BENCH_WORKLOADS", "llama_tp_sp:s").split(",") if w]
    cmd = [sys.executable, str(REPO / "benchmarks" / "run.py"), "--suite", suite.name]
    if only:
        suite = suite.only(only)
        cmd += ["--workloads", ",".join(only)]
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        cmd
        + ["--json", str(out), "--plot", str(tmp_path / "plots"), "--markdown", str(tmp_path / "bench.md")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    doc = json.loads(out.read_text())

    env = doc["environment"]
    assert env["machine"]["cpu_model"] and env["machine"]["logical_cores"]
    assert {"python", "torch", "commfuse"} <= set(env["versions"]) and env["date"]
    assert doc["settings"]["world_size"] == suite.world_size

    got = {(r["workload"], r["baseline"]): r for r in doc["results"]}
    assert set(got) == set(suite.matrix())
    for (w, b), r in got.items():
        assert r["error"] is None, (w, b, r["error"])
        assert set(r["metrics"]) == set(METRICS), (w, b)
        for name in METRICS:
            if name == "unrecognised_collectives" or (
                name == "sim_step_dgx_h100x2" and b.startswith("inductor")
            ):
                continue  # None by design (graphs from commfuse's reports / Inductor bucketing ops)
            assert r["metrics"][name] is not None, (w, b, name)
        ranks = r["raw"]["ranks"]
        assert len(ranks) == suite.world_size
        assert all(len(rk["step_s"]) == suite.steps and rk["torch_threads"] == 1 for rk in ranks)
        assert r["metrics"]["collectives"], (w, b)  # every workload communicates

    points = doc["scaling"]["points"]
    assert len(points) == sum(len(layers) for _, layers in suite.scaling)
    assert all(p["error"] is None and p["pipeline_s"] is not None for p in points if p["mode"] != "inductor")
    assert (tmp_path / "plots" / "comparison.png").stat().st_size > 0
    assert (tmp_path / "plots" / "scaling.png").stat().st_size > 0
    assert "simulated step time (DGX-H100 x2)" in proc.stdout
    md = (tmp_path / "bench.md").read_text()
    assert all(w in md for w in suite.workloads), md[:2000]


def test_workloads_flag_restricts_the_suite_and_names_unknown_ones():
    smoke = get_suite("smoke")
    one = smoke.only(["llama_tp_sp:s"])
    assert one.workloads == ("llama_tp_sp:s",) and one.baselines == smoke.baselines
    assert {w for w, _ in one.matrix()} == {"llama_tp_sp:s"}
    with pytest.raises(KeyError, match="not in suite 'smoke'"):
        smoke.only(["llama_tp_sp:m"])
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), "--suite", "smoke", "--workloads", "nope:s"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--workloads" in proc.stderr and "nope:s" in proc.stderr


# ------------------------------------------------------------- A/B in one run


def test_ab_percentile_and_speedup_direction():
    from benchmarks.ab import percentile, speedup_ratios

    assert [percentile([5, 1, 4, 2, 3], q) for q in (0.0, 0.1, 0.5, 1.0)] == pytest.approx(
        [1.0, 1.4, 3.0, 5.0]
    )
    # time(baseline) / time(candidate): the candidate taking half the time is a speed-up of 2
    assert speedup_ratios([2.0, 3.0, 1.0], [1.0, 3.0, 2.0]) == [2.0, 1.0, 0.5]
    with pytest.raises(ValueError):
        speedup_ratios([1.0, 2.0], [1.0])


def test_ab_bootstrap_interval_of_the_median():
    from benchmarks.ab import bootstrap_median_ci

    # Resampling {1, 2}: medians 1, 1.5, 2 with p = 1/4, 1/2, 1/4, so the 2.5% / 97.5% quantiles of
    # 2000 resampled medians are 1 and 2.
    assert bootstrap_median_ci([1.0, 2.0]) == (1.0, 2.0)
    assert bootstrap_median_ci([1.3]) == (1.3, 1.3)
    assert bootstrap_median_ci([1.2] * 25) == (1.2, 1.2)  # a constant ratio: zero width
    ratios = [1.0 + 0.01 * ((7 * i) % 23) for i in range(23)]  # 1.00 .. 1.22, scrambled; median 1.11
    lo, hi = bootstrap_median_ci(ratios)
    assert min(ratios) <= lo < statistics.median(ratios) < hi <= max(ratios)
    assert bootstrap_median_ci(ratios) == (lo, hi)  # fixed seed: reproducible
    lo99, hi99 = bootstrap_median_ci(ratios, confidence=0.99)
    assert lo99 <= lo and hi <= hi99


def test_ab_verdict_and_comparison():
    from benchmarks.ab import compare, verdict

    assert verdict(1.01, 1.3) == "faster"
    assert verdict(0.7, 0.99) == "slower"
    assert verdict(0.9, 1.1) == verdict(1.0, 1.2) == verdict(0.8, 1.0) == "no difference resolved"
    c = compare([2.0] * 20, [1.0] * 20)  # the baseline takes twice as long
    assert (c["median"], c["ci_low"], c["ci_high"], c["pairs"], c["verdict"]) == (2.0, 2.0, 2.0, 20, "faster")
    assert compare([1.0] * 20, [1.25] * 20)["verdict"] == "slower"


def test_ab_round_and_compile_order():
    from benchmarks.ab import compile_order, round_order

    assert [round_order(["a", "b"], r) for r in range(4)] == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]
    assert {round_order(["a", "b", "c"], r)[0] for r in range(2)} == {"a", "c"}
    # inductor+comm's config patch is process-wide while its session is open: compiled last
    assert compile_order(["inductor+comm", "commfuse", "eager"]) == ["commfuse", "eager", "inductor+comm"]
    with pytest.raises(KeyError, match="nope"):
        compile_order(["eager", "nope"])


def test_ab_summary_and_tables_from_raw_numbers():
    from benchmarks.ab import ABRank, ab_tables, settings, summarize

    def rank(r: int, cand: list[float], base: list[float]) -> ABRank:
        runs = {
            "cand": RankMeasurement(r, 2, 0.5, cand, None),
            "base": RankMeasurement(r, 2, 0.2, base, None),
        }
        return ABRank(
            r, 2, runs, {"cand": [1.0 + r], "base": [1.0 + r + 1e-6]}, [["cand", "base"], ["base", "cand"]]
        )

    ranks = [rank(0, [0.010, 0.012], [0.020, 0.018]), rank(1, [0.011, 0.010], [0.019, 0.024])]
    result = summarize("llama_tp_sp:s", ["cand", "base"], ranks)
    ex = result["executors"]
    assert ex["cand"]["round_s"] == [0.011, 0.012] and ex["base"]["round_s"] == [0.020, 0.024]  # slowest rank
    assert ex["cand"]["step_ms_median"] == pytest.approx(11.5) and ex["cand"]["first_step_s"] == 0.5
    (c,) = result["comparisons"]
    assert (c["candidate"], c["baseline"]) == ("cand", "base")
    assert c["ratios"] == pytest.approx([0.020 / 0.011, 0.024 / 0.012]) and c["verdict"] == "faster"
    assert result["first_loss_max_abs_diff"] == pytest.approx(1e-6)
    doc = {
        "environment": {
            "date": "d",
            "machine": {"platform": "p", "logical_cores": 2},
            "versions": {"torch": "t"},
        },
        "settings": settings([2], 1, 2),
        "executors": ["cand", "base"],
        "warnings": [],
        "results": [json.loads(json.dumps(result)), {"workload": "moe_ep:s", "error": "boom"}],
    }
    text, md = ab_tables(doc), ab_tables(doc, markdown=True)
    assert "cand is 1.909x faster than base" in text and "FAILED: boom" in text
    assert "| llama_tp_sp:s | cand | base | 11.5 | 22.0 | 1.909 |" in md


def test_ab_options_are_checked_before_any_rank_starts(capsys):
    from benchmarks.run import main

    for argv, msg in [
        (["--ab", "eager"], "two or more"),
        (["--ab", "eager,eager"], "two or more"),
        (["--ab", "eager,nope"], "nope"),
        (["--pairs", "5"], "only with --ab"),
        (["--ab", "eager,commfuse-eager", "--workloads", "nope:s"], "nope:s"),
        (["--ab", "eager,commfuse-eager", "--pairs", "0"], ">= 1"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and msg in capsys.readouterr().err, argv


@pytest.mark.slow(
    reason="runs benchmarks/run.py --ab in a subprocess: rank start-up, warm-up compile, one compile"
)
@pytest.mark.multirank
def test_ab_runs_end_to_end(tmp_path):
    """``--ab commfuse-eager,eager`` on llama_tp_sp:s, 2 gloo ranks, 3 pairs: JSON and tables complete."""
    out, md = tmp_path / "ab.json", tmp_path / "ab.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "run.py"),
            "--ab",
            "commfuse-eager,eager",
            "--workloads",
            "llama_tp_sp:s",
            "--pairs",
            "3",
            "--warmup",
            "1",
            "--json",
            str(out),
            "--markdown",
            str(md),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "3 pairs (< 20)" in proc.stderr  # the smoke-sized run is flagged
    doc = json.loads(out.read_text())
    assert doc["mode"] == "ab" and "--ab commfuse-eager,eager" in doc["command"]
    assert doc["environment"]["versions"]["torch"] and doc["environment"]["machine"]["platform"]
    assert doc["load_avg_1m_before"] is not None and doc["load_avg_1m_after"] is not None
    (r,) = doc["results"]
    assert r["error"] is None and r["world_size"] == 2
    assert r["first_loss_max_abs_diff"] is not None and r["first_loss_max_abs_diff"] < 1e-4  # same start
    assert r["orders"] == [
        ["commfuse-eager", "eager"],
        ["eager", "commfuse-eager"],
        ["commfuse-eager", "eager"],
    ]
    for e in ("commfuse-eager", "eager"):
        assert len(r["executors"][e]["round_s"]) == 3 and r["executors"][e]["first_step_s"] > 0
        assert all(len(rk["runs"][e]["step_s"]) == 3 for rk in r["raw"]["ranks"])
    (c,) = r["comparisons"]
    assert c["ci_low"] <= c["median"] <= c["ci_high"] and len(c["ratios"]) == 3
    assert "| llama_tp_sp:s | commfuse-eager | eager |" in md.read_text()
    assert "speed-up" in proc.stdout and c["verdict"] in proc.stdout


@pytest.mark.slow(reason="imports torchtitan in every rank, builds its llama3 twice and compiles both copies")
@pytest.mark.multirank
def test_ab_compiles_two_copies_of_a_torchtitan_model(rank_pool_2):
    """The A/B job on torchtitan llama3 (TP + SP, size s), two compiled executors: both copies
    compile and alternate with the same first loss. With a DeviceMesh per copy the second compile
    failed in AOTAutograd's partitioner ("Node tangents_2 was invalid, but is output"; see
    benchmarks.thirdparty.shared_titan_meshes)."""
    pytest.importorskip("torchtitan", reason="the conformance extra is not installed")
    from benchmarks.ab import ab_job

    executors = ["commfuse-eager", "commfuse-eager:none"]
    for rank in rank_pool_2.run(ab_job, "titan_llama3_tp_sp:s", executors, 0, 2, timeout=600):
        assert rank.orders == [executors, executors[::-1]]
        assert all(len(rank.runs[e].step_s) == 2 and rank.runs[e].first_step_s > 0 for e in executors)
        (a,), (b,) = (rank.first_losses[e] for e in executors)
        assert abs(a - b) < 1e-5, (a, b)


def _job_declared_step(workload: str) -> tuple[float, dict[str, int]]:
    """``workload`` built on this rank, one forward + loss + backward traced by a recording AOT
    backend and run op by op (as the eager baseline captures its graphs): the loss and the
    collectives of the forward and backward graphs by kind (``commfuse.analyze``)."""
    import torch.distributed as dist

    import commfuse
    from commfuse.testing.graphs import capture_aot_graphs

    built = get_workload(workload).build(dist.get_world_size(), dist.get_rank())
    losses: list[torch.Tensor] = []

    def loss(out):
        losses.append(built.loss(out))
        return losses[-1]

    got = capture_aot_graphs(built.model, *built.inputs, loss=loss)
    kinds: dict[str, int] = {}
    for kind in ("forward", "backward"):
        for k, totals in commfuse.analyze(got[kind], graph=kind).by_kind.items():
            kinds[k] = kinds.get(k, 0) + totals.count
    return float(losses[0]), kinds


@pytest.mark.slow(
    reason="imports torchtitan and transformers in every rank and builds four third-party models"
)
@pytest.mark.multirank
def test_declared_workloads_step_on_real_ranks_with_their_collectives(rank_pool_2, rank_pool_4):
    """Every declared family at size s, built by its library on real gloo ranks (its own world
    size): one step with a finite loss whose graphs issue the collectives its parallelism implies."""
    pytest.importorskip("torchtitan", reason="the conformance extra is not installed")
    pytest.importorskip("transformers", reason="the conformance extra is not installed")
    from benchmarks.declared import DECLARED_FAMILIES

    # family -> (kinds its graphs must issue, kinds they must not)
    expected = {
        "titan_llama3_tp_sp": ({"all_gather", "reduce_scatter"}, {"all_reduce", "all_to_all"}),  # SP
        "titan_deepseek_v3_tp_ep": (
            {"all_gather", "reduce_scatter", "all_to_all"},
            set(),
        ),  # SP + EP dispatch
        "hf_llama_tp": ({"all_reduce"}, {"reduce_scatter", "all_to_all"}),  # plain TP
        # SimpleFSDP's parameter all_gather / gradient reduce_scatter, SP's, the norms' gradient all_reduce
        "simple_fsdp_tp": ({"all_gather", "reduce_scatter", "all_reduce"}, {"all_to_all"}),
    }
    assert set(expected) == {f.name for f in DECLARED_FAMILIES}
    pools = {2: rank_pool_2, 4: rank_pool_4}
    for family in DECLARED_FAMILIES:
        results = pools[family.world or 2].run(_job_declared_step, f"{family.name}:s", timeout=600)
        must, must_not = expected[family.name]
        for rank, (loss, kinds) in enumerate(results):
            assert torch.isfinite(torch.tensor(loss)), (family.name, rank, loss)
            assert must <= set(kinds) and not must_not & set(kinds), (family.name, rank, kinds)
        assert all(kinds == results[0][1] for _, kinds in results), (
            family.name
        )  # SPMD: the same on every rank


def test_comm_share_row_bounds_what_communication_can_give():
    from benchmarks.comm_share import share_row

    # 4 ms with communication, 1 ms without: communication is 75% of the step, at most 4x to gain
    row = share_row("w:s", "eager", [0.004, 0.005, 0.003], [0.001, 0.0011, 0.0009])
    assert row["real_ms"] == pytest.approx(4.0) and row["local_ms"] == pytest.approx(1.0)
    assert row["share"] == pytest.approx(0.75) and row["bound"] == pytest.approx(4.0)
    # communication that costs nothing: no gain to be had
    flat = share_row("w:s", "eager", [0.002] * 3, [0.002] * 3)
    assert flat["share"] == pytest.approx(0.0) and flat["bound"] == pytest.approx(1.0)
