"""NCCL log / kernel trace alignment (commfuse.trace).

Single-process and fast: parsers on the format fixtures (tests/fixtures/alignment, real NCCL
2.26 / Kineto / Nsight line and schema formats, including malformed and truncated lines),
the Needleman–Wunsch programme against brute force and an unoptimised reference DP, the
thesis's hand-made alignment cases, de-duplication, communicator mapping, clock sync, the
enriched trace, the CLI, and F1 per scenario on the sequences recorded from the example
models (thresholds: the NCCL-trace thesis's Table 4.5).
"""

from __future__ import annotations

import json
import random
import sqlite3
import warnings
from pathlib import Path

import numpy as np
import pytest

from commfuse.core.errors import ConfigError
from commfuse.trace import nw
from commfuse.trace.align import (
    AlignConfig,
    GapRule,
    LogicalComm,
    RankAlignment,
    align_rank,
    align_run,
    align_sequences,
    assign_global_ranks,
    launches,
    map_communicators,
    pair_scores,
    synchronize_clocks,
)
from commfuse.trace.enrich import enriched_trace, load_topology, message_bytes
from commfuse.trace.kernel_trace import (
    KernelRecord,
    KernelTrace,
    parse_kernel_name,
    read_nsys_sqlite,
    read_torch_trace,
)
from commfuse.trace.nccl_log import (
    CommInit,
    NcclCall,
    NcclProcessLog,
    TraceParseWarning,
    parse_nccl_log,
    parse_nccl_logs,
)
from commfuse.trace.perturb import SCENARIOS, THESIS_F1, perturb, run_scenario, write_view
from commfuse.trace.synth import FIXTURE_DIR, SynthConfig, load_sequences, render_log, synthesize

FIX = Path(__file__).parent / "fixtures" / "alignment"
LOG = FIX / "nccl_node-1.log"


def _quiet_parse(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceParseWarning)
        return parse_nccl_log(path)


@pytest.fixture(scope="module")
def fixture_logs():
    return {lg.pid: lg for lg in _quiet_parse(LOG)}


@pytest.fixture()
def nsys_file(tmp_path):
    p = tmp_path / "rank1.sqlite"
    con = sqlite3.connect(p)
    with open(FIX / "nsys_rank1.sql") as f:
        con.executescript(f.read())
    con.close()
    return p


# ----------------------------------------------------------------------------- NCCL log parser


def test_log_splits_processes_and_reads_every_call_line(fixture_logs):
    assert set(fixture_logs) == {1234, 1235}
    p0, p1 = fixture_logs[1234], fixture_logs[1235]
    assert p0.host == "node-1" and p0.device == 0 and p1.device == 1
    assert p0.version == "2.26.2+cuda12.8"  # the version line has no prefix: applied file-wide
    assert [(c.op, c.op_count) for c in p0.calls] == [
        ("AllReduce", 0),
        ("AllGather", 1),
        ("ReduceScatter", 2),
        ("Send", 3),
        ("Recv", 3),
        ("Broadcast", 4),
        ("AllReduce", 5),
        ("AllReduce", 5),
        ("AllReduce", 8),
    ]  # opCount 8: behind a Ray prefix
    ar = p0.calls[0]
    assert (ar.count, ar.dtype, ar.type_size, ar.bytes, ar.reduce_op, ar.comm, ar.nranks, ar.stream) == (
        131072,
        "f16",
        2,
        262144,
        "sum",
        "0x55e290bd32d0",
        2,
        "0x32dc6760",
    )
    assert ar.time_us == pytest.approx(1766081276.800000e6, abs=1.0)
    assert p0.calls[2].reduce_op == "avg" and p0.calls[1].dtype == "bf16"
    assert p0.calls[3].root == 1 and p0.calls[3].recvbuff == "(nil)"


def test_log_attaches_both_generations_of_tuning_lines(fixture_logs):
    c = fixture_logs[1234].calls
    assert (c[0].algo, c[0].proto, c[0].channels) == (
        "RING",
        "LL",
        (0, 1),
    )  # "Algo RING proto LL channel{..}"
    assert (c[1].algo, c[1].proto) == ("RING", "SIMPLE")  # "8388608 Bytes -> Algo 1 proto 2" (per-rank bytes)
    assert (c[2].algo, c[2].proto) == ("RING", "SIMPLE")  # no op prefix, total bytes = count x size x nranks
    assert (c[5].algo, c[5].proto, c[5].channels) == ("RING", "SIMPLE", (0, 0))  # "... comm 0x..." variant
    assert c[7].algo == "TREE"  # attached to the later of two identical lines
    assert all(x.algo is None for x in fixture_logs[1235].calls)  # tuning lines: communicator rank 0 only


def test_log_reads_inits_rings_and_topology(fixture_logs):
    p0, p1 = fixture_logs[1234], fixture_logs[1235]
    i0 = p0.inits["0x55e290bd32d0"]
    assert (i0.rank, i0.nranks, i0.cuda_dev, i0.bus_id, i0.comm_id, i0.complete) == (
        0,
        2,
        0,
        "18000",
        "0x5ae77eb5ea4ec1ee",
        True,
    )
    assert i0.rings == [[0, 1], [0, 1]] and i0.coll_channels == 2
    assert p1.inits["0x55fca23fc0f0"].rank == 1 and p0.world_rank() == 0 and p1.world_rank() == 1
    assert len(p0.inits) == 1  # "comm 0x... rank 0 nRanks 2 nNodes 1 ..." is not an init line
    t = p0.topology
    assert (t.max_bw_GBps, t.total_bw_GBps) == (24.0, 264.0)
    assert t.gpus == {"GPU/0-18000": 0, "GPU/0-2a000": 1}
    assert t.intra_node_GBps == 264.0 and t.network_GBps == 12.5
    assert ("GPU/0-18000", "GPU/0-2a000", "NVL", 264.0) in {
        (lk.src, lk.dst, lk.kind, lk.bandwidth_GBps) for lk in t.links
    }
    assert p1.topology is None


