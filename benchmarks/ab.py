"""A/B in one run: executors compared step by step on the same ranks, with a bootstrap interval.

Baselines measured one after the other see different machines: load, clock and
caches drift between runs (about +-15% run to run on a shared 2-core machine), so
two separately measured medians cannot resolve a 10-20% difference. Here every
executor (a registered baseline) runs in one job on the same rank processes:

* :func:`ab_job` (module level: the rank pool pickles it by reference) builds the
  workload once per executor, each build after ``torch.manual_seed(0)`` (torchtitan
  copies on one shared DeviceMesh: ``benchmarks.thirdparty.shared_titan_meshes``), and
  checks that the copies start equal (every state-dict tensor and input, on every rank).
  It opens every executor's session at once (one ``ExitStack``; Dynamo's recompile limits
  scaled by the number of copies, each copy's budget that of a run alone), runs each
  one's first step (compilation) and ``warmup`` rounds, then ``pairs`` timed rounds: in
  each round every executor takes one step, the order reversed every other round
  (A B, B A, A B, ...; with three, A B C, C B A, ...) so that no executor always
  goes first. Every step starts after a ``dist.barrier()``
  (``benchmarks.measure._timed``); per step the parent takes the slowest rank.
* The statistics are pure functions: per round the speed-up
  ``time(baseline) / time(candidate)`` (> 1: the candidate was faster), its median
  over the rounds, and a percentile bootstrap interval of that median (rounds
  resampled with replacement, fixed seed: the same numbers give the same interval).
  :func:`verdict` says "faster" only when the whole interval is above 1.

``python benchmarks/run.py --ab CANDIDATE,BASELINE[,...]`` is the command line
(docs/benchmarks.md, "A/B in one run").
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.baselines import get_baseline
from benchmarks.measure import RankMeasurement, _timed, step_of
from benchmarks.metrics import METRICS, RunRecord, step_times
from benchmarks.report import _fixed, _markdown
from benchmarks.thirdparty import shared_titan_meshes
from benchmarks.workloads import Built, get_workload

__all__ = [
    "ABRank",
    "MIN_PAIRS",
    "ab_job",
    "ab_tables",
    "bootstrap_median_ci",
    "compare",
    "compile_order",
    "percentile",
    "round_order",
    "settings",
    "speedup_ratios",
    "summarize",
    "verdict",
]

# Fewer timed rounds than this make the bootstrap interval of the median unreliable.
MIN_PAIRS = 20
CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0

FASTER, SLOWER, UNRESOLVED = "faster", "slower", "no difference resolved"


# ------------------------------------------------------------------ rank job


@dataclass
class ABRank:
    """One rank's raw numbers of one A/B job.

    ``runs[executor]`` holds its first (compiling) step and one step time per timed
    round (only ``first_step_s`` and ``step_s`` are filled); ``first_losses[executor]``
    the losses its first step computed through ``Built.loss`` (one per call: empty
    where the baseline's own ``Session.step`` does not call it); ``orders`` the order
    the executors stepped in, per timed round."""

    rank: int
    world_size: int
    runs: dict[str, RankMeasurement]
    first_losses: dict[str, list[float]]
    orders: list[list[str]]


def round_order(executors: Sequence[str], round_index: int) -> list[str]:
    """The order the executors step in during round ``round_index``: as listed in even
    rounds, reversed in odd ones (for two: A B, B A, A B, ...)."""
    return list(executors) if round_index % 2 == 0 else list(reversed(executors))


def compile_order(executors: Sequence[str]) -> list[str]:
    """The order the sessions are opened and compiled in: as listed, except that an
    executor whose session patches Inductor's process-wide config (``config_patches``,
    e.g. ``inductor+comm``) comes last. Its patch stays active until the job ends, so an
    executor compiled after it would be compiled under it. Two such executors cannot
    share one process: ``ValueError``."""
    patched = [e for e in executors if getattr(get_baseline(e), "config_patches", None)]
    if len(patched) > 1:
        raise ValueError(
            f"{', '.join(patched)} each patch Inductor's process-wide config and cannot be compiled in "
            "one process; compare them in separate A/B runs"
        )
    return [e for e in executors if e not in patched] + patched


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _check_same_start(builts: dict[str, Built], workload: str) -> None:
    """Every copy holds the same weights and inputs as the first (a builder that is not
    deterministic would make the executors train different numbers)."""
    (first_name, first), *others = builts.items()

    def tensors(b: Built) -> dict[str, torch.Tensor]:
        out = {
            f"state {k}": _local(v) for k, v in b.model.state_dict().items() if isinstance(v, torch.Tensor)
        }
        out.update({f"input {i}": _local(x) for i, x in enumerate(b.inputs) if isinstance(x, torch.Tensor)})
        return out

    reference = tensors(first)
    for name, b in others:
        got = tensors(b)
        differ = sorted(
            k
            for k in reference.keys() | got.keys()
            if k not in reference or k not in got or not torch.equal(reference[k], got[k])
        )
        if differ:
            raise RuntimeError(
                f"{workload}: the copies built for {first_name} and {name} differ in "
                f"{', '.join(differ[:5])}: the workload's builder is not deterministic"
            )


def _first_step(step: Callable[[], None], built: Built) -> tuple[float, list[float]]:
    """The first (compiling) step, timed, and the losses it computed through ``built.loss``."""
    recorded: list[torch.Tensor] = []
    loss = built.loss

    def recording(out: Any) -> torch.Tensor:
        value = loss(out)
        recorded.append(value.detach())
        return value

    built.loss = recording
    try:
        seconds = _timed(step)
    finally:
        built.loss = loss
    values = [float(_local(v)) for v in recorded]
    # A gradient-accumulation step's loss is the sum of its micro-batches' (the loops record each,
    # a compiled step the sum; reduction "sum"): compare the sums.
    return seconds, ([sum(values)] if built.microbatches > 1 and values else values)


def ab_job(workload: str, executors: Sequence[str], warmup: int, pairs: int) -> ABRank:
    """On this rank: every executor on its own copy of ``workload``, interleaved (module docstring)."""
    # As in benchmarks.measure.measure: a per-graph pytree deprecation warning of torch 2.13.
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    world, rank = dist.get_world_size(), dist.get_rank()
    builts: dict[str, Built] = {}
    # One DeviceMesh for all copies: with a mesh each, DTensor's caches hand one copy's mesh to
    # the other's outputs and the second compile fails (benchmarks.thirdparty.shared_titan_meshes).
    with shared_titan_meshes():
        for name in executors:
            torch.manual_seed(0)
            builts[name] = get_workload(workload).build(world, rank)
    _check_same_start(builts, workload)
    steps: dict[str, Callable[[], None]] = {}
    first: dict[str, float] = {}
    losses: dict[str, list[float]] = {}
    times: dict[str, list[float]] = {name: [] for name in executors}
    orders: list[list[str]] = []
    with contextlib.ExitStack() as stack:
        # Dynamo keeps at most recompile_limit (8) compiled entries per code object, and every copy
        # compiles the same code objects under guards of its own: without a budget per copy, a
        # model that needs a few entries alone (torchtitan deepseek_v3's forward_with_redistribution:
        # 5) hits the limit in the copy compiled last, which then runs those frames eagerly.
        limits = torch._dynamo.config
        copies = len(executors)
        stack.enter_context(
            limits.patch(
                recompile_limit=copies * limits.recompile_limit,
                accumulated_recompile_limit=copies * limits.accumulated_recompile_limit,
            )
        )
        # Each session is opened right before its compile, so its fresh caches and recorders
        # are in place when it compiles; all stay open until every timed round is done.
        for name in compile_order(executors):
            session = stack.enter_context(get_baseline(name).session(builts[name]))
            steps[name] = step_of(session, builts[name])
            first[name], losses[name] = _first_step(steps[name], builts[name])
        for r in range(warmup):
            for name in round_order(executors, r):
                _timed(steps[name])
        for r in range(pairs):
            orders.append(round_order(executors, r))
            for name in orders[-1]:
                times[name].append(_timed(steps[name]))
    runs = {
        name: RankMeasurement(
            rank=rank,
            world_size=world,
            first_step_s=first[name],
            step_s=times[name],
            peak_alloc_bytes=None,
            torch_threads=torch.get_num_threads(),
            sim_note="not measured in A/B mode",
        )
        for name in executors
    }
    return ABRank(rank=rank, world_size=world, runs=runs, first_losses=losses, orders=orders)


# ---------------------------------------------------------------- statistics


def speedup_ratios(baseline_s: Sequence[float], candidate_s: Sequence[float]) -> list[float]:
    """Per round, ``time(baseline) / time(candidate)``: how many times faster the
    candidate was than the baseline in that round (> 1: candidate faster, < 1: slower).
    The two lists are the same rounds, in order."""
    if len(baseline_s) != len(candidate_s):
        raise ValueError(f"{len(baseline_s)} baseline rounds but {len(candidate_s)} candidate rounds")
    return [b / c for b, c in zip(baseline_s, candidate_s, strict=True)]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0 <= q <= 1) of ``values``, linear between the closest ranks
    (numpy's default): percentile([1, 2, 3, 4, 5], 0.1) == 1.4."""
    if not values or not 0.0 <= q <= 1.0:
        raise ValueError(f"percentile of {len(values)} values at q={q}")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])


