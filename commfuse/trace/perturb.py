"""Seeded perturbation scenarios for the alignment fixtures, and their F1 evaluation.

Contract
- `SCENARIOS`: the thesis's four (§4.3.2: "1:1", 20% of kernels missing, 20% of log
  operations missing, both) and two more from its Table 4.1/4.2 observations:
  ``duplicates`` (one rank logs every call line twice, as rank 1 of each TP group does in
  Tables 4.1-4.2) and ``fused_p2p`` (3% extra ``SendRecv`` kernels without a log line -- the
  +10 of 330 in Table 4.1 -- and 20 start-up ``AllReduce`` calls logged before the kernel
  trace begins -- the "+20 AllReduce" anomaly; every Send/Recv group is fused into one
  ``ncclDevKernel_SendRecv`` in all scenarios, as NCCL does). A dropped *operation* loses
  all its lines (or its kernel), as in the thesis's definition.
- `perturb(run, scenario, seed)` returns one `RankView` per rank: the call lines and kernels
  its files will contain and the ground truth (the launches present on both sides). The
  same ``(seed, model, scenario, rank)`` always gives the same view.
- `run_scenario` writes the view in the real formats (NCCL log text; torch.profiler JSON or
  nsys SQLite), reads the files back with the package's own parsers, aligns with
  `align_run` and scores: precision = correct pairs / pairs produced (matches and
  mismatches), recall = correct pairs / ground-truth pairs, F1 their harmonic mean (thesis
  Eqs. 4.17-4.19), micro-averaged over ranks; plus the clock-sync error against the
  synthesised clock offsets.
"""

from __future__ import annotations

import copy
import json
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from commfuse.trace.align import AlignConfig, RunAlignment, align_run
from commfuse.trace.kernel_trace import read_kernel_traces
from commfuse.trace.nccl_log import parse_nccl_logs
from commfuse.trace.synth import (
    LogItem,
    SynthCall,
    SynthKernel,
    SynthLaunch,
    SynthRun,
    render_log,
    render_torch_trace,
    write_nsys_sqlite,
)

THESIS_F1 = {"1:1": 0.988, "kernel_drop_20": 0.912, "log_drop_20": 0.868, "both_drop_20": 0.805}


@dataclass(frozen=True)
class Scenario:
    name: str
    kernel_drop: float = 0.0  # fraction of launches whose kernel is missing
    log_drop: float = 0.0  # fraction of launches whose call lines are missing
    duplicate_ranks: tuple[int, ...] = ()  # these ranks log every call line twice
    unlogged_p2p_kernels: float = (
        0.0  # extra SendRecv kernels, fraction of the p2p launches (>= 1 if any p2p)
    )
    startup_calls: int = 0  # AllReduce calls logged before the kernel trace starts


SCENARIOS: dict[str, Scenario] = {
    "1:1": Scenario("1:1"),
    "kernel_drop_20": Scenario("kernel_drop_20", kernel_drop=0.2),
    "log_drop_20": Scenario("log_drop_20", log_drop=0.2),
    "both_drop_20": Scenario("both_drop_20", kernel_drop=0.2, log_drop=0.2),
    "duplicates": Scenario("duplicates", duplicate_ranks=(0,)),
    "fused_p2p": Scenario("fused_p2p", unlogged_p2p_kernels=0.03, startup_calls=20),
}


@dataclass
class RankView:
    rank: int
    items: list[LogItem]
    kernels: list[SynthKernel]
    kernel_uid: dict[int, Optional[int]]  # correlation id -> launch uid (None: a kernel without a launch)
    truth: set[int]  # launches present in both the log and the trace