def test_malformed_and_truncated_lines_are_skipped_with_one_warning():
    with pytest.warns(TraceParseWarning, match=r"skipped 4 malformed or truncated line\(s\)") as rec:
        logs = parse_nccl_log(LOG)
    assert len(rec) == 1
    skipped = {(s.line, s.reason) for lg in logs for s in lg.skipped}
    assert skipped == {
        (50, "malformed call line"),
        (51, "unknown datatype code 42"),
        (52, "unknown algorithm/protocol in tuning line"),
        (56, "truncated line"),
    }


def test_log_parser_never_crashes_on_mutilated_lines(tmp_path):
    good = LOG.read_text().splitlines()
    rng = random.Random(7)
    lines = []
    for _ in range(400):
        s = rng.choice(good)
        op = rng.randrange(4)
        if op == 0:
            s = s[: rng.randrange(len(s) + 1)]  # cut anywhere
        elif op == 1:
            s = "".join(ch if not ch.isdigit() or rng.random() > 0.2 else rng.choice("x-.z") for ch in s)
        elif op == 2:
            s = s.replace(" ", "", rng.randrange(3))
        else:
            s = "".join(rng.choice("\x00\xff{}[]():,0x NCCL INFO opCount") for _ in range(rng.randrange(80)))
        lines.append(s)
    p = tmp_path / "garbage.log"
    p.write_bytes("\n".join(lines).encode("utf-8", errors="replace") + b"\xfe\xfe\x00")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceParseWarning)
        logs = parse_nccl_log(p)
        parse_nccl_log(tmp_path / "garbage.log")
    for lg in logs:
        for c in lg.calls:  # whatever survived is well-formed
            assert c.count >= 0 and c.dtype is not None and c.comm.startswith("0x")
    (tmp_path / "empty.log").write_text("")
    assert parse_nccl_log(tmp_path / "empty.log") == []
    with pytest.raises(ConfigError, match="nope.log"):
        parse_nccl_log(tmp_path / "nope.log")


def test_real_issue_lines_parse():
    """Lines as quoted in NVIDIA/nccl #1193 (hex opCount, Ray prefix) and #584 (p2p)."""
    lines = [
        "(RayTrainWorker pid=615, ip=10.72.7.6) r24-02-22-23-29-0066-raycluster-lv52c-worker-l4-8-fqztx:615:18953 "
        "[2] NCCL INFO AllReduce: opCount 139d sendbuff 0x78d056200000 recvbuff 0x78d056200000 count 7382228 "
        "datatype 7 op 0 root 0 comm 0x78cfda045840 [nranks=128] stream 0x78d07125e5e0",
        "ubuntu:199574:201142 [1] NCCL INFO Send: opCount d60 sendbuff 0x7f50e6f3c000 recvbuff (nil) count "
        "2420736 datatype 7 op 0 root 0 comm 0x7f516c002e10 [nranks=2] stream 0x55f1de7279a0",
    ]
    logs = {lg.host[:6]: lg for lg in parse_nccl_log(lines, name="issues")}
    assert logs["r24-02"].calls[0].op_count == 0x139D and logs["r24-02"].calls[0].nranks == 128
    assert logs["r24-02"].device == 2
    assert (logs["ubuntu"].calls[0].op, logs["ubuntu"].calls[0].op_count) == ("Send", 0xD60)


# ----------------------------------------------------------------------------- kernel traces


@pytest.mark.parametrize(
    "name,expected",
    [
        (
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            ("AllReduce", "f32", "RING", "LL"),
        ),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_TREE_LL", ("ReduceScatter", "bf16", "TREE", "LL")),
        (
            "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<(unsigned long)4096>)",
            ("AllGather", None, "RING", "LL"),
        ),
        (
            "ncclDevKernel_AllReduce_Sum_u32_COLLNET_DIRECT_SIMPLE",
            ("AllReduce", "u32", "COLLNET_DIRECT", "SIMPLE"),
        ),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", ("SendRecv", None, None, None)),
        ("ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)", (None, None, None, None)),
        (
            "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
            ("AllReduce", "f32", "RING", "LL"),
        ),
        (
            "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
            ("SendRecv", "i8", "RING", "SIMPLE"),
        ),
        ("ncclAllReduceRingLLKernel_sum_f32(CollectiveArgs)", ("AllReduce", "f32", "RING", "LL")),
    ],
)
def test_kernel_names(name, expected):
    kn = parse_kernel_name(name)
    assert (kn.op, kn.dtype, kn.algo, kn.proto) == expected


def test_kernel_names_not_nccl():
    assert parse_kernel_name("ampere_sgemm_128x64_tn") is None
    assert parse_kernel_name("void at::native::vectorized_elementwise_kernel<4>") is None


def test_torch_trace_reader():
    with pytest.warns(TraceParseWarning, match="skipped 1 malformed event"):
        (t,) = read_torch_trace(FIX / "torch_trace_rank0.json")
    assert (t.rank, t.device, t.absolute, t.format) == (0, 0, True, "torch")
    assert [k.correlation for k in t.kernels] == list(range(101, 110))  # the GEMM is not NCCL's
    k = t.kernels[0]
    assert (k.op, k.dtype, k.in_nelems, k.stream, k.grid) == ("AllReduce", "f16", 131072, 47, (2, 1, 1))
    assert k.start_ns == 1766081276800040000 and k.duration_ns == 35000
    assert k.launch_ns == 1766081276800012000  # from the cuda_runtime event of the same correlation
    assert t.kernels[1].dtype == "bf16"  # AllGather kernels carry no type: taken from the metadata
    assert t.kernels[7].op is None  # ncclDevKernel_Generic


