"""Metrics: the columns of the comparison, computed from the raw per-rank measurements.

A metric is a named function of one :class:`RunRecord` (a workload x baseline
run: every rank's :class:`~benchmarks.measure.RankMeasurement`) to a
JSON value, plus how to print it. Adding a metric::

    register_metric(Metric("my_metric", "my col", "unit", "what it measures",
                           compute=lambda rec: ..., fmt=lambda v: ...))

If it needs a new raw number, add a field to ``RankMeasurement`` and fill it
in ``benchmarks.measure.measure``. A metric that cannot be computed yet
returns ``None`` and prints ``n/a`` (``sim_step_dgx_h100x2`` keeps the reason
in the raw JSON's ``sim_note``); it never prints a made-up number.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.measure import GraphCollectives, RankMeasurement

__all__ = ["METRICS", "Metric", "RunRecord", "compute_metrics", "register_metric", "step_times"]


@dataclass
class RunRecord:
    """One workload x baseline run: every rank's raw numbers, or the error that stopped it."""

    workload: str
    baseline: str
    world_size: int
    ranks: list[RankMeasurement] = field(default_factory=list)
    error: str | None = None
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.ranks)

    @property
    def graphs(self) -> list[GraphCollectives]:
        # SPMD: every rank compiles the same graphs; rank 0's analysis stands
        # for all (the raw JSON keeps every rank's for cross-checking).
        return self.ranks[0].graphs if self.ranks else []


@dataclass(frozen=True)
class Metric:
    name: str
    header: str
    unit: str
    description: str
    compute: Callable[[RunRecord], Any]
    fmt: Callable[[Any], str] = str
    in_table: bool = True


METRICS: dict[str, Metric] = {}


def register_metric(metric: Metric) -> Metric:
    if metric.name in METRICS and METRICS[metric.name] is not metric:
        raise ValueError(f"metric {metric.name!r} is already registered")
    METRICS[metric.name] = metric
    return metric


def compute_metrics(record: RunRecord) -> dict[str, Any]:
    """Every registered metric for ``record``; all ``None`` when the run failed."""
    if not record.ok:
        return {name: None for name in METRICS}
    return {name: m.compute(record) for name, m in METRICS.items()}


# ------------------------------------------------------------------ helpers


def step_times(record: RunRecord) -> list[float]:
    """Per measured step, the slowest rank's time (a step is over when every rank is)."""
    return [max(ts) for ts in zip(*(r.step_s for r in record.ranks), strict=True)]


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def _add(a: int | str | None, b: int | str | None) -> int | str | None:
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    if a is None or b is None:
        return None
    return f"{a} + {b}"  # symbolic sizes: keep the expression, never a guess


def _by_kind(record: RunRecord) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for g in record.graphs:
        for kind, t in g.by_kind.items():
            acc = out.setdefault(kind, {"count": 0, "logged_bytes": 0, "wire_bytes": 0})
            acc["count"] += t.count
            acc["logged_bytes"] = _add(acc["logged_bytes"], t.logged_bytes)
            acc["wire_bytes"] = _add(acc["wire_bytes"], t.wire_bytes)
    return dict(sorted(out.items()))


def _total(record: RunRecord, key: str) -> int | str | None:
    total: int | str | None = 0
    for g in record.graphs:
        total = _add(total, getattr(g.total, key))
    return total


_SHORT = {
    "all_gather": "AG",
    "reduce_scatter": "RS",
    "all_reduce": "AR",
    "all_to_all": "A2A",
    "broadcast": "BC",
    "send": "SEND",
    "recv": "RECV",
    "batch_p2p": "P2P",
    "many_to_many_scatter": "M2MS",
}


def _fmt_kinds(v: dict[str, dict[str, Any]] | None) -> str:
    if v is None:
        return "-"
    return " ".join(f"{_SHORT.get(k, k)}{t['count']}" for k, t in v.items()) or "none"