def perturb(run: SynthRun, scenario: Scenario, seed: int = 0) -> tuple[SynthRun, list[RankView]]:
    """The perturbed run (start-up calls added) and one view per rank (module docstring)."""
    run = copy.deepcopy(run)
    views = []
    next_uid = 1 + max((lau.uid for rk in run.ranks for lau in rk.launches), default=0)
    for rk in run.ranks:
        rng = random.Random(f"{seed}:{run.model}:{scenario.name}:{rk.rank}")
        if scenario.startup_calls and rk.launches:
            g0 = rk.launches[0].group
            t0 = min(lau.t_log_us for lau in rk.launches)
            for lau in rk.launches:
                if lau.group == g0:
                    lau.op_count += scenario.startup_calls
            pre = []
            for s in range(scenario.startup_calls):
                buf = f"0x7f{rng.getrandbits(40):010x}"
                k = SynthKernel(
                    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                    0,
                    0,
                    0,
                    -1,
                    (1, 1, 1),
                    (512, 1, 1),
                )
                pre.append(
                    SynthLaunch(
                        next_uid,
                        rk.rank,
                        g0,
                        s,
                        "all_reduce",
                        [SynthCall("AllReduce", 1, sendbuff=buf, recvbuff=buf)],
                        t0 - 900_000.0 + 20_000.0 * s,
                        "RING",
                        "LL",
                        (0, 0),
                        k,
                    )
                )
                next_uid += 1
            rk.launches = pre + rk.launches
        startup = (
            {lau.uid for lau in rk.launches[: scenario.startup_calls]} if scenario.startup_calls else set()
        )
        items: list[LogItem] = []
        kernels: list[SynthKernel] = []
        kernel_uid: dict[int, Optional[int]] = {}
        truth: set[int] = set()
        for lau in rk.launches:
            logged = lau.uid in startup or rng.random() >= scenario.log_drop
            traced = lau.uid not in startup and rng.random() >= scenario.kernel_drop
            if logged:
                for ci in range(len(lau.calls)):
                    items.append(LogItem(lau.uid, ci))
                    if rk.rank in scenario.duplicate_ranks:
                        items.append(LogItem(lau.uid, ci))
            if traced:
                kernels.append(lau.kernel)
                kernel_uid[lau.kernel.correlation] = lau.uid
            if logged and traced:
                truth.add(lau.uid)
        if scenario.unlogged_p2p_kernels > 0:
            p2p = [
                lau for lau in rk.launches if lau.calls[0].op in ("Send", "Recv") and lau.uid not in startup
            ]
            extra = max(1, round(scenario.unlogged_p2p_kernels * len(p2p))) if p2p else 0
            for e in range(extra):
                at = rng.choice(p2p).kernel
                s = at.end_ns + 2_000 + rng.randrange(3_000)
                corr = 900_000 + 100 * rk.rank + e
                kernels.append(
                    SynthKernel(
                        "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
                        s,
                        s + 4_000,
                        at.stream,
                        corr,
                        (2, 1, 1),
                        (512, 1, 1),
                        {"Collective name": "send", "dtype": "Float"},
                        s - 9_000,
                    )
                )
                kernel_uid[corr] = None
            kernels.sort(key=lambda k: k.start_ns)
        views.append(RankView(rk.rank, items, kernels, kernel_uid, truth))
    return run, views


