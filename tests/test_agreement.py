"""The cross-rank safety net (commfuse/agreement.py): what is hashed and what is left out, the
Store protocol with simulated ranks (threads on one in-process c10d Store), and real gloo ranks:
a planted divergence the net catches and falls back from without a hang."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import pytest
import sympy
import torch
import torch.distributed as dist

from commfuse.agreement import (
    CACHED,
    Exchange,
    FrameRecord,
    GroupEntry,
    collective_signature,
    first_difference,
    graph_sequences,
    group_entries,
    sequence_hash,
)
from commfuse.core.meta import SETTING_META
from commfuse.ir.kinds import CollectiveKind
from commfuse.testing import fake_process_group

from _jobs_agreement import (
    agreement_on_a_2x2_mesh,
    agreement_on_a_dropless_moe,
    agreement_on_two_pipeline_stages,
    inductor_cache_hit_on_rank0_only,
    planted_divergence_falls_back,
)


# -- what is hashed ---------------------------------------------------------------------------
def _traced_ir():
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    from commfuse.ir.graph_ir import CollectiveIR

    def f(x, y):
        a = funcol.all_reduce(x, "sum", dist.group.WORLD)
        b = funcol.all_gather_tensor(y, 0, dist.group.WORLD)
        # this rank's own receive sizes: another rank sends and receives other amounts
        c = funcol.all_to_all_single(y, [1, 2, 3, 2], [2, 2, 2, 2], dist.group.WORLD)
        return a, b, c

    gm = make_fx(f)(torch.ones(4), torch.ones(8, 2))
    return CollectiveIR(gm)


def test_signatures_keep_what_must_agree_and_leave_out_what_may_differ():
    with fake_process_group(4):
        ir = _traced_ir()
        seqs, unknown = graph_sequences(ir)
        assert unknown == 0 and list(seqs) == [(0, 1, 2, 3)]  # groups by member ranks
        ar, ag, a2a = seqs[(0, 1, 2, 3)]
        assert ar[:4] == ["all_reduce", "sum", "float32", [["4"]]]
        assert ag[:4] == ["all_gather", None, "float32", [["8", "2"]]]
        assert a2a[:4] == ["all_to_all", None, "float32", [["*", "2"]]]  # the rank-local split dim
        c = ir.collectives[0]
        # a symbolic size reads "?": Dynamo specialises 1 on one rank and keeps s0 on another
        sym = dataclasses.replace(c, input_shapes=[(sympy.Symbol("s0") * 2, 4)])
        assert collective_signature(sym)[3] == [["?", "4"]]
        # pairwise transfers (pipeline boundaries) are not compared
        for kind in (CollectiveKind.SEND, CollectiveKind.RECV, CollectiveKind.BATCH_P2P, CollectiveKind.P2P):
            assert collective_signature(dataclasses.replace(c, kind=kind)) is None
        # the communicator setting a pass chose is part of what must agree
        c.start.meta[SETTING_META] = {"protocol": "LL", "channels": 4}
        assert collective_signature(c)[-1] == '{"channels": 4, "protocol": "LL"}'


def test_frame_record_orders_graphs_and_marks_a_cache_hit():
    with fake_process_group(4):
        ir = _traced_ir()
        compiled, written = FrameRecord(), FrameRecord()
        for graph in ("backward", "joint", "forward"):  # joint graphs are never executed: not recorded
            compiled.add(graph, ir)
            written.add(graph, ir)
    assert sorted(compiled.graphs) == ["backward", "forward"]
    seq = compiled.sequences()[(0, 1, 2, 3)]
    assert [s[0] for s in seq] == ["forward"] * 3 + ["backward"] * 3
    (entry,) = group_entries(compiled, written)
    assert entry.compiled == entry.fallback == sequence_hash(seq)
    hit = FrameRecord(graphs={"forward": compiled.graphs["forward"]})  # the backward came from a cache
    assert group_entries(hit, written)[0].compiled == CACHED


def test_first_difference_names_the_collective():
    a = [
        ["forward", "all_reduce", "sum", "float32", [["4"]], False, None],
        ["forward", "all_gather", None, "float32", [["2"]], False, None],
    ]
    b = [a[1], a[0]]
    assert first_difference(a, b, me="rank 1", them="rank 0") == (
        "collective #0: rank 0 issues all_gather(float32, in [2]) in the forward graph but rank 1 issues "
        "all_reduce(float32, in [4], sum) in the forward graph"
    )
    assert first_difference(a, a) is None
    assert "but this rank issues no collective" in first_difference(a[:1], a)


# -- the protocol, simulated ranks ------------------------------------------------------------------
def _sigs(kinds, shape="4"):
    return tuple(
        ("forward", k, "sum" if k == "all_reduce" else None, "float32", [[shape]], False, None) for k in kinds
    )


def _entry(ranks, kinds=("all_reduce",), written=None) -> GroupEntry:
    c, w = _sigs(kinds), _sigs(written or kinds)
    return GroupEntry(
        tuple(ranks), sequence_hash([list(x) for x in c]), sequence_hash([list(x) for x in w]), c, w
    )


def _exchange(store, per_rank: dict, *, frame="f", timeout_s=20.0, digest=lambda r: "cfg") -> dict:
    """Every rank of ``per_rank`` (rank -> its GroupEntries) runs the exchange in its own thread."""
    out = {}

    def rank(r):
        out[r] = Exchange(
            store,
            frame=frame,
            config_digest=digest(r),
            rank=r,
            timeout_s=timeout_s,
            config_summary={"bucket_cap_bytes": r},
        ).run(per_rank[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in per_rank]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s * 3)
    assert sorted(out) == sorted(per_rank), "a simulated rank hung"
    return out


def _mesh_2x2(tp_kinds_of_rank3=None, tp_kinds=("all_reduce",)):
    """rank -> its groups on a 2 x 2 mesh: TP rows {0,1}, {2,3}; DP columns {0,2}, {1,3}. On the
    TP groups the program as written all-reduces and the compiled program issues ``tp_kinds``
    (rank 3: ``tp_kinds_of_rank3``, a planted divergence)."""
    tp = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    dp = {0: (0, 2), 2: (0, 2), 1: (1, 3), 3: (1, 3)}
    return {
        r: [
            _entry(tp[r], tp_kinds_of_rank3 if r == 3 and tp_kinds_of_rank3 else tp_kinds, ("all_reduce",)),
            _entry(dp[r]),
        ]
        for r in range(4)
    }


def _tcp_store():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    return server


def test_agreeing_ranks_run_the_compiled_program_over_a_tcp_store():
    server = _tcp_store()
    clients = {r: dist.TCPStore("127.0.0.1", server.port, 1, False) for r in range(4)}
    out = {}

    def rank(r):
        out[r] = Exchange(clients[r], frame="f", config_digest="cfg", rank=r, timeout_s=20).run(
            _mesh_2x2()[r]
        )

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [(v.action, v.warn, v.rounds) for v in out.values()] == [("compiled", False, 1)] * 4


def test_a_mismatch_falls_back_every_linked_rank_with_one_warning():
    out = _exchange(dist.HashStore(), _mesh_2x2(("reduce_scatter", "all_gather")))
    # the difference is on {2, 3}; ranks 0 and 1 are linked to it through the DP groups
    assert {v.action for v in out.values()} == {"fallback"}
    assert sum(v.warn for v in out.values()) == 1
    reason = out[0].reason
    assert reason.startswith("on the group of ranks [2, 3] (frame f): collective #0: rank ")
    assert "all_reduce(float32, in [4], sum) in the forward graph" in reason
    assert "reduce_scatter(float32, in [4]) in the forward graph" in reason
    assert all(v.reason == reason for v in out.values())


def test_ranks_that_share_no_group_are_not_compared():
    store = dist.HashStore()
    stage0 = {0: [_entry((0, 1))], 1: [_entry((0, 1), ("all_gather",), ("all_reduce",))]}
    stage1 = {2: [_entry((2, 3))], 3: [_entry((2, 3))]}
    # one frame run by both stages at once (the same code): when they share a round, the stage
    # that agrees may fall back with the other (the round's verdict is one), alike on its ranks
    out = _exchange(store, {**stage0, **stage1})
    assert out[2].action == out[3].action in ("compiled", "fallback")
    assert [out[r].action for r in (0, 1)] == ["fallback"] * 2
    # in frames of their own (the usual case: each stage's code) the stages do not meet at all
    a = _exchange(store, stage0, frame="stage0")
    b = _exchange(store, stage1, frame="stage1")
    assert {v.action for v in a.values()} == {"fallback"} and {v.action for v in b.values()} == {"compiled"}


def test_a_recompile_on_one_rank_reads_the_settled_verdict_without_waiting():
    store = dist.HashStore()
    split = ("reduce_scatter", "all_gather")
    _exchange(store, _mesh_2x2(), frame="ok")
    _exchange(store, _mesh_2x2(split), frame="bad")
    _exchange(store, _mesh_2x2(tp_kinds=split), frame="rewritten")  # every rank rewrote its TP all_reduce
    t = time.monotonic()
    alone = _exchange(store, {0: _mesh_2x2()[0]}, frame="ok", timeout_s=60)[0]
    assert (alone.action, alone.rounds) == ("compiled", 0) and time.monotonic() - t < 5
    # the groups settled on the program as written: a rank compiling the frame again runs it too
    assert _exchange(store, {3: _mesh_2x2(split)[3]}, frame="bad")[3].action == "fallback"
    assert _exchange(store, {0: _mesh_2x2()[0]}, frame="bad")[0].action == "fallback"
    # its compiled sequence differs from its peers', whose sequence is its program as written: fallback
    assert _exchange(store, {3: _mesh_2x2(split)[3]}, frame="ok")[3].action == "fallback"
    # it matches neither: the peers run a program this rank does not have, it raises instead of hanging
    other = _exchange(store, {3: _mesh_2x2(("all_gather",), tp_kinds=split)[3]}, frame="rewritten")[3]
    assert (other.action, other.rounds) == ("conflict", 0)
    assert "the peers run a compiled sequence settled in an earlier exchange" in other.reason


def test_a_timeout_falls_back_releases_the_others_and_settles_for_late_ranks():
    store = dist.HashStore()
    mesh = _mesh_2x2()
    t = time.monotonic()
    out = _exchange(store, {r: mesh[r] for r in (0, 1, 2)}, timeout_s=2.0)  # rank 3 never comes
    took = time.monotonic() - t
    assert {(v.action, v.timed_out) for v in out.values()} == {("fallback", True)}
    assert sum(v.warn for v in out.values()) == 1 and 1.5 < took < 4.0  # one timeout, not one per rank
    assert all(
        v.reason.startswith("no verdict within 2 s (Config.agreement_timeout_s): ") for v in out.values()
    )
    late = _exchange(store, {3: mesh[3]}, timeout_s=60)[3]
    assert (late.action, late.rounds) == ("fallback", 0)


def test_groups_that_arrive_after_their_round_was_sealed_start_the_next_one(monkeypatch):
    store = dist.HashStore()
    first = _exchange(store, {0: [_entry((0, 1))], 1: [_entry((0, 1))]})  # round 0, sealed "compiled"
    assert {(v.action, v.rounds) for v in first.values()} == {("compiled", 1)}
    # ranks 2 and 3 read the open round just before it was sealed: their groups come after the seal
    monkeypatch.setattr(Exchange, "_open_round", lambda self: 0)
    late = _exchange(store, {2: [_entry((2, 3), ("all_gather",), ("all_reduce",))], 3: [_entry((2, 3))]})
    assert {(v.action, v.rounds) for v in late.values()} == {("fallback", 2)}  # compared among themselves


def test_a_cache_hit_takes_part_without_being_compared():
    store = dist.HashStore()
    cached = dataclasses.replace(_entry((0, 1, 2)), compiled=CACHED)
    out = _exchange(store, {0: [cached], 1: [_entry((0, 1, 2))], 2: [_entry((0, 1, 2))]}, frame="a")
    assert {v.action for v in out.values()} == {"compiled"}
    out = _exchange(
        store,
        {0: [cached], 1: [_entry((0, 1, 2))], 2: [_entry((0, 1, 2), ("all_gather",), ("all_reduce",))]},
        frame="b",
    )
    assert {v.action for v in out.values()} == {"fallback"}


def test_ranks_compiled_under_other_settings_fall_back():
    out = _exchange(dist.HashStore(), {0: [_entry((0, 1))], 1: [_entry((0, 1))]}, digest=lambda r: f"cfg{r}")
    assert {v.action for v in out.values()} == {"fallback"}
    assert "the same collectives, compiled under different settings (bucket_cap_bytes: rank " in out[0].reason


def test_store_cost_per_rank_is_flat_in_the_world_size():
    cost = {}
    for n in (4, 64):
        out = _exchange(dist.HashStore(), {r: [_entry(tuple(range(n)))] for r in range(n)}, timeout_s=60)
        assert {v.action for v in out.values()} == {"compiled"}
        cost[n] = (max(v.store_ops for v in out.values()), max(v.store_bytes for v in out.values()))
    assert cost[64][0] == cost[4][0]  # Store requests per rank do not grow with the group
    assert cost[64][1] <= cost[4][1] * 1.1


def test_the_cost_report_is_registered_and_its_stored_counts_are_flat():
    from pathlib import Path

    from benchmarks.agreement_cost import agreement_cost_tables
    from benchmarks.run import _REPORTS

    assert _REPORTS["agreement_cost"].module == "benchmarks.agreement_cost"
    stored = Path(__file__).resolve().parents[1] / "benchmarks/results/agreement-cost-2026-11-29.json"
    report = json.loads(stored.read_text())["agreement_cost"]
    assert "| DP 1024 | 1 | 15 |" in agreement_cost_tables(report)
    # Store requests per rank by groups per rank, at 2 and 4 real ranks and 1024 simulated ones
    per_groups = {}
    for row in report["rows"]:
        per_groups.setdefault(len(row["groups"]), set()).add(row["exchange_ops_max"])
    for sim in report["simulated"]:
        per_groups.setdefault(sim["groups_per_rank"], set()).add(sim["ops_per_rank_max"])
    assert all(len(ops) == 1 for ops in per_groups.values()), per_groups


def test_the_first_call_decides_once_and_later_calls_go_straight_to_the_choice():
    from commfuse.agreement import AgreementError, FirstRunChoice, Verdict

    def compiled(x):
        return ("compiled", x)

    compiled.some_attribute = 7  # what Dynamo or AOTAutograd hang on their callables stays readable

    def fallback(x):
        return ("as written", x)

    for action, mode, want in [
        ("compiled", "fallback", "compiled"),
        ("fallback", "fallback", "as written"),
        ("fallback", "raise", AgreementError),
        ("conflict", "fallback", AgreementError),
    ]:
        decided = []
        fn = FirstRunChoice(
            compiled, fallback, lambda a=action, d=decided: d.append(a) or Verdict(a, reason="why"), mode=mode
        )
        assert fn.some_attribute == 7
        if want is AgreementError:
            with pytest.raises(AgreementError, match="why"):
                fn(1)
            continue
        assert [fn(i)[0] for i in range(3)] == [want] * 3 and decided == [action]


def test_the_config_field_names_its_values():
    import commfuse
    from commfuse.core.errors import ConfigError

    assert commfuse.Config().check_agreement == "fallback"
    assert commfuse.Config(check_agreement=False).check_agreement == "off"
    for bad in (True, "on"):
        with pytest.raises(ConfigError, match="Config.check_agreement"):
            commfuse.Config(check_agreement=bad)
    be = commfuse.backend()  # torch.compile(options=...) compiles with a derived backend: same verdict list
    assert be.with_compile_args(options={"check_agreement": "raise"}).agreements is be.agreements


# -- real ranks --------------------------------------------------------------------------------
@pytest.mark.slow(reason="compiles and trains SimpleFSDP on 2 gloo ranks three times, eagerly and compiled")
@pytest.mark.multirank
def test_planted_divergence_is_caught_and_falls_back_without_a_hang(rank_pool_2):
    # control: uneven local batches, the same decisions on both ranks: the compiled program runs
    ok = rank_pool_2.run(planted_divergence_falls_back, None, (1, 64), timeout=600)
    assert [r["verdicts"] for r in ok] == [[("compiled", None, False)]] * 2, ok
    # rank 1's forward issues its all_gathers in another order (gloo would fail on the sizes)
    planted = rank_pool_2.run(planted_divergence_falls_back, "pass", timeout=600)
    assert [r["swapped"] for r in planted] == [0, 1]
    assert all(r["verdicts"][0][0] == "fallback" and not r["verdicts"][0][2] for r in planted), planted
    assert sum(len(r["warnings"]) for r in planted) == 1, planted  # one warning, naming the collective
    reason = planted[0]["verdicts"][0][1]
    assert "on the group of ranks [0, 1]" in reason and "collective #0: rank " in reason, reason
    assert "all_gather(float32, in [8, 8]) in the forward graph" in reason, reason
    # rank 1 compiled under another setting: the same collectives, but nothing says they stay so
    config = rank_pool_2.run(planted_divergence_falls_back, "config", timeout=600)
    assert all(r["verdicts"][0][0] == "fallback" for r in config), config
    assert "compiled under different settings (schedule_memory_budget: " in config[0]["verdicts"][0][1]


def _set_inductor_cache_dir(path: str | None) -> None:
    """Rank job: point Inductor's cache at ``path`` again (None: its default)."""
    if path is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path