def test_nsys_reader(nsys_file, tmp_path):
    with pytest.warns(TraceParseWarning, match="skipped 1 malformed kernel row"):
        (t,) = read_nsys_sqlite(nsys_file)
    assert (t.pid, t.device, t.absolute, t.format) == (1235, 1, True, "nsys")
    assert [k.correlation for k in t.kernels] == [201, 202, 203, 204, 205, 206, 209]
    k = t.kernels[0]
    assert k.start_ns == 1766081276800043000 and k.launch_ns == 1766081276800015000
    assert (k.op, k.dtype, k.block) == ("AllReduce", "f16", (544, 1, 1))
    bad = tmp_path / "other.sqlite"
    sqlite3.connect(bad).execute("CREATE TABLE x (a)").connection.close()
    with pytest.raises(ConfigError, match="CUPTI_ACTIVITY_KIND_KERNEL"):
        read_nsys_sqlite(bad)
    (tmp_path / "text.sqlite").write_text("not a database")
    with pytest.raises(ConfigError, match="text.sqlite"):
        read_nsys_sqlite(tmp_path / "text.sqlite")
    (tmp_path / "t.json").write_text("{not json")
    with pytest.raises(ConfigError, match="t.json"):
        read_torch_trace(tmp_path / "t.json")


# ----------------------------------------------------------------------------- Needleman-Wunsch


def _alignments(n, m, i=0, j=0):
    if i == n and j == m:
        yield []
        return
    if i < n and j < m:
        for rest in _alignments(n, m, i + 1, j + 1):
            yield [("pair", i, j)] + rest
    if i < n:
        for rest in _alignments(n, m, i + 1, j):
            yield [("log_gap", i)] + rest
    if j < m:
        for rest in _alignments(n, m, i, j + 1):
            yield [("kernel_gap", j)] + rest


def _score(cols, S, comp, penalty, R, bonus, lead=False, trail=False):
    """The scoring rule, written independently of nw.py: per-kind gap runs, saturating at R;
    leading (trailing) gaps -- while the other sequence is not started (is exhausted) -- cost 0
    with ``lead`` (``trail``)."""
    n, m = S.shape
    total, prev, run, i, j = 0.0, None, 0, 0, 0
    for c in cols:
        if c[0] == "pair":
            total += S[c[1], c[2]]
            if prev is not None and prev[0] == "pair" and comp[c[1], c[2]] and comp[prev[1], prev[2]]:
                total += bonus
            i, j = i + 1, j + 1
        else:
            run = run + 1 if prev is not None and prev[0] == c[0] else 0
            other, end = (j, m) if c[0] == "log_gap" else (i, n)
            if not ((lead and other == 0) or (trail and other == end)):
                total -= penalty(min(run, R))
            i, j = (i + 1, j) if c[0] == "log_gap" else (i, j + 1)
        prev = c
    return total


RULES = [
    GapRule(),
    GapRule("constant", 3.0),
    GapRule("geometric", 5.0, 0.3),
    GapRule("table", table=(5, 9.88, 12.844)),
]


def test_nw_is_optimal_against_brute_force():
    rng = random.Random(11)
    for _ in range(250):
        n, m = rng.randint(0, 5), rng.randint(0, 5)
        S = np.array(
            [[rng.choice([5.0, 10.0, -15.0, -7.5, 2.5]) for _ in range(m)] for _ in range(n)]
        ).reshape(n, m)
        comp = S > 0
        rule, R, bonus = rng.choice(RULES), rng.choice([1, 2, 3, 32]), rng.choice([0.0, 1.0, 3.0])
        for lead, trail in ((False, False), (True, True), (False, True), (True, False)):
            best = max(_score(c, S, comp, rule.penalty, R, bonus, lead, trail) for c in _alignments(n, m))
            res = nw.align(
                S, comp, rule.penalty, max_gap_run=R, bonus=bonus, free_leading=lead, free_trailing=trail
            )
            assert res.score == pytest.approx(best, abs=1e-9)
            assert _score(res.columns, S, comp, rule.penalty, R, bonus, lead, trail) == pytest.approx(
                best, abs=1e-9
            )
            assert sorted([i for i, _ in res.pairs] + res.log_gaps) == list(range(n))
            assert sorted([j for _, j in res.pairs] + res.kernel_gaps) == list(range(m))


def _reference(S, comp, penalty, R, bonus):
    """Unoptimised O(n m (n+m)) programme for the same rule (no shift/tail tricks)."""
    n, m = S.shape
    G = nw.gap_costs(penalty, R, max(n, m) + 1)
    X, V, H = (np.full((n + 1, m + 1), -1e18) for _ in range(3))
    X[0, 0] = 0
    for i in range(n + 1):
        for j in range(m + 1):
            if i and j:
                b = X[i - 1, j - 1] + (
                    bonus if comp[i - 1, j - 1] and i > 1 and j > 1 and comp[i - 2, j - 2] else 0
                )
                X[i, j] = max(b, V[i - 1, j - 1], H[i - 1, j - 1]) + S[i - 1, j - 1]
            if i:
                V[i, j] = max(max(X[i - L, j], H[i - L, j]) - G[L] for L in range(1, i + 1))
            if j:
                H[i, j] = max(max(X[i, j - L], V[i, j - L]) - G[L] for L in range(1, j + 1))
    return max(X[n, m], V[n, m], H[n, m])