@dataclass
class Counts:
    tp: int = 0
    fp: int = 0
    fn: int = 0

    def add(self, other: "Counts") -> None:
        self.tp, self.fp, self.fn = self.tp + other.tp, self.fp + other.fp, self.fn + other.fn

    @property
    def precision(self) -> float:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else 1.0

    @property
    def recall(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else 1.0

    @property
    def f1(self) -> float:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r else 0.0


def evaluate(run: SynthRun, views: list[RankView], result: RunAlignment) -> tuple[Counts, dict[int, Counts]]:
    """Precision/recall/F1 counts of ``result`` against the views' ground truth."""
    total, per_rank = Counts(), {}
    by_rank = {ra.rank: ra for ra in result.ranks}
    for v in views:
        rk = run.ranks[v.rank]
        group_of_ptr = {ptr: g for g, ptr in rk.comm_ptrs.items()}
        uid_of_launch = {(lau.group, lau.op_count): lau.uid for lau in rk.launches}
        c = Counts()
        ra = by_rank.get(v.rank)
        pred: set[tuple[Optional[int], Optional[int]]] = set()
        if ra is not None:
            for li, kj in ra.pairs:
                lau = ra.launches[li]
                lu = uid_of_launch.get((group_of_ptr.get(lau.comm, -1), lau.op_count))
                ku = (
                    v.kernel_uid.get(ra.kernels[kj].correlation)
                    if ra.kernels[kj].correlation is not None
                    else None
                )
                pred.add((lu, ku))
        truth = {(u, u) for u in v.truth}
        c.tp = len(pred & truth)
        c.fp = len(pred) - c.tp
        c.fn = len(truth) - c.tp
        per_rank[v.rank] = c
        total.add(c)
    return total, per_rank


@dataclass
class ScenarioResult:
    model: str
    scenario: str
    trace_format: str
    counts: Counts
    per_rank: dict[int, Counts]
    clock_error_us: Optional[float]  # max |recovered - true| offset over ranks
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "scenario": self.scenario,
            "trace_format": self.trace_format,
            "precision": round(self.counts.precision, 4),
            "recall": round(self.counts.recall, 4),
            "f1": round(self.counts.f1, 4),
            "tp": self.counts.tp,
            "fp": self.counts.fp,
            "fn": self.counts.fn,
            "clock_error_us": None if self.clock_error_us is None else round(self.clock_error_us, 3),
            "notes": self.notes,
        }


def write_view(
    run: SynthRun, views: list[RankView], out: Union[str, Path], trace_format: str = "nsys"
) -> tuple[Path, Path]:
    """Write ``logs/rank<r>.log`` and ``traces/rank<r>.{sqlite,json}`` under ``out``."""
    if trace_format not in ("nsys", "torch", "torch-nometa"):
        raise ValueError(f"trace_format must be 'nsys', 'torch' or 'torch-nometa', got {trace_format!r}")
    out = Path(out)
    logs, traces = out / "logs", out / "traces"
    logs.mkdir(parents=True, exist_ok=True)
    traces.mkdir(parents=True, exist_ok=True)
    for v in views:
        (logs / f"rank{v.rank}.log").write_text(render_log(run, v.rank, v.items))
        if trace_format == "nsys":
            write_nsys_sqlite(traces / f"rank{v.rank}.sqlite", run, v.rank, v.kernels)
        else:
            doc = render_torch_trace(run, v.rank, v.kernels, metadata=trace_format == "torch")
            (traces / f"rank{v.rank}.json").write_text(json.dumps(doc))
    return logs, traces


def run_scenario(
    run: SynthRun,
    scenario: Union[str, Scenario],
    cfg: Optional[AlignConfig] = None,
    *,
    trace_format: str = "nsys",
    seed: int = 0,
    workdir: Optional[Union[str, Path]] = None,
    sync_point: str = "end",
) -> ScenarioResult:
    """Perturb, write in the real formats, parse, align and score one scenario (module docstring)."""
    sc = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
    prun, views = perturb(run, sc, seed)
    with tempfile.TemporaryDirectory(prefix="commfuse-align-") as tmp:
        base = Path(workdir) if workdir is not None else Path(tmp)
        logs_dir, traces_dir = write_view(
            prun, views, base / f"{run.model}-{sc.name}-{trace_format}", trace_format
        )
        logs = parse_nccl_logs(sorted(logs_dir.glob("*.log")))
        traces = read_kernel_traces(traces_dir)
        result = align_run(logs, traces, cfg, sync_point=sync_point)
    total, per_rank = evaluate(prun, views, result)
    truth = prun.true_offsets_ns()
    errs = [abs(result.offsets_ns[r] - truth[r]) / 1e3 for r in result.offsets_ns if r in truth]
    return ScenarioResult(
        run.model, sc.name, trace_format, total, per_rank, max(errs) if errs else None, list(result.notes)
    )


__all__ = [
    "Counts",
    "RankView",
    "SCENARIOS",
    "Scenario",
    "ScenarioResult",
    "THESIS_F1",
    "evaluate",
    "perturb",
    "run_scenario",
    "write_view",
]
