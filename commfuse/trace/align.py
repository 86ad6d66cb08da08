"""Per-rank alignment of NCCL log calls with NCCL kernels, and the whole run (`align_run`).

Contract
- Works on *launches* (`commfuse.trace.launches`: calls merged by (communicator, opCount)).
- **Alignment** (`align_rank`): the launches of one process and the kernels of its GPU are
  aligned by the weighted Needleman–Wunsch of the NCCL-trace thesis (§4.2.2) run by
  `commfuse.trace.nw` (exact for its gap rule). Defaults follow the thesis: weights Eq. 4.1
  (AllReduce 1; ReduceScatter, AllGather, Broadcast 2; Send, Recv, SendRecv 0.5; Reduce,
  which the thesis does not list, 2 like the other rooted/rare collectives), match
  ``+5·w`` / mismatch ``-15·(w_a+w_b)/2`` (Eq. 4.3), gap rule Eq. 4.2
  ``g(r) = 5·(1 + 0.3·r)``, no sequence bonus. All of it is configurable (`AlignConfig`,
  `GapRule`); ``AlignConfig.thesis()`` is the thesis's scoring alone.
  Ends of the sequences are charged like any gap unless ``free_end_gaps`` (semi-global).
  On top of the op names, commfuse's default also uses what both sources really carry:
  * ``use_attributes``: a pair whose datatype (kernel name or profiler metadata vs the
    call's ``datatype``), tree-vs-not-tree algorithm (kernel name vs the rank-0 tuning
    line) or element count (torch.profiler metadata vs ``count``) disagrees is a mismatch;
  * ``use_timing``: each kernel's CUDA *launch call* (nsys ``CUPTI_ACTIVITY_KIND_RUNTIME``,
    torch.profiler ``cuda_runtime`` events, joined by correlation id) happens on the host
    microseconds after NCCL logged the launch's last call line, whereas the kernel *start*
    can lag by anything when the host runs ahead of the GPU. The per-rank log->trace clock
    offset is found without any alignment (`estimate_log_offset`); a pair whose launch call
    is more than ``causality_tolerance_us`` before the call line, or further than the
    launch window from it, is a mismatch; other pairs gain up to ``time_weight`` x their
    match score for closeness (``exp(-|residual| / time_scale_us)``). Kernels without a
    launch record only get the causality bound on their start, and only when both clocks
    are absolute (log timestamps, a trace that gave its clock origin).
  A kernel without a known op (``ncclDevKernel_Generic``) may pair with any launch at half
  the match score.
- `align_run` pairs processes with traces (by rank, else pid), aligns each, maps
  communicators and synchronises clocks (`commfuse.trace.comms`).
- Same answer for the same inputs (no randomness, deterministic tie-breaking).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from commfuse.core.errors import ConfigError
from commfuse.trace import nw
from commfuse.trace.comms import (
    SYNC_POINTS,
    CommMap,
    LogicalComm,
    assign_global_ranks,
    map_communicators,
    synchronize_clocks,
)
from commfuse.trace.kernel_trace import KernelRecord, KernelTrace
from commfuse.trace.launches import Launch, launches
from commfuse.trace.nccl_log import NcclProcessLog
from commfuse.trace.vocab import kernel_dtype_class

THESIS_WEIGHTS: dict[str, float] = {
    "AllReduce": 1.0,
    "ReduceScatter": 2.0,
    "AllGather": 2.0,
    "Broadcast": 2.0,
    "Reduce": 2.0,
    "Send": 0.5,
    "Recv": 0.5,
    "SendRecv": 0.5,
}
_REDUCTIONS = ("AllReduce", "ReduceScatter", "Reduce")
GAP_RULES = ("eq42", "constant", "geometric", "table")


@dataclass(frozen=True)
class GapRule:
    """Penalty (a positive cost) of the ``r``-th gap of a run (``r = 0`` for the first).

    * ``eq42`` (default): thesis Eq. 4.2, ``base · (1 + growth · r)`` -- 5, 6.5, 8, ...
    * ``constant``: ``base`` (classic linear gaps).
    * ``geometric``: ``base · (1 + growth)^r`` -- with ``growth = 0.3`` the "×1.3 per gap"
      the thesis's test text names (5, 6.5, 8.45, ...).
    * ``table``: ``table[r]`` (and ``table[-1] · (1 + growth)^(r - len + 1)`` beyond), e.g.
      ``(5, 9.88, 12.844)``, the successive costs the thesis's adaptive-gap test quotes,
      which follow neither rule above (docs/alignment.md).
    """

    kind: str = "eq42"
    base: float = 5.0
    growth: float = 0.3
    table: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in GAP_RULES:
            raise ConfigError(f"GapRule.kind must be one of {GAP_RULES}, got {self.kind!r}")
        if self.base < 0 or self.growth < 0:
            raise ConfigError(f"GapRule.base and GapRule.growth must be >= 0, got {self.base}, {self.growth}")
        if self.kind == "table" and (not self.table or any(t < 0 for t in self.table)):
            raise ConfigError("GapRule.table must list at least one non-negative penalty for kind='table'")

    def penalty(self, r: int) -> float:
        if self.kind == "eq42":
            return self.base * (1.0 + self.growth * r)
        if self.kind == "constant":
            return self.base
        if self.kind == "geometric":
            return self.base * (1.0 + self.growth) ** r
        if r < len(self.table):
            return float(self.table[r])
        return float(self.table[-1]) * (1.0 + self.growth) ** (r - len(self.table) + 1)


@dataclass(frozen=True)
class AlignConfig:
    """Scoring of the per-rank alignment (see the module docstring)."""

    weights: Mapping[str, float] = field(default_factory=lambda: dict(THESIS_WEIGHTS))
    default_weight: float = 1.0
    match: float = 5.0
    mismatch: float = 15.0
    gap: GapRule = field(default_factory=GapRule)
    sequence_bonus: float = 0.0
    max_gap_run: int = 32
    free_end_gaps: bool = False  # semi-global: gaps before/after the other sequence cost nothing
    max_cells: int = 2_000_000  # larger problems are aligned in overlapping windows (align_sequences)
    dedup: bool = True
    use_attributes: bool = True
    use_timing: bool = True
    causality_tolerance_us: float = 20.0
    time_weight: float = 1.0  # closeness bonus, as a fraction of the pair's match score
    time_scale_us: float = 50.0
    # |launch call - call line - offset| beyond this: not its kernel. None: adaptive, 6 robust
    # standard deviations of the residuals in the offset's densest window, clamped to [20 us, 2 ms].
    launch_window_us: Optional[float] = None
    log_kernel_offset_us: Optional[float] = None  # None: estimated per rank (see estimate_log_offset)

    def __post_init__(self) -> None:
        if self.match <= 0:
            raise ConfigError(f"AlignConfig.match must be > 0, got {self.match}")
        if self.mismatch < 0:
            raise ConfigError(
                f"AlignConfig.mismatch is a penalty magnitude and must be >= 0, got {self.mismatch}"
            )
        if self.max_cells < 10_000:
            raise ConfigError(f"AlignConfig.max_cells must be >= 10000, got {self.max_cells}")
        if self.max_gap_run < 1:
            raise ConfigError(f"AlignConfig.max_gap_run must be >= 1, got {self.max_gap_run}")
        if any(w <= 0 for w in self.weights.values()) or self.default_weight <= 0:
            raise ConfigError("AlignConfig.weights and default_weight must be > 0")
        if self.causality_tolerance_us < 0 or self.time_weight < 0 or self.time_scale_us <= 0:
            raise ConfigError(
                "AlignConfig.causality_tolerance_us and time_weight must be >= 0, time_scale_us > 0"
            )

    @classmethod
    def thesis(cls, **overrides) -> "AlignConfig":
        """The thesis's scoring alone: op names, Eq. 4.1-4.3 weights/scores, Eq. 4.2 gaps."""
        return cls(**{"use_attributes": False, "use_timing": False, **overrides})

    def weight(self, op: Optional[str]) -> float:
        return self.weights.get(op, self.default_weight) if op else self.default_weight