def test_nw_matches_reference_dp_on_longer_sequences():
    rng = random.Random(5)
    for _ in range(6):
        n, m = rng.randint(15, 30), rng.randint(15, 30)
        S = np.array([[rng.choice([5.0, 10.0, -15.0, 2.5]) for _ in range(m)] for _ in range(n)])
        comp = S > 0
        rule, R, bonus = rng.choice(RULES), rng.choice([1, 2, 4]), rng.choice([0.0, 1.0])
        res = nw.align(S, comp, rule.penalty, max_gap_run=R, bonus=bonus)
        assert res.score == pytest.approx(_reference(S, comp, rule.penalty, R, bonus), abs=1e-6)


def _k(op, t=0):
    return KernelRecord(name=op, op=op, start_ns=t, end_ns=t + 1)


def _c(op, opc, comm="0xa", count=1, dt=7, t=None, pid=1, host="h", dev=0, root=0, nranks=None):
    return NcclCall(
        op=op,
        op_count=opc,
        count=count,
        datatype=dt,
        redop=0,
        root=root,
        comm=comm,
        nranks=nranks,
        stream="0x1",
        sendbuff="0x2",
        recvbuff="0x3",
        host=host,
        pid=pid,
        tid=pid,
        device=dev,
        time_us=t,
        line=opc + 1,
    )


def _align_ops(log_ops, kernel_ops, cfg=None):
    lau = launches([_c(o, i) for i, o in enumerate(log_ops)], dedup=False)
    S, comp = pair_scores(lau, [_k(o) for o in kernel_ops], cfg or AlignConfig.thesis())

    cfg = cfg or AlignConfig.thesis()
    return nw.align(S, comp, cfg.gap.penalty, bonus=cfg.sequence_bonus, free_end_gaps=cfg.free_end_gaps)


def test_thesis_asymmetric_penalty_case():
    """Thesis §4.3.1: a Broadcast kernel never pairs with a Send log line -- two gaps instead."""
    res = _align_ops(
        ["AllReduce", "AllReduce", "Send", "AllReduce"], ["AllReduce", "AllReduce", "Broadcast", "AllReduce"]
    )
    assert res.pairs == [(0, 0), (1, 1), (3, 3)] and res.log_gaps == [2] and res.kernel_gaps == [2]


def test_thesis_false_positive_case():
    """Thesis §4.3.1: four kernels against three similar log segments; the thesis reports them
    matched to segment 2. With end gaps free (semi-global) that is the optimum; under fully global
    Eq. 4.2 scoring -- what the thesis's equations say -- segment 2 costs two runs of 4 gaps
    (2 x 29, score -28) while spreading the matches needs only runs of 1-3 (score -17.5), so the
    thesis's result implies free end gaps, which its text does not mention."""
    log = [
        "AllReduce",
        "AllReduce",
        "AllReduce",
        "ReduceScatter",
        "AllReduce",
        "AllReduce",
        "Broadcast",
        "ReduceScatter",
        "AllReduce",
        "Broadcast",
        "AllReduce",
        "ReduceScatter",
    ]
    kernels = ["AllReduce", "AllReduce", "Broadcast", "ReduceScatter"]
    res = _align_ops(log, kernels, AlignConfig.thesis(free_end_gaps=True))
    assert [i for i, _ in res.pairs] == [4, 5, 6, 7] and res.score == pytest.approx(5 * (1 + 1 + 2 + 2))
    res = _align_ops(log, kernels)
    assert res.pairs == [(2, 0), (5, 1), (9, 2), (11, 3)] and res.score == pytest.approx(-17.5)
    segment2 = (
        [("log_gap", i) for i in range(4)]
        + [("pair", 4 + j, j) for j in range(4)]
        + [("log_gap", i) for i in range(8, 12)]
    )
    assert _score(segment2, *_thesis_matrices(log, kernels)) == pytest.approx(-28)


def _thesis_matrices(log_ops, kernel_ops):
    cfg = AlignConfig.thesis()
    S, comp = pair_scores(
        launches([_c(o, i) for i, o in enumerate(log_ops)], dedup=False), [_k(o) for o in kernel_ops], cfg
    )
    return S, comp, cfg.gap.penalty, cfg.max_gap_run, 0.0


def test_thesis_consecutive_duplicates_case():
    """Thesis §4.3.1: every log op twice, kernels once -> all 5 kernels matched, 50% of the log skipped
    (without de-duplication; with it the duplicates collapse first)."""
    ops = ["AllReduce", "Broadcast", "AllGather", "ReduceScatter", "AllReduce"]
    res = _align_ops([o for o in ops for _ in range(2)], ops)
    assert len(res.pairs) == 5 and len(res.log_gaps) == 5
    assert all(2 * j <= i <= 2 * j + 1 for i, j in res.pairs)
    calls = [_c(o, i) for i, o in enumerate(ops) for _ in range(2)]
    assert [lau.symbol for lau in launches(calls)] == ops


def test_thesis_sequence_bonus_case():
    ops = ["AllReduce"] * 5 + ["Broadcast"] + ["ReduceScatter"] * 3
    res = _align_ops(ops, ops, AlignConfig.thesis(sequence_bonus=1.0))
    assert res.pairs == [(i, i) for i in range(9)]