@pytest.mark.slow(reason="cold Inductor compiles on 2 gloo ranks, twice")
@pytest.mark.multirank
def test_inductor_cache_hit_on_one_rank_does_not_hang_or_fall_back(rank_pool_2, tmp_path):
    # The job points each rank's Inductor cache at a directory of its own and leaves it there;
    # the pool does not restore the environment, so without this every later Inductor compile
    # on these ranks would miss the run's shared cache (tests/conftest.py).
    try:
        results = rank_pool_2.run(inductor_cache_hit_on_rank0_only, str(tmp_path), timeout=500)
    finally:
        rank_pool_2.run(_set_inductor_cache_dir, os.environ.get("TORCHINDUCTOR_CACHE_DIR"), timeout=60)
    r0, r1 = results
    assert r0[1]["out"] == r1[1]["out"] == r0[2]["out"] == r1[2]["out"] == 28.0
    assert r0[2]["hooks_ran"] == 0, "rank 0 should have hit its compile cache in round 2"
    assert r1[2]["hooks_ran"] > 0
    assert r0[2]["verdicts"] == r1[2]["verdicts"] == ["compiled"]


@pytest.mark.multirank
@pytest.mark.slow(reason="compiles four small programs on 4 gloo ranks with the agreement exchange")
def test_agreement_on_4_ranks_by_group_membership(rank_pool_4):
    ok = rank_pool_4.run(agreement_on_a_2x2_mesh, False, timeout=300)
    assert [r["verdicts"] for r in ok] == [[("compiled", None)]] * 4, ok
    assert ok[0]["tp_group"] != ok[2]["tp_group"]  # the two TP groups are named differently
    # (x0*2 + x1*2 + 1) summed over the DP pair: ranks {0,1} -> 2+1 = 3, ranks {2,3} -> 10+1 = 11; 3+11 = 14 per element
    assert all(r["out"] == 28.0 for r in ok), ok
    planted = rank_pool_4.run(agreement_on_a_2x2_mesh, True, timeout=300)
    for r in planted:  # every rank falls back, linked to the difference through a shared group
        assert r["out"] == 28.0 and r["verdicts"][0][0] == "fallback", r
        assert "rank 3 issues reduce_scatter(float32" in r["verdicts"][0][1], r
    assert sum(len(r["warnings"]) for r in planted) == 1
    stages = rank_pool_4.run(agreement_on_two_pipeline_stages, timeout=300)
    assert [r["verdicts"] for r in stages] == [[("compiled", None)]] * 4, stages
    moe = rank_pool_4.run(agreement_on_a_dropless_moe, timeout=600)
    assert all(len(r["losses"]) == 2 and min(r["losses"]) > 0 for r in moe), moe
    assert any("u" in s for r in moe for s in r["a2a_shapes"]), moe  # the sizes really were data-dependent
    assert all(set(r["verdicts"]) == {"compiled"} for r in moe), moe