# ------------------------------------------------------------------------------- scoring


def pair_scores(
    lau: Sequence[Launch],
    kernels: Sequence[KernelRecord],
    cfg: AlignConfig,
    offset_us: Optional[float] = None,
    window_us: Optional[float] = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``S[i, j]`` and ``compatible[i, j]`` for launch i vs kernel j (module docstring)."""
    n, m = len(lau), len(kernels)
    if n == 0 or m == 0:
        return np.zeros((n, m)), np.zeros((n, m), dtype=bool)
    codes: dict[str, int] = {}

    def code(x: Optional[str]) -> int:
        return -1 if x is None else codes.setdefault(x, len(codes))

    sym = np.array([code(a.symbol) for a in lau])[:, None]
    kop = np.array([code(k.op) for k in kernels])[None, :]
    generic = kop < 0
    comp = (kop == sym) | generic
    for i, a in enumerate(lau):  # grouped launches of different ops: the kernel is named after one of them
        if a.symbol == "Mixed":
            comp[i] = generic[0] | np.isin(kop[0], [code(o) for o in a.ops])
    if cfg.use_attributes:
        kred = np.array([k.op in _REDUCTIONS for k in kernels])[None, :]
        ldt = np.array([code(kernel_dtype_class(a.dtype)) for a in lau])[:, None]
        kdt = np.array([code(kernel_dtype_class(k.dtype)) for k in kernels])[None, :]
        bad = kred & (ldt >= 0) & (kdt >= 0) & (ldt != kdt)
        ltree = np.array([-1 if a.algo is None else int(a.algo == "TREE") for a in lau])[:, None]
        ktree = np.array([-1 if k.algo is None else int(k.algo == "TREE") for k in kernels])[None, :]
        bad |= kred & (ltree >= 0) & (ktree >= 0) & (ltree != ktree)
        single = [len(a.calls) == 1 and a.symbol not in ("SendRecv", "Mixed") for a in lau]
        lcount = np.array([a.first.count if ok else -1 for a, ok in zip(lau, single, strict=True)])[:, None]
        lrs = np.array([a.first.op == "ReduceScatter" for a in lau])[:, None]
        kin = np.array([-1 if k.in_nelems is None else k.in_nelems for k in kernels])[None, :]
        kout = np.array([-1 if k.out_nelems is None else k.out_nelems for k in kernels])[None, :]
        kv = np.where(lrs, kout, kin)
        bad |= (lcount >= 0) & (kv >= 0) & (kv != lcount)
        comp &= ~(bad & ~generic)
    bonus = np.zeros((n, m))
    if cfg.use_timing and offset_us is not None:
        tl = np.array([np.nan if a.time_us is None else a.time_us for a in lau])[:, None] + offset_us
        has_launch = np.array([k.launch_ns is not None for k in kernels])[None, :]
        host = np.array([(k.launch_ns if k.launch_ns is not None else k.start_ns) / 1e3 for k in kernels])[
            None, :
        ]
        with np.errstate(invalid="ignore"):
            delta = host - tl  # launch call (or kernel start) after the call line: >= 0 for the true pair
            early = delta < -cfg.causality_tolerance_us
            window = cfg.launch_window_us if cfg.launch_window_us is not None else window_us
            if window is not None:
                early |= has_launch & (np.abs(delta) > window)
            close = np.exp(-np.abs(delta) / cfg.time_scale_us)
        known = ~np.isnan(tl)
        comp &= ~(early & known)
        # Only the launch call is close to the call line; a kernel *start* can lag by anything
        # (the host runs ahead of the GPU), so starts only bound (causality), never reward.
        bonus = np.where(known & has_launch, cfg.time_weight * close, 0.0)
    wl = np.array([cfg.weight(a.symbol if a.symbol != "Mixed" else None) for a in lau])[:, None]
    wk = np.array([cfg.weight(k.op) for k in kernels])[None, :]
    S = np.where(
        comp, cfg.match * wl * np.where(generic, 0.5, 1.0) * (1.0 + bonus), -cfg.mismatch * (wl + wk) / 2.0
    )
    return S, comp


# ------------------------------------------------------------------------------- one rank


@dataclass
class RankAlignment:
    """The result for one process/GPU: which launch ran as which kernel."""

    rank: Optional[int]
    launches: list[Launch]
    kernels: list[KernelRecord]
    pairs: list[tuple[int, int]]  # (launch index, kernel index), matches and mismatches
    matched: list[bool]  # per pair: ops (and attributes) agree
    score: float
    offset_us: Optional[float]  # estimated log clock -> kernel clock offset
    log: Optional[NcclProcessLog] = None
    trace: Optional[KernelTrace] = None
    offset_from: str = "off"  # launch | absolute | given | coarse | none | off (estimate_log_offset)
    launch_window_us: Optional[float] = None

    @property
    def matches(self) -> list[tuple[int, int]]:
        return [p for p, ok in zip(self.pairs, self.matched, strict=True) if ok]

    @property
    def kernel_of(self) -> dict[int, int]:
        """launch index -> kernel index, matches only."""
        return dict(self.matches)

    def summary(self) -> dict[str, object]:
        paired_l = {i for i, _ in self.pairs}
        paired_k = {j for _, j in self.pairs}
        return {
            "rank": self.rank,
            "launches": len(self.launches),
            "kernels": len(self.kernels),
            "matched": sum(self.matched),
            "mismatched": len(self.pairs) - sum(self.matched),
            "unmatched_launches": len(self.launches) - len(paired_l),
            "unmatched_kernels": len(self.kernels) - len(paired_k),
            "score": round(self.score, 3),
            "log_kernel_offset_us": None if self.offset_us is None else round(self.offset_us, 3),
            "offset_from": self.offset_from,
        }


def align_sequences(
    lau: Sequence[Launch],
    kernels: Sequence[KernelRecord],
    cfg: AlignConfig,
    offset_us: Optional[float] = None,
    window_us: Optional[float] = None,
) -> tuple[list[tuple[int, int]], list[bool], float]:
    """Pairs (launch, kernel), whether each is a match, and the score.

    Up to ``cfg.max_cells`` DP cells the alignment is exact. Beyond (a long run: the
    programme needs O(n·m) memory), launches are aligned in blocks of ``sqrt(max_cells)/1.5``
    against the kernels from just after the previous block's last pair, with free trailing
    gaps (a window's end is not the sequences' end); a block keeps the pairs of
    all but its last ``block/8`` launches, which the next block aligns again. Windowed
    results are not guaranteed optimal; the score is the sum of the blocks' kept scores."""
    n, m = len(lau), len(kernels)
    if n * m <= cfg.max_cells:
        S, comp = pair_scores(lau, kernels, cfg, offset_us, window_us)
        res = nw.align(
            S,
            comp,
            cfg.gap.penalty,
            max_gap_run=cfg.max_gap_run,
            bonus=cfg.sequence_bonus,
            free_end_gaps=cfg.free_end_gaps,
        )
        return res.pairs, [bool(comp[i, j]) for i, j in res.pairs], res.score
    block = max(50, int(math.sqrt(cfg.max_cells) / 1.5))
    overlap = max(10, block // 8)
    ratio = m / max(n, 1)
    pairs: list[tuple[int, int]] = []
    matched: list[bool] = []
    score = 0.0
    a, ka = 0, 0
    while a < n:
        b = min(n, a + block)
        kb = min(m, ka + int((b - a) * ratio * 1.5) + 50)
        sub_l, sub_k = lau[a:b], kernels[ka:kb]
        S, comp = pair_scores(sub_l, sub_k, cfg, offset_us, window_us)
        # A window starts right after the previous window's last pair (its leading gaps are real)
        # and ends arbitrarily (its trailing gaps are the next window's business).
        res = nw.align(
            S,
            comp,
            cfg.gap.penalty,
            max_gap_run=cfg.max_gap_run,
            bonus=cfg.sequence_bonus,
            free_leading=cfg.free_end_gaps if a == 0 else False,
            free_trailing=cfg.free_end_gaps if b == n and kb == m else True,
        )
        keep_upto = b if b == n else b - overlap
        last_k = None
        for i, j in res.pairs:
            if a + i < keep_upto:
                pairs.append((a + i, ka + j))
                matched.append(bool(comp[i, j]))
                score += float(S[i, j])
                last_k = ka + j
        if b == n:
            break
        a = keep_upto
        ka = last_k + 1 if last_k is not None else ka
    return pairs, matched, score


def estimate_log_offset(
    lau: Sequence[Launch], kernels: Sequence[KernelRecord], cfg: AlignConfig, *, absolute: bool = False
) -> tuple[Optional[float], str, Optional[float]]:
    """Offset (us) from the log clock to the kernel trace's clock, how it was found, and the
    launch window (us; see ``AlignConfig.launch_window_us``).

    * ``launch``: kernels carry their launch call's host time. Every true pair has
      ``launch - call`` equal to the clock offset plus a few microseconds of NCCL enqueue
      work, while wrong pairs spread over the op spacing: the offset is the densest window
      (width ``max(40 us, 2 x tolerance)``) of ``host - call`` over same-op pairs near the
      diagonal, taken at its median (so the typical enqueue time is part of the offset and a
      true pair's residual is ~0 either way). Needs no alignment, so a systematically
      shifted first alignment cannot bias it.
    * ``absolute``: only kernel starts, but both sources are on the host's epoch clock
      (log timestamps; a trace that gave its clock origin): offset 0, causality only.
    * ``coarse``: the log's timestamps have whole-second resolution; not used.
    * ``none``: no usable times.
    """
    if cfg.log_kernel_offset_us is not None:
        return cfg.log_kernel_offset_us, "given", cfg.launch_window_us
    ti = [(i, a.time_us) for i, a in enumerate(lau) if a.time_us is not None]
    if ti and all(t % 1e6 == 0 for _, t in ti):
        return None, "coarse", None  # whole-second timestamps ("[%F %T]"): no use at this scale
    kl = [(j, k.launch_ns / 1e3) for j, k in enumerate(kernels) if k.launch_ns is not None]
    if len(ti) >= 3 and len(kl) >= 3:
        n, m = len(lau), len(kernels)
        band = 10 + 0.25 * max(n, m)
        kj = np.array([j for j, _ in kl])
        kh = np.array([h for _, h in kl])
        kop = [kernels[j].op for j, _ in kl]
        diffs = []
        for i, t in ti:
            near = np.abs(kj / max(m, 1) * max(n, 1) - i) <= band
            sym = lau[i].symbol
            for idx in np.nonzero(near)[0]:
                if kop[idx] is None or kop[idx] == sym or (sym == "Mixed" and kop[idx] in lau[i].ops):
                    diffs.append(kh[idx] - t)
        if len(diffs) >= 3:
            d = np.sort(np.array(diffs))
            width = max(40.0, 2.0 * cfg.causality_tolerance_us)
            hi = np.searchsorted(d, d + width, side="right")
            best = int(np.argmax(hi - np.arange(len(d))))
            window = d[best : hi[best]]
            med = float(np.median(window))
            mad = float(np.median(np.abs(window - med))) * 1.4826
            return med, "launch", min(2000.0, max(20.0, 6.0 * mad))
    if absolute and ti:
        return 0.0, "absolute", None
    return None, "none", None


def align_rank(
    log: NcclProcessLog, trace: KernelTrace, cfg: Optional[AlignConfig] = None, *, rank: Optional[int] = None
) -> RankAlignment:
    """Align one process's calls with its GPU's kernels (module docstring)."""
    cfg = cfg or AlignConfig()
    lau = launches(log.calls, dedup=cfg.dedup)
    # The host launches kernels in the order it logged their calls; kernels of different
    # communicators run on different streams and may *start* in another order. Align against
    # launch-call order when every kernel has one.
    if trace.kernels and all(k.launch_ns is not None for k in trace.kernels):
        kernels = sorted(trace.kernels, key=lambda k: (k.launch_ns, k.start_ns))
    else:
        kernels = sorted(trace.kernels, key=lambda k: (k.start_ns, k.end_ns))
    offset, how, window = (None, "off", None)
    if cfg.use_timing:
        offset, how, window = estimate_log_offset(lau, kernels, cfg, absolute=trace.absolute)
    pairs, matched, score = align_sequences(lau, kernels, cfg, offset, window)
    return RankAlignment(
        rank if rank is not None else trace.rank,
        lau,
        kernels,
        pairs,
        matched,
        score,
        offset,
        log=log,
        trace=trace,
        offset_from=how,
        launch_window_us=cfg.launch_window_us if cfg.launch_window_us is not None else window,
    )


# ------------------------------------------------------------------------------- ranks


def pair_logs_with_traces(
    logs: Sequence[NcclProcessLog], traces: Sequence[KernelTrace]
) -> tuple[list[tuple[int, NcclProcessLog, KernelTrace]], list[str]]:
    """Which kernel trace belongs to which process: by rank (torch.profiler's distributedInfo),
    else by pid (nsys), else -- one of each -- by elimination. Returns (rank, log, trace) and notes."""
    ranks = assign_global_ranks(logs)
    notes: list[str] = []
    out = []
    used: set[int] = set()
    by_rank = {ranks[lg.key]: lg for lg in logs}
    by_pid = defaultdict(list)
    for lg in logs:
        by_pid[lg.pid].append(lg)
    for ti, t in enumerate(traces):
        lg = None
        if t.rank is not None and t.rank in by_rank:
            lg = by_rank[t.rank]
        elif t.pid is not None and len(by_pid.get(t.pid, [])) == 1:
            lg = by_pid[t.pid][0]
        if lg is not None:
            out.append((ranks[lg.key], lg, t))
            used.add(ti)
    if not out and len(logs) == 1 and len(traces) == 1:
        out.append((ranks[logs[0].key], logs[0], traces[0]))
        used.add(0)
    for ti, t in enumerate(traces):
        if ti not in used:
            notes.append(f"kernel trace {t.source} (rank {t.rank}, pid {t.pid}) matches no NCCL log process")
    done = {id(lg) for _, lg, _ in out}
    for lg in logs:
        if id(lg) not in done:
            notes.append(f"NCCL log process {lg.host}:{lg.pid} (rank {ranks[lg.key]}) has no kernel trace")
    out.sort(key=lambda x: x[0])
    return out, notes


# ------------------------------------------------------------------------------- whole run


@dataclass
class RunAlignment:
    ranks: list[RankAlignment]
    comm_map: CommMap
    offsets_ns: dict[int, float]
    notes: list[str]
    config: AlignConfig


def align_run(
    logs: Sequence[NcclProcessLog],
    traces: Sequence[KernelTrace],
    cfg: Optional[AlignConfig] = None,
    *,
    sync_point: str = "end",
) -> RunAlignment:
    """Pair processes with traces, align each, map communicators, synchronise clocks."""
    cfg = cfg or AlignConfig()
    pairs, notes = pair_logs_with_traces(logs, traces)
    ras = [align_rank(lg, t, cfg, rank=r) for r, lg, t in pairs]
    cmap = map_communicators(logs, dedup=cfg.dedup)
    offsets = synchronize_clocks(ras, cmap, sync_point=sync_point)
    return RunAlignment(ras, cmap, offsets, notes + cmap.notes, cfg)


__all__ = [
    "AlignConfig",
    "CommMap",
    "GAP_RULES",
    "GapRule",
    "Launch",
    "LogicalComm",
    "RankAlignment",
    "RunAlignment",
    "SYNC_POINTS",
    "THESIS_WEIGHTS",
    "align_rank",
    "align_run",
    "align_sequences",
    "assign_global_ranks",
    "estimate_log_offset",
    "launches",
    "map_communicators",
    "pair_logs_with_traces",
    "pair_scores",
    "synchronize_clocks",
]