def test_thesis_adaptive_gap_case():
    """Thesis §4.3.1: kernels [AR x5], log [AR, Broadcast, Send, Recv, AR x3]. With the flat -15
    mismatch the test text uses, the optimum has no mismatch and breaks the run of three log gaps
    with the kernel gap it needs anyway (runs <= 2, as the thesis reports). Under its own Eq. 4.1/4.3
    weights, though, a Send-AllReduce mismatch costs only 15 x (1 + 0.5)/2 = 11.25, less than a
    second gap, and the optimum takes one: another inconsistency of the thesis (docs/alignment.md)."""
    log, kernels = (
        ["AllReduce", "Broadcast", "Send", "Recv", "AllReduce", "AllReduce", "AllReduce"],
        ["AllReduce"] * 5,
    )

    def max_run(cols):
        best, cur, prev = 0, 0, None
        for c in cols:
            cur = cur + 1 if c[0] != "pair" and c[0] == prev else (1 if c[0] != "pair" else 0)
            best, prev = max(best, cur), c[0]
        return best

    flat = AlignConfig.thesis(weights={}, default_weight=1.0)
    res = _align_ops(log, kernels, flat)
    S, comp = pair_scores(
        launches([_c(o, i) for i, o in enumerate(log)], dedup=False), [_k(o) for o in kernels], flat
    )
    assert all(comp[i, j] for i, j in res.pairs) and len(res.pairs) == 4 and max_run(res.columns) <= 2
    res = _align_ops(log, kernels)
    assert sum(1 for i, _ in res.pairs if log[i] != "AllReduce") == 1 and res.score == pytest.approx(-1.25)
    # The thesis's quoted gap costs (-5, -9.88, -12.844) follow neither Eq. 4.2 nor x1.3:
    assert [GapRule().penalty(r) for r in range(3)] == [5.0, 6.5, 8.0]
    assert GapRule("geometric").penalty(2) == pytest.approx(8.45)
    assert GapRule("table", table=(5, 9.88, 12.844)).penalty(2) == 12.844


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="GapRule.kind"):
        GapRule("linear")
    with pytest.raises(ConfigError, match="GapRule.table"):
        GapRule("table")
    with pytest.raises(ConfigError, match="AlignConfig.max_gap_run"):
        AlignConfig(max_gap_run=0)
    with pytest.raises(ConfigError, match="AlignConfig.match"):
        AlignConfig(match=0)
    with pytest.raises(ConfigError, match="sync_point"):
        synchronize_clocks([], map_communicators([]), sync_point="middle")


# ----------------------------------------------------------------------------- de-dup, comms, clocks


def test_dedup_by_comm_and_opcount():
    calls = [
        _c("Send", 0),
        _c("Recv", 0),
        _c("Send", 0, root=1),
        _c("Recv", 0, root=1),  # one p2p group
        _c("AllGather", 1),
        _c("ReduceScatter", 1),  # a grouped launch of two collectives
        _c("AllReduce", 2),
        _c("AllReduce", 2),  # a line logged twice
        _c("AllReduce", 2, comm="0xb"),  # same opCount, another communicator
        _c("AllReduce", 0),
    ]  # opCount back to 0 on 0xa: a new communicator at the same address
    lau = launches(calls)
    assert [(a.symbol, a.comm, a.op_count, a.epoch, len(a.calls)) for a in lau] == [
        ("SendRecv", "0xa", 0, 0, 4),
        ("Mixed", "0xa", 1, 0, 2),
        ("AllReduce", "0xa", 2, 0, 1),
        ("AllReduce", "0xb", 2, 0, 1),
        ("AllReduce", "0xa", 0, 1, 1),
    ]
    assert len(launches(calls, dedup=False)) == len(calls)
    S, comp = pair_scores(
        lau[:2], [_k("SendRecv"), _k("ReduceScatter"), _k("AllReduce")], AlignConfig.thesis()
    )
    assert comp.tolist() == [[True, False, False], [False, True, False]]


def _proc(host, pid, dev, comm, ops, *, comm_id=None, rank=None, nranks=None, counts=None):
    lg = NcclProcessLog(host, pid, "t", devices={dev})
    lg.calls = [
        _c(o, i, comm=comm, count=(counts or {}).get(i, 8), pid=pid, host=host, dev=dev, nranks=nranks)
        for i, o in enumerate(ops)
    ]
    if rank is not None:
        lg.inits[comm] = CommInit(comm, rank, nranks, host, pid, comm_id=comm_id, complete=True)
    return lg