def bootstrap_median_ci(
    values: Sequence[float], *, confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = SEED
) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of ``values``: the median of
    ``resamples`` resamples (with replacement, as many values as given) drawn by
    ``random.Random(seed)``, and the ``(1 - confidence) / 2`` and ``(1 + confidence) / 2``
    quantiles of those medians. Reproducible: the same input gives the same interval."""
    if not values:
        raise ValueError("bootstrap interval of no values")
    rng = random.Random(seed)
    medians = [statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)]
    tail = (1.0 - confidence) / 2
    return percentile(medians, tail), percentile(medians, 1.0 - tail)


def verdict(ci_low: float, ci_high: float) -> str:
    """For a speed-up interval: "faster" when all of it is above 1, "slower" when all of
    it is below 1, else "no difference resolved"."""
    if ci_low > 1.0:
        return FASTER
    if ci_high < 1.0:
        return SLOWER
    return UNRESOLVED


def compare(baseline_s: Sequence[float], candidate_s: Sequence[float]) -> dict[str, Any]:
    """The speed-up of the candidate over the baseline from paired round times:
    per-round ratios (:func:`speedup_ratios`), their median, its bootstrap interval
    and the verdict."""
    ratios = speedup_ratios(baseline_s, candidate_s)
    lo, hi = bootstrap_median_ci(ratios)
    return {
        "ratios": ratios,
        "median": statistics.median(ratios),
        "ci_low": lo,
        "ci_high": hi,
        "confidence": CONFIDENCE,
        "resamples": RESAMPLES,
        "seed": SEED,
        "pairs": len(ratios),
        "verdict": verdict(lo, hi),
    }


def settings(world_sizes: Sequence[int], warmup: int, pairs: int) -> dict[str, Any]:
    """How an A/B run measures, for its JSON document and header lines."""
    return {
        "world_sizes": list(world_sizes),
        "backend": "gloo",
        "threads_per_rank": 1,
        "warmup": warmup,
        "pairs": pairs,
        "order": "one step per executor per round, the listed order reversed every other round",
        "step": "forward + loss + backward, gradients set to None (no optimizer), or the baseline's Session.step",
        "step_time": "per step the slowest rank after a barrier",
        "speedup": "per round time(baseline) / time(candidate); > 1: the candidate (first executor) is faster",
        "confidence": CONFIDENCE,
        "resamples": RESAMPLES,
        "seed": SEED,
        "verdict": f"'{FASTER}' if the interval's low end > 1, '{SLOWER}' if its high end < 1, else '{UNRESOLVED}'",
    }


def _loss_spread(first_losses: dict[str, list[list[float]]]) -> float | None:
    """Largest |loss - candidate's loss| of any executor's first step on any rank (None:
    no two executors recorded comparable losses)."""
    (_, reference), *others = first_losses.items()
    diffs = [
        abs(a - b)
        for _, per_rank in others
        for ref, got in zip(reference, per_rank, strict=True)
        if ref and len(ref) == len(got)
        for a, b in zip(ref, got, strict=True)
    ]
    return max(diffs) if diffs else None


def summarize(workload: str, executors: Sequence[str], ranks: list[ABRank]) -> dict[str, Any]:
    """One workload's A/B result, JSON-ready: per executor the slowest rank's time per
    round, median and IQR (``benchmarks.metrics``' definitions), compile time and
    first-step losses; per non-candidate executor the speed-up of the candidate
    (``executors[0]``) over it (:func:`compare`); and every rank's raw numbers."""
    candidate = executors[0]
    records = {e: RunRecord(workload, e, len(ranks), [r.runs[e] for r in ranks]) for e in executors}
    per_executor = {}
    for e, rec in records.items():
        per_executor[e] = {
            "round_s": step_times(rec),
            "first_step_s": max(m.first_step_s for m in rec.ranks),
            **{k: METRICS[k].compute(rec) for k in ("step_ms_median", "step_ms_iqr", "compile_s")},
            "first_losses": [r.first_losses[e] for r in ranks],
        }
    comparisons = [
        {
            "candidate": candidate,
            "baseline": e,
            **compare(per_executor[e]["round_s"], per_executor[candidate]["round_s"]),
        }
        for e in executors[1:]
    ]
    return {
        "workload": workload,
        "error": None,
        "candidate": candidate,
        "executors": per_executor,
        "comparisons": comparisons,
        "orders": ranks[0].orders,
        "first_loss_max_abs_diff": _loss_spread({e: per_executor[e]["first_losses"] for e in executors}),
        "raw": {"ranks": [dataclasses.asdict(r) for r in ranks]},
    }


# -------------------------------------------------------------------- tables

_HEADER = [
    "workload",
    "candidate",
    "vs",
    "candidate ms",
    "vs ms",
    "speed-up",
    "CI low",
    "CI high",
    "pairs",
    "verdict",
]


def _comparisons(doc: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(r, c) for r in doc["results"] if r["error"] is None for c in r["comparisons"]]


def _rows(doc: dict[str, Any]) -> list[list[str]]:
    fmt_ms = METRICS["step_ms_median"].fmt
    rows = []
    for r in doc["results"]:
        if r["error"] is not None:
            rows.append(
                [
                    r["workload"],
                    doc["executors"][0],
                    "",
                    f"FAILED: {r['error'].strip().splitlines()[-1][:60]}",
                ]
                + [""] * (len(_HEADER) - 4)
            )
            continue
        ex = r["executors"]
        for c in r["comparisons"]:
            rows.append(
                [
                    r["workload"],
                    c["candidate"],
                    c["baseline"],
                    fmt_ms(ex[c["candidate"]]["step_ms_median"]),
                    fmt_ms(ex[c["baseline"]]["step_ms_median"]),
                    f"{c['median']:.3f}",
                    f"{c['ci_low']:.3f}",
                    f"{c['ci_high']:.3f}",
                    str(c["pairs"]),
                    c["verdict"],
                ]
            )
    return rows


def _lines(doc: dict[str, Any]) -> list[str]:
    env, s = doc["environment"], doc["settings"]
    load = [doc.get("load_avg_1m_before"), doc.get("load_avg_1m_after")]
    out = [
        f"commfuse A/B in one run, {env['date']}: {env['machine']['platform']}, {env['machine']['logical_cores']} "
        f"logical cores, torch {env['versions']['torch']}; 1-min load before/after "
        + "/".join("-" if x is None else f"{x:.1f}" for x in load),
        f"world size {'/'.join(map(str, s['world_sizes']))} (gloo, 1 thread per rank), {s['warmup']} warm-up + "
        f"{s['pairs']} timed rounds; {s['order']}",
        f"speed-up = time(vs) / time(candidate) per round, median over rounds, {100 * s['confidence']:g}% "
        f"percentile bootstrap interval ({s['resamples']} resamples); > 1: the candidate is faster",
    ]
    for r in doc["results"]:
        if r["error"] is None:
            spread = r["first_loss_max_abs_diff"]
            out.append(
                f"{r['workload']}: first-step losses of the executors differ by at most "
                + ("- (not recorded)" if spread is None else f"{spread:.3g}")
            )
    return out + [f"warning: {w}" for w in doc.get("warnings", [])]


def _sentence(workload: str, c: dict[str, Any]) -> str:
    interval = f"{100 * c['confidence']:g}% CI [{c['ci_low']:.3f}, {c['ci_high']:.3f}], {c['pairs']} pairs"
    if c["verdict"] == FASTER:
        return f"{workload}: {c['candidate']} is {c['median']:.3f}x faster than {c['baseline']} ({interval})"
    what = (
        f"is slower than {c['baseline']}" if c["verdict"] == SLOWER else f"vs {c['baseline']}: {UNRESOLVED}"
    )
    return f"{workload}: {c['candidate']} {what} (speed-up {c['median']:.3f}x, {interval})"


def ab_tables(doc: dict[str, Any], *, markdown: bool = False) -> str:
    """The A/B table (one row per candidate x other executor) with its header lines,
    as fixed-width text or Markdown."""
    if markdown:
        return "\n".join(
            ["\n\n".join(_lines(doc)), "", _markdown(_HEADER, _rows(doc)), ""]
            + [f"- {_sentence(r['workload'], c)}" for r, c in _comparisons(doc)]
        )
    return "\n".join(
        _lines(doc)
        + ["", _fixed(_HEADER, _rows(doc)), ""]
        + [_sentence(r["workload"], c) for r, c in _comparisons(doc)]
    )