def _fmt_bytes(v: int | str | None) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return "symbolic"
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if v >= scale:
            return f"{v / scale:.1f} {unit}"
    return f"{v} B"


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _fmt_s(v: float | None) -> str:
    # `or 0.0` turns a rounded -0.0 (first step marginally faster than the
    # median, e.g. eager) into 0.0; the JSON keeps the measured value.
    return "-" if v is None else f"{(round(v, 1) or 0.0):.1f}"


# ------------------------------------------------------------------ metrics

register_metric(
    Metric(
        "collectives",
        "collectives (fw+bw)",
        "count by kind",
        "collectives in the executed forward+backward graphs, by kind "
        "(AG all_gather, RS reduce_scatter, AR all_reduce, A2A all_to_all)",
        compute=_by_kind,
        fmt=_fmt_kinds,
    )
)
register_metric(
    Metric(
        "logged_bytes",
        "logged/rank",
        "bytes",
        "bytes per rank with NCCL count semantics (all_gather: send count, reduce_scatter: receive count), "
        "forward+backward, from commfuse.analyze",
        compute=lambda r: _total(r, "logged_bytes"),
        fmt=_fmt_bytes,
    )
)
register_metric(
    Metric(
        "wire_bytes",
        "wire/rank",
        "bytes",
        "bytes one rank sends under ring conventions, forward+backward, from commfuse.analyze",
        compute=lambda r: _total(r, "wire_bytes"),
        fmt=_fmt_bytes,
    )
)
register_metric(
    Metric(
        "unrecognised_collectives",
        "unrecog.",
        "ops",
        "c10d ops in the analysed graphs that commfuse's IR does not recognise, so their bytes are NOT "
        "counted above ('-' / null: not checked, the graphs came from commfuse's own pipeline reports)",
        compute=lambda r: (
            None
            if any(g.unrecognised is None for g in r.graphs)
            else sum(sum(g.unrecognised.values()) for g in r.graphs)
        ),
        fmt=lambda v: "-" if v is None else str(v),
    )
)
register_metric(
    Metric(
        "step_ms_median",
        "step ms (median)",
        "ms",
        "forward+backward step time, median over the measured steps of the slowest rank",
        compute=lambda r: 1e3 * _quartiles(step_times(r))[1],
        fmt=_fmt_ms,
    )
)
register_metric(
    Metric(
        "step_ms_iqr",
        "IQR ms",
        "ms",
        "inter-quartile range (q75 - q25) of the same step times",
        compute=lambda r: 1e3 * (_quartiles(step_times(r))[2] - _quartiles(step_times(r))[0]),
        fmt=_fmt_ms,
    )
)
register_metric(
    Metric(
        "peak_alloc_bytes",
        "peak alloc/rank",
        "bytes",
        "peak bytes held by the CPU allocator during one step above the level at its start "
        "(torch.profiler memory events), max over ranks",
        compute=lambda r: (
            None
            if any(m.peak_alloc_bytes is None for m in r.ranks)
            else max(m.peak_alloc_bytes for m in r.ranks)
        ),  # type: ignore[type-var]
        fmt=_fmt_bytes,
    )
)
register_metric(
    Metric(
        "compile_s",
        "compile s",
        "s",
        "first step (compiles) minus the median step, slowest rank; cold: fresh Inductor caches per run",
        compute=lambda r: max(m.first_step_s for m in r.ranks) - _quartiles(step_times(r))[1],
        fmt=_fmt_s,
    )
)
register_metric(
    Metric(
        "sim_step_dgx_h100x2",
        "simulated step time (DGX-H100 x2)",
        "ms",
        "the executed forward+backward graphs, as captured on this CPU run (its shapes, its process groups), "
        "simulated on Topology.preset('dgx-h100', num_nodes=2) with the analytic NCCL cost model "
        "(commfuse.costmodel.step.predict_step; see benchmarks/simulated.py); n/a when the graphs are not "
        "available or hold c10d ops the IR does not recognise",
        compute=lambda r: None if r.ranks[0].sim_step_us is None else r.ranks[0].sim_step_us / 1e3,
        fmt=lambda v: "n/a" if v is None else f"{v:.3f}",
    )
)