def test_comm_mapping_by_comm_id_signature_and_similarity():
    tp = ["AllReduce", "AllGather", "AllReduce", "ReduceScatter"] * 5
    # two TP groups of 2 with identical sequences and no commId: grouped in rank order, with a note
    logs = [_proc("a", 10 + r, r, f"0x{r}", tp, nranks=2) for r in range(4)]
    cm = map_communicators(logs)
    assert sorted(lc.ranks for lc in cm.comms) == [(0, 1), (2, 3)]
    assert any("ambiguous" in n for n in cm.notes)
    assert assign_global_ranks(logs) == {("a", 10): 0, ("a", 11): 1, ("a", 12): 2, ("a", 13): 3}  # Eq. 4.6
    # with commIds the grouping is exact, whatever the ranks
    ids = ["0xaa", "0xbb", "0xbb", "0xaa"]
    logs = [_proc("a", 10 + r, r, f"0x{r}", tp, comm_id=ids[r], rank=r // 2, nranks=2) for r in range(4)]
    logs[0].inits["0xw"] = CommInit(
        "0xw", 0, 4, "a", 10, comm_id="0xcc", complete=True
    )  # the world gives ranks
    for r in range(1, 4):
        logs[r].inits["0xw"] = CommInit("0xw", r, 4, "a", 10 + r, comm_id="0xcc", complete=True)
    cm = map_communicators(logs)
    got = {lc.comm_id: lc.ranks for lc in cm.comms}
    assert got == {"0xaa": (0, 3), "0xbb": (1, 2), "0xcc": (0, 1, 2, 3)} and cm.comms[0].by == "commId"
    # a rank whose log lost lines still joins its group by similarity
    dp = ["AllReduce"] * 30
    logs = [
        _proc("a", 20 + r, r, f"0xd{r}", dp, nranks=3, counts={i: 100 + i for i in range(30)})
        for r in range(3)
    ]
    logs[2].calls = [c for i, c in enumerate(logs[2].calls) if i % 7 != 3]
    cm = map_communicators(logs)
    assert [lc.ranks for lc in cm.comms] == [(0, 1, 2)] and cm.comms[0].by == "similarity"


def _fake_alignment(rank, comm, ends_ns, starts_ns):
    lg = NcclProcessLog("h", 100 + rank, "t", devices={rank})
    lg.calls = [_c("AllReduce", i, comm=comm, pid=100 + rank) for i in range(len(ends_ns))]
    lau = launches(lg.calls)
    ks = [
        KernelRecord("AllReduce", "AllReduce", int(s), int(e))
        for s, e in zip(starts_ns, ends_ns, strict=True)
    ]
    return RankAlignment(
        rank, lau, ks, [(i, i) for i in range(len(ks))], [True] * len(ks), 0.0, None, log=lg
    ), lg


def test_clock_sync_recovers_offsets_within_200ns():
    """Thesis §4.3.3: ranks shifted by 0, +50 ms, -30 ms are re-aligned to < 200 ns. Kernels end
    together (the collective completes everywhere) but start with arrival skew of up to 40 us."""
    rng = random.Random(3)
    shifts = {0: 0.0, 1: 50e6, 2: -30e6}
    n = 40
    ends = [1e9 + 1e6 * i for i in range(n)]
    ras, logs = [], []
    for r, sh in shifts.items():
        starts = [e - 20_000 - rng.uniform(0, 40_000) + sh for e in ends]
        ra, lg = _fake_alignment(r, f"0x{r}", [e + sh + rng.uniform(-50, 50) for e in ends], starts)
        ras.append(ra)
        logs.append(lg)
    for lg, r in zip(logs, shifts, strict=True):
        lg.inits[f"0x{r}"] = CommInit(f"0x{r}", r, 3, "h", 100 + r, comm_id="0xc", complete=True)
    cm = map_communicators(logs)
    off = synchronize_clocks(ras, cm)
    for r, sh in shifts.items():
        assert abs(off[r] + sh) < 200, (r, off[r])
    off_start = synchronize_clocks(ras, cm, sync_point="start")
    assert max(abs(off_start[r] + sh) for r, sh in shifts.items()) > 1000  # starts carry the arrival skew


def test_clock_sync_chains_ranks_through_shared_communicators():
    # rank 2 shares no communicator with rank 0, only with rank 1
    e = [1e9 + 1e6 * i for i in range(20)]
    pairs = {0: ("0xa", 0.0), 1: ("0xa", 7e6), 2: ("0xb", -3e6), 3: ("0xb", 0.0)}
    ras, logs = [], []
    for r, (comm, sh) in pairs.items():
        ra, lg = _fake_alignment(r, comm, [x + sh for x in e], [x + sh - 5000 for x in e])
        lg.inits[comm] = CommInit(comm, r % 2, 2, "h", 100 + r, comm_id=comm, complete=True)
        ras.append(ra)
        logs.append(lg)
    # rank 1 also in group b with rank 2: add a second communicator to ranks 1 and 2
    for r, sh in ((1, 7e6), (2, -3e6)):
        lg = logs[r]
        more = [_c("AllGather", i, comm="0xc", pid=100 + r) for i in range(10)]
        lg.calls += more
        lg.inits["0xc"] = CommInit("0xc", r - 1, 2, "h", 100 + r, comm_id="0xc", complete=True)
        ra = ras[r]
        base = len(ra.launches)
        ra.launches += launches(more)
        for k, lau in enumerate(ra.launches[base:]):
            lau.index = base + k
            t = 5e9 + 1e6 * k + sh
            ra.kernels.append(KernelRecord("AllGather", "AllGather", int(t - 1000), int(t)))
            ra.pairs.append((base + k, len(ra.kernels) - 1))
            ra.matched.append(True)
    off = synchronize_clocks(ras, map_communicators(logs))
    assert off[1] == pytest.approx(-7e6, abs=1) and off[2] == pytest.approx(3e6, abs=1)


# ----------------------------------------------------------------------------- end to end on the fixtures


@pytest.fixture()
def fixture_run(nsys_file):
    import shutil

    shutil.copy(FIX / "torch_trace_rank0.json", nsys_file.parent / "torch_trace_rank0.json")
    from commfuse.trace.kernel_trace import read_kernel_traces

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceParseWarning)
        logs = parse_nccl_logs([LOG])
        traces = read_kernel_traces(nsys_file.parent)
    return align_run(logs, traces)


def test_fixture_alignment_end_to_end(fixture_run):
    run = fixture_run
    by_rank = {ra.rank: ra for ra in run.ranks}
    assert set(by_rank) == {0, 1}
    got0 = [(by_rank[0].launches[i].op_count, by_rank[0].kernels[j].correlation) for i, j in by_rank[0].pairs]
    assert got0 == [
        (0, 101),
        (1, 102),
        (2, 103),
        (3, 104),
        (4, 105),
        (5, 106),
        (8, 109),
    ]  # 107/108: no log line
    got1 = [(by_rank[1].launches[i].op_count, by_rank[1].kernels[j].correlation) for i, j in by_rank[1].pairs]
    assert got1 == [(0, 201), (1, 202), (2, 203), (3, 204), (4, 205), (5, 206), (8, 209)]
    assert all(by_rank[r].matched for r in (0, 1)) and by_rank[0].offset_from == "launch"
    assert [lc.ranks for lc in run.comm_map.comms] == [(0, 1)] and run.comm_map.comms[0].by == "commId"
    assert abs(run.offsets_ns[1]) < 1000  # one host, one clock


def test_enriched_trace_fields(fixture_run):
    doc = enriched_trace(fixture_run)
    ev = [e for e in doc["traceEvents"] if e.get("cat") == "nccl"]
    ag = next(e for e in ev if e["pid"] == 1 and e["name"] == "AllGather")["args"]
    # nccl-tests size of an all_gather: the whole output, count x sizeof(bf16) x nranks
    assert ag["message_bytes"] == 2097152 * 2 * 2 and ag["bus_factor"] == 0.5
    assert ag["algbw_GBps"] == pytest.approx(8388608 / 117.0 / 1e3, rel=1e-3)  # rank 1's kernel: 117 us
    assert ag["busbw_GBps"] == pytest.approx(ag["algbw_GBps"] * 0.5, rel=1e-3)
    assert ag["peak_busbw_GBps"] == 264.0 and ag["peak_from"] == "NCCL log: slowest GPU link"
    assert ag["efficiency_pct"] == pytest.approx(100 * ag["busbw_GBps"] / 264.0, rel=1e-3)
    assert (ag["algorithm"], ag["protocol"], ag["tuning_from"]) == (
        "RING",
        "SIMPLE",
        "the communicator's rank 0",
    )
    ar = next(e for e in ev if e["pid"] == 0 and e["args"]["opCount"] == "0")["args"]
    assert (ar["message_bytes"], ar["bus_factor"], ar["channels"], ar["datatype"]) == (
        262144,
        1.0,
        [0, 1],
        "f16",
    )
    unaligned = [e["args"]["correlation"] for e in doc["traceEvents"] if e.get("cat") == "nccl,unaligned"]
    assert sorted(unaligned) == [107, 108]
    doc = enriched_trace(fixture_run, load_topology("dgx-h100"))
    ar = next(e for e in doc["traceEvents"] if e.get("cat") == "nccl")["args"]
    assert ar["peak_busbw_GBps"] == 370.0 and ar["peak_from"].startswith("topology dgx-h100")


def test_two_streams_align_in_launch_order():
    """Two communicators: the second's kernel *starts* first (its stream was free), but the host
    launched them in log order -- alignment follows the launch calls."""
    t0 = 1_766_081_276_000_000.0
    calls = [
        _c("AllReduce", 0, comm="0xa", count=64, t=t0),
        _c("AllGather", 0, comm="0xb", count=8, t=t0 + 30),
        _c("AllReduce", 1, comm="0xa", count=64, t=t0 + 60),
        _c("AllGather", 1, comm="0xb", count=8, t=t0 + 90),
    ]
    lg = NcclProcessLog("h", 1, "t", calls=calls)
    starts = [t0 + 500, t0 + 40, t0 + 900, t0 + 100]  # the AllGathers start before the AllReduces
    ks = [
        KernelRecord(op, op, int(s * 1e3), int(s * 1e3) + 5000, launch_ns=int((t + 4) * 1e3), correlation=c)
        for c, (op, s, t) in enumerate(
            zip(["AllReduce", "AllGather"] * 2, starts, [c.time_us for c in calls], strict=True)
        )
    ]
    ra = align_rank(lg, KernelTrace("x", ks, absolute=True))
    assert [
        (ra.launches[i].op_count, ra.launches[i].comm, ra.kernels[j].correlation) for i, j in ra.pairs
    ] == [(0, "0xa", 0), (0, "0xb", 1), (1, "0xa", 2), (1, "0xb", 3)]
    assert ra.offset_from == "launch"
    whole_seconds = [_c(c.op, c.op_count, comm=c.comm, count=c.count, t=t0) for c in calls]
    assert (
        align_rank(NcclProcessLog("h", 1, "t", calls=whole_seconds), KernelTrace("x", ks)).offset_from
        == "coarse"
    )


def test_message_bytes_conventions():
    assert message_bytes(launches([_c("ReduceScatter", 0, count=10, dt=9)])[0], 4) == 10 * 2 * 4
    assert message_bytes(launches([_c("AllReduce", 0, count=10, dt=8)])[0], 4) == 80
    assert message_bytes(launches([_c("Send", 0, count=10), _c("Recv", 0, count=99)])[0], 2) == 40


def test_cli(tmp_path, nsys_file):
    import shutil

    from commfuse.__main__ import main

    shutil.copy(FIX / "torch_trace_rank0.json", nsys_file.parent)
    out = tmp_path / "enriched.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceParseWarning)
        assert main(["align", str(LOG), str(nsys_file.parent), "-o", str(out), "--topology", "dgx-h100"]) == 0
        assert main(["align", str(LOG), str(nsys_file.parent), "-o", str(out), "--thesis"]) == 0
        assert main(["align", str(tmp_path / "missing"), str(nsys_file.parent), "-o", str(out)]) == 2
        assert main(["align", str(LOG), str(nsys_file.parent), "-o", str(out), "--topology", "nope"]) == 2
    assert json.loads(out.read_text())["otherData"]["commfuse_alignment"]["communicators"][0]["ranks"] == [
        0,
        1,
    ]


# ----------------------------------------------------------------------------- fixtures from the example models


def test_recorded_sequences_fixture():
    doc = load_sequences()
    assert doc["world_size"] == 4 and doc["baseline"] == "commfuse-eager:none"
    assert set(doc["models"]) == {"simple_fsdp:s", "llama_tp_sp:s", "dp:s", "moe_ep:s"}
    for m, rec in doc["models"].items():
        assert len(rec["ranks"]) == 4 and all(len(r) >= 200 for r in rec["ranks"]), m
        kinds = {o[0] for o in rec["ranks"][0]}
        assert kinds <= {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}, (m, kinds)
    assert FIXTURE_DIR == FIX.resolve()


def test_synth_and_perturb_are_seeded():
    run = synthesize("moe_ep:s")
    again = synthesize("moe_ep:s")
    _, v1 = perturb(run, SCENARIOS["both_drop_20"], seed=1)
    _, v2 = perturb(again, SCENARIOS["both_drop_20"], seed=1)
    _, v3 = perturb(run, SCENARIOS["both_drop_20"], seed=2)
    assert render_log(run, 0, v1[0].items) == render_log(again, 0, v2[0].items)
    assert [lau.kernel.start_ns for lau in run.ranks[1].launches] == [
        lau.kernel.start_ns for lau in again.ranks[1].launches
    ]
    assert v1[0].truth != v3[0].truth
    n = len(run.ranks[0].launches)
    kept = sum(1 for v in v1 for _ in v.truth) / (4 * n)
    assert 0.5 < kept < 0.75  # both sides keep ~80%: ~64% of the launches are on both
    prun, views = perturb(run, SCENARIOS["fused_p2p"], seed=0)
    assert len(prun.ranks[0].launches) == n + 20  # start-up calls
    assert any(u is None for u in views[0].kernel_uid.values())  # unlogged SendRecv kernels


def test_written_views_are_real_formats(tmp_path):
    run = synthesize("llama_tp_sp:s", cfg=SynthConfig(seed=3))
    prun, views = perturb(run, SCENARIOS["1:1"], seed=3)
    logs_dir, traces_dir = write_view(prun, views, tmp_path, "torch")
    (lg,) = parse_nccl_log(logs_dir / "rank2.log")
    assert lg.world_rank() == 2 and len(lg.calls) == len(run.ranks[2].launches)
    assert lg.topology is not None and lg.topology.intra_node_GBps == 370.8
    (t,) = read_torch_trace(traces_dir / "rank2.json")
    assert t.rank == 2 and len(t.kernels) == len(run.ranks[2].launches)
    assert all(k.launch_ns is not None and k.launch_ns < k.start_ns for k in t.kernels)


MODELS = ("simple_fsdp:s", "llama_tp_sp:s", "dp:s", "moe_ep:s")


@pytest.fixture(scope="module")
def synth_runs():
    doc = load_sequences()
    return {m: synthesize(m, doc) for m in MODELS}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_f1_per_scenario_meets_the_thesis(synth_runs, scenario):
    """commfuse's default alignment on every example model, nsys traces: F1 >= the thesis's
    Table 4.5 numbers (1:1 0.988, kernel drops 0.912, log drops 0.868, both 0.805); the two extra
    scenarios >= 0.95. Clock sync within 1 us of the synthesised offsets."""
    floor = THESIS_F1.get(scenario, 0.95)
    for m, run in synth_runs.items():
        r = run_scenario(run, scenario, AlignConfig(), trace_format="nsys")
        assert r.counts.f1 >= floor, (m, scenario, r.to_json())
        assert r.clock_error_us is not None and r.clock_error_us < 1.0, (m, scenario, r.clock_error_us)


def test_f1_torch_profiler_metadata_without_timing(synth_runs):
    """No timing evidence at all: the element counts recent PyTorch puts on NCCL kernels still beat
    the thesis's scoring on the repetitive example sequences."""
    run = synth_runs["simple_fsdp:s"]
    with_meta = run_scenario(run, "kernel_drop_20", AlignConfig(use_timing=False), trace_format="torch")
    thesis = run_scenario(run, "kernel_drop_20", AlignConfig.thesis(), trace_format="torch")
    assert with_meta.counts.f1 > thesis.counts.f1 + 0.2


def test_long_runs_are_aligned_in_windows(synth_runs, tmp_path):
    """Above max_cells the alignment runs in overlapping windows; on the fixtures it loses (almost)
    nothing against the exact programme."""
    run = synth_runs["simple_fsdp:s"]
    full = run_scenario(run, "both_drop_20", AlignConfig(), trace_format="nsys")
    windowed = run_scenario(run, "both_drop_20", AlignConfig(max_cells=10_000), trace_format="nsys")
    assert windowed.counts.f1 >= full.counts.f1 - 0.01 and windowed.counts.f1 >= THESIS_F1["both_drop_20"]
    lau = launches([_c("AllReduce", i) for i in range(300)])
    kernels = [_k("AllReduce") for _ in range(300)]
    pairs, matched, _ = align_sequences(lau, kernels, AlignConfig.thesis(max_cells=10_000))
    assert pairs == [(i, i) for i in range(300)] and all(matched)


def test_thesis_scoring_on_1to1_is_exact(synth_runs):
    r = run_scenario(synth_runs["dp:s"], "1:1", AlignConfig.thesis(), trace_format="nsys")
    assert r.counts.f1 == 1.0


def test_logical_comm_members_are_ranks():
    lc = LogicalComm("c", 2, {3: ("h", 1, "0x1"), 1: ("h", 2, "0x2")})
    assert lc.ranks == (1, 3)
    assert isinstance(KernelTrace("x", []).kernels, list)
    assert align_rank(NcclProcessLog("h", 1, "t"), KernelTrace("x", [])).pairs == []
