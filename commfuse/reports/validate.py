"""Measured vs predicted: the runtime recorder's collectives against the lowering plans, per rank.

Contract
    Input, per rank: what the recorder saw at each c10d call (:mod:`commfuse.lowering.recorder`:
    kind, groups, bytes handed to c10d, issue and completion times; in memory or as the
    ``rank<r>.json`` Chrome traces it writes) and what commfuse predicted: the lowering plan
    of every graph (``lowering_plan.json`` / ``backend.plans``: issue order, group, logged
    bytes) and the final graph's analysis (``pipeline.json`` / ``backend.reports``: shapes and
    dtype, hence the bytes each call must hand to c10d).

    Every recorded collective is matched to its planned one by (graph, plan index): a graph
    run is one pass through the plan in issue order, so a run's records must be exactly the
    plan's collectives, each once, in order. Reported per rank:

    * **count**: missing (planned, not recorded), extra / repeated, out of order, runs that
      differ between ranks;
    * **identity**: start node, kind, graph group and issue group as planned;
    * **bytes, exact**: bytes sent to and received from c10d vs the analysis's input and output
      bytes; logged bytes (NCCL count semantics, derived from the measured sent/received:
      reduce_scatter its receive count, every other kind its send count) vs the plan's;
    * **time** (reported, never a mismatch): the measured in-flight time (issue to Work
      completion; median over the runs after the first, which also waits out the other ranks'
      compilation) against the cost model's time for the same call
      (``CollectiveModel.time`` + the calibrated in-graph overhead; a ``CostProfile`` when
      given, else the uncalibrated ``cpu-gloo`` preset).

    On gloo, counts and bytes are expected to be exactly equal; any difference is a mismatch.
    Not validated (and said so): collectives issued inside an op's kernel (the MoE layer's token
    exchange; the recorder has them under the graph ``"kernel"``, no plan issued them) and bytes
    sent by ops the runtime runs through the graph's own op (in-place variants, point-to-point:
    their sent bytes read 0).

Guarantees
    Reads only. Every rank is judged against its own plans (the plans are the same on every
    rank by construction; the per-rank dumps are not assumed to be).

Source: the measured-vs-predicted validation of the NCCL-trace thesis (L. Borzyk, "Understanding
LLM Communication", Heidelberg University, 2026, §5.3.5), with its lesson: logged and wire bytes
kept apart.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch

from commfuse.core.errors import InputFileError
from commfuse.core.jsonfile import read_json_object, read_model_file
from commfuse.ir.kinds import CollectiveKind
from commfuse.lowering.recorder import KERNEL_GRAPH
from commfuse.passmgr.report import AnalysisReport, PipelineReport
from commfuse.reports.timeline import cost_model
from commfuse.reports.volume import graph_dirs, rank_dirs


# ----------------------------------------------------------------------------- inputs
@dataclass
class RecordedCollective:
    """One c10d call as the recorder saw it (times in microseconds)."""

    index: int
    name: str
    graph: str  # the runtime's graph label, "<kind>#<id>"
    kind: str
    group: str
    issue_group: str
    logged_bytes: Optional[int]
    sent_bytes: int
    received_bytes: int
    duration_us: Optional[float]
    end_from: str = "work"  # "work": the Work future fired; "wait": the wait's end stands in


@dataclass
class PlannedGraph:
    """One lowered graph as predicted: its plan and (optionally) its final analysis."""

    name: str  # dump dir name ("forward_000") or "<kind>#<i>"
    kind: str
    plan: dict[str, Any]  # LoweringPlan.to_dict()
    analysis: Optional[AnalysisReport] = None


def records_from_recorder(rec: Any) -> list[RecordedCollective]:
    """From a live :class:`commfuse.Recorder`."""
    out = []
    for c in rec.collectives:
        end = c.end_ns
        out.append(
            RecordedCollective(
                c.index,
                c.name,
                c.graph,
                c.kind,
                c.group,
                c.issue_group,
                c.logged_bytes,
                c.sent_bytes,
                c.received_bytes,
                None if end is None else (end - c.issued_ns) / 1e3,
                "work" if c.done_ns is not None else "wait",
            )
        )
    return out


def records_from_trace(trace: dict[str, Any]) -> list[RecordedCollective]:
    """From a recorder Chrome trace (``rank<r>.json``): its ``comm,*`` events, in file order."""
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or not str(ev.get("cat", "")).startswith("comm"):
            continue
        a = ev.get("args", {})
        try:
            out.append(
                RecordedCollective(
                    int(a["index"]),
                    str(a["name"]),
                    str(a["graph"]),
                    str(a["kind"]),
                    str(a["group"]),
                    str(a["issue_group"]),
                    a.get("logged_bytes"),
                    int(a["sent_bytes"]),
                    int(a["received_bytes"]),
                    float(ev["dur"]) if "dur" in ev else None,
                    str(a.get("end_from", "work")),
                )
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"recorder trace: event {ev.get('name')!r} lacks the recorder's fields ({e})"
            ) from e
    return out


def plans_from_backend(be: Any) -> list[PlannedGraph]:
    """``backend.plans`` paired with the reports of the graphs they were built from (a
    ``TrainStep`` is accepted too: its ``.backend``)."""
    if not hasattr(be, "plans") and hasattr(be, "backend"):
        be = be.backend
    if not hasattr(be, "plans"):
        raise TypeError(
            f"plans_from_backend: expected a commfuse backend or TrainStep, got {type(be).__name__}"
        )
    reports = [r for r in be.reports if r.graph in ("forward", "backward", "inference", "graph")]
    used: set[int] = set()
    out = []
    counters: dict[str, int] = defaultdict(int)
    for p in be.plans:
        starts = [c.start for c in p.collectives]
        analysis = None
        for i, r in enumerate(reports):
            if i in used or r.graph != p.graph_kind or r.analysis is None:
                continue
            if [c.node for c in r.analysis.collectives] == starts:
                used.add(i)
                analysis = r.analysis
                break
        name = f"{p.graph_kind}#{counters[p.graph_kind]}"
        counters[p.graph_kind] += 1
        out.append(PlannedGraph(name, p.graph_kind, p.to_dict(), analysis))
    return out


def plans_from_dump_dir(dump_dir: str | Path) -> list[PlannedGraph]:
    """Every ``<kind>_<i>/lowering_plan.json`` of one rank's dump dir, with its ``pipeline.json`` analysis."""
    out = []
    for d in graph_dirs(dump_dir):
        pf = d / "lowering_plan.json"
        if not pf.exists():
            continue
        plan = read_json_object(pf, "lowering plan")
        analysis = None
        if (d / "pipeline.json").exists():
            analysis = read_model_file(PipelineReport, d / "pipeline.json", "pipeline report").analysis
        out.append(PlannedGraph(d.name, plan.get("graph_kind", d.name.split("_")[0]), plan, analysis))
    return out


# ----------------------------------------------------------------------------- result
@dataclass
class Mismatch:
    rank: int
    graph: str
    what: str  # missing | extra | order | runs | name | kind | group | issue_group | sent_bytes | ...
    index: Optional[int] = None
    name: str = ""
    expected: Any = None
    got: Any = None
    run: Optional[int] = None

    def describe(self) -> str:
        where = f"rank {self.rank} {self.graph}"
        if self.run is not None:
            where += f" run {self.run}"
        coll = f" #{self.index} {self.name}" if self.index is not None else ""
        return f"{where}{coll}: {self.what}: expected {self.expected!r}, got {self.got!r}"


@dataclass
class CollectiveCheck:
    """One planned collective on one rank, over all its recorded runs."""

    rank: int
    graph: str
    index: int
    name: str
    kind: str
    group: str
    group_size: Optional[int]
    runs: int  # times recorded
    predicted_logged: Optional[int]
    predicted_sent: Optional[int]
    predicted_received: Optional[int]
    measured_logged: Optional[int]  # derived from the measured sent/received (NCCL count semantics)
    measured_sent: Optional[int]
    measured_received: Optional[int]
    predicted_us: Optional[float]
    measured_us: Optional[float]  # median over runs (the first left out when there are more)

    @property
    def time_error(self) -> Optional[float]:
        """(measured - predicted) / predicted."""
        if self.predicted_us is None or self.measured_us is None or self.predicted_us <= 0:
            return None
        return (self.measured_us - self.predicted_us) / self.predicted_us


@dataclass
class ValidationReport:
    ranks: list[int]
    checks: list[CollectiveCheck] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cost_model: str = ""

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        d["summary"] = self.summary()
        return d

    def summary(self) -> dict[str, Any]:
        errs = [abs(c.time_error) for c in self.checks if c.time_error is not None]
        return {
            "ranks": len(self.ranks),
            "planned_collectives": len(self.checks),
            "recorded_calls": sum(c.runs for c in self.checks),
            "mismatches": len(self.mismatches),
            "measured_us": sum(c.measured_us * c.runs for c in self.checks if c.measured_us is not None),
            "predicted_us": sum(c.predicted_us * c.runs for c in self.checks if c.predicted_us is not None),
            "median_abs_time_error": statistics.median(errs) if errs else None,
        }

    def table(self, *, max_rows: int = 40) -> str:
        s = self.summary()
        lines = [
            f"measured vs predicted: {s['ranks']} rank(s), {s['planned_collectives']} planned collectives, "
            f"{s['recorded_calls']} recorded calls, {s['mismatches']} mismatch(es)"
        ]
        lines.append(
            f"time: cost model {self.cost_model}; measured {s['measured_us']:.0f} us vs predicted "
            f"{s['predicted_us']:.0f} us in total"
            + (
                f", median |error| {100 * s['median_abs_time_error']:.0f}%"
                if s["median_abs_time_error"] is not None
                else ""
            )
        )
        for m in self.mismatches[:max_rows]:
            lines.append("MISMATCH " + m.describe())
        if len(self.mismatches) > max_rows:
            lines.append(f"... {len(self.mismatches) - max_rows} more mismatches")
        lines.append(
            f"{'rank':>4} {'graph':<14}{'#':>4} {'kind':<15}{'node':<30}{'runs':>5}{'sent B':>10}"
            f"{'recv B':>10}{'logged B':>10}{'meas us':>10}{'pred us':>10}"
        )
        for c in self.checks[:max_rows]:
            lines.append(
                f"{c.rank:>4} {c.graph[:13]:<14}{c.index:>4} {c.kind[:14]:<15}{c.name[:29]:<30}{c.runs:>5}"
                f"{_f(c.measured_sent):>10}{_f(c.measured_received):>10}{_f(c.measured_logged):>10}"
                f"{_fus(c.measured_us):>10}{_fus(c.predicted_us):>10}"
            )
        if len(self.checks) > max_rows:
            lines.append(f"... {len(self.checks) - max_rows} more collectives")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _f(x: Optional[int]) -> str:
    return "?" if x is None else str(x)


def _fus(x: Optional[float]) -> str:
    return "?" if x is None else f"{x:.0f}"


# ----------------------------------------------------------------------------- predictions
def _elt(dtype: Optional[str]) -> Optional[int]:
    dt = getattr(torch, dtype, None) if dtype else None
    return dt.itemsize if isinstance(dt, torch.dtype) else None


def _bytes(shapes: Sequence[Optional[Sequence[Any]]], elt: Optional[int]) -> Optional[int]:
    if elt is None:
        return None
    total = 0
    for s in shapes:
        if s is None or any(not isinstance(x, int) for x in s):
            return None
        n = 1
        for x in s:
            n *= x
        total += n * elt
    return total


def _measured_logged(kind: str, sent: int, received: int) -> int:
    # NCCL count semantics at the call: reduce_scatter logs its receive count, every other
    # kind the buffer it sends (all_gather: the per-rank send count).
    return received if kind == "reduce_scatter" else sent


def _message_size(kind: str, sent: Optional[int], received: Optional[int]) -> Optional[int]:
    """nccl-tests message size: all_gather the total output, everything else the input."""
    return received if kind == "all_gather" else sent


class _TimeModel:
    def __init__(
        self, profile: Any = None, topology: Any = None, backend: Optional[str] = None, world_size: int = 2
    ) -> None:

        self.model, self.describe = cost_model(profile, topology, backend, world_size)

    def time_us(self, kind: str, size: Optional[int], n: Optional[int]) -> Optional[float]:
        if size is None or n is None:
            return None
        try:
            k = CollectiveKind(kind)
        except ValueError:
            return None
        est = self.model.collectives.time(k, int(size), int(n))
        extra = self.model.runtime.collective_in_graph_us if est.time_us > 0 else 0.0
        return est.time_us + (extra or 0.0)


# ----------------------------------------------------------------------------- matching
def _split_runs(recs: list[RecordedCollective]) -> list[list[RecordedCollective]]:
    """A run is one pass through the plan: a record whose index the current run already holds
    starts the next run. Records out of order inside a run stay in it (reported as "order")."""
    runs: list[list[RecordedCollective]] = []
    seen: set[int] = set()
    for r in recs:
        if not runs or r.index in seen:
            runs.append([])
            seen = set()
        runs[-1].append(r)
        seen.add(r.index)
    return runs


def _consistent(plan: dict[str, Any], recs: Iterable[RecordedCollective]) -> bool:
    pcs = plan.get("collectives", [])
    for r in recs:
        if not 0 <= r.index < len(pcs):
            return False
        p = pcs[r.index]
        if p["start"] != r.name or p["kind"] != r.kind:
            return False
    return True


def _label_kind(label: str) -> str:
    return label.split("#", 1)[0]


def validate_rank(
    rank: int,
    records: Sequence[RecordedCollective],
    plans: Sequence[PlannedGraph],
    time_model: Optional[_TimeModel] = None,
) -> tuple[list[CollectiveCheck], list[Mismatch], dict]:
    """Checks and mismatches for one rank; the third value maps plan name -> runs (cross-rank check)."""
    by_label: dict[str, list[RecordedCollective]] = defaultdict(list)
    for r in records:
        if r.graph != KERNEL_GRAPH:  # an op's own collectives: no lowering plan issued them
            by_label[r.graph].append(r)
    checks: list[CollectiveCheck] = []
    mismatches: list[Mismatch] = []
    runs_of: dict[str, int] = defaultdict(int)
    claimed: dict[str, str] = {}  # plan name -> label
    for label, recs in by_label.items():
        cands = [p for p in plans if p.kind == _label_kind(label) and _consistent(p.plan, recs)]
        free = [p for p in cands if p.name not in claimed]
        chosen = (free or cands or [None])[0]
        if chosen is None:
            r0 = recs[0]
            mismatches.append(
                Mismatch(
                    rank,
                    label,
                    "unplanned",
                    r0.index,
                    r0.name,
                    expected="a lowering plan whose collectives match",
                    got=f"{len(recs)} calls",
                )
            )
            continue
        claimed.setdefault(chosen.name, label)
        runs = _split_runs(recs)
        runs_of[chosen.name] += len(runs)
        _check_runs(rank, chosen, label, runs, checks, mismatches, time_model)
    return checks, mismatches, dict(runs_of)


def _check_runs(
    rank: int,
    pg: PlannedGraph,
    label: str,
    runs: list[list[RecordedCollective]],
    checks: list[CollectiveCheck],
    mismatches: list[Mismatch],
    tm: Optional[_TimeModel],
) -> None:
    pcs = pg.plan.get("collectives", [])
    gname = pg.name
    analysis = {c.node: c for c in pg.analysis.collectives} if pg.analysis is not None else {}
    seen: dict[int, list[RecordedCollective]] = defaultdict(list)
    for ri, run in enumerate(runs):
        got = [r.index for r in run]
        for i in range(len(pcs)):
            if i not in got:
                p = pcs[i]
                mismatches.append(
                    Mismatch(
                        rank, gname, "missing", i, p["start"], expected=p["kind"], got="not recorded", run=ri
                    )
                )
        extra = [i for i in got if not 0 <= i < len(pcs)]
        if extra:
            mismatches.append(
                Mismatch(
                    rank,
                    gname,
                    "extra",
                    extra[0],
                    "",
                    expected=f"indices < {len(pcs)}",
                    got=f"indices {extra}",
                    run=ri,
                )
            )
        if got != sorted(got):
            first = next(a for a, b in zip(got, sorted(got), strict=True) if a != b)
            mismatches.append(
                Mismatch(
                    rank,
                    gname,
                    "order",
                    first,
                    pcs[first]["start"] if first < len(pcs) else "",
                    expected="the plan's issue order",
                    got=f"indices {got}",
                    run=ri,
                )
            )
        for r in run:
            seen[r.index].append(r)
    for i, p in enumerate(pcs):
        recs = seen.get(i, [])
        c = analysis.get(p["start"])
        elt = _elt(c.dtype) if c is not None else None
        pred_sent = _bytes(c.input_shapes, elt) if c is not None else None
        pred_recv = _bytes(c.output_shapes, elt) if c is not None else None
        n = c.group_size if c is not None else None
        sent = recs[0].sent_bytes if recs else None
        recv = recs[0].received_bytes if recs else None
        measured_logged = None
        for r in recs:
            for what, exp, val in (
                ("name", p["start"], r.name),
                ("kind", p["kind"], r.kind),
                ("group", p["group"], r.group),
                ("issue_group", p["issue_group"], r.issue_group),
                ("logged_bytes (recorded)", p["logged_bytes"], r.logged_bytes),
            ):
                if exp != val:
                    mismatches.append(Mismatch(rank, gname, what, i, p["start"], expected=exp, got=val))
            # Exact bytes, every call: against the analysis when it is known, else against the
            # first run (a rank must hand c10d the same buffers every run).
            exp_recv = pred_recv if pred_recv is not None else recv
            if r.received_bytes != exp_recv:
                mismatches.append(
                    Mismatch(rank, gname, "received_bytes", i, p["start"], exp_recv, r.received_bytes)
                )
            if r.sent_bytes:  # 0: issued through the graph's own op; the sent side is not measured
                exp_sent = pred_sent if pred_sent is not None else sent
                if r.sent_bytes != exp_sent:
                    mismatches.append(
                        Mismatch(rank, gname, "sent_bytes", i, p["start"], exp_sent, r.sent_bytes)
                    )
                got_logged = _measured_logged(p["kind"], r.sent_bytes, r.received_bytes)
                if p["logged_bytes"] is not None and got_logged != p["logged_bytes"]:
                    mismatches.append(
                        Mismatch(rank, gname, "logged_bytes", i, p["start"], p["logged_bytes"], got_logged)
                    )
                measured_logged = got_logged if measured_logged is None else measured_logged
        # The first run also waits for the other ranks to finish compiling: leave it out when
        # later runs exist.
        durations = [
            r.duration_us for r in (recs[1:] if len(recs) > 1 else recs) if r.duration_us is not None
        ]
        size = _message_size(p["kind"], pred_sent, pred_recv)
        checks.append(
            CollectiveCheck(
                rank,
                gname,
                i,
                p["start"],
                p["kind"],
                p["group"],
                n,
                len(recs),
                p["logged_bytes"],
                pred_sent,
                pred_recv,
                measured_logged,
                sent or None,
                recv,
                tm.time_us(p["kind"], size, n) if tm is not None else None,
                statistics.median(durations) if durations else None,
            )
        )


def validate(
    records_by_rank: dict[int, Sequence[RecordedCollective]],
    plans_by_rank: dict[int, Sequence[PlannedGraph]],
    *,
    profile: Any = None,
    topology: Any = None,
    backend: Optional[str] = None,
) -> ValidationReport:
    """Match every rank's records to its plans (see the module docstring)."""
    ranks = sorted(records_by_rank)
    if not ranks:
        raise ValueError("validate: no recorded ranks")
    missing = [r for r in ranks if r not in plans_by_rank]
    if missing:
        raise ValueError(f"validate: no lowering plans for rank(s) {missing}")
    tm = _TimeModel(profile, topology, backend, world_size=len(ranks))
    rep = ValidationReport(ranks=ranks, cost_model=tm.describe)
    runs: dict[int, dict[str, int]] = {}
    for r in ranks:
        checks, mism, runs[r] = validate_rank(r, records_by_rank[r], plans_by_rank[r], tm)
        rep.checks.extend(checks)
        rep.mismatches.extend(mism)
    ref = runs[ranks[0]]
    for r in ranks[1:]:
        for name in sorted(set(ref) | set(runs[r])):
            if ref.get(name, 0) != runs[r].get(name, 0):
                rep.mismatches.append(
                    Mismatch(
                        r,
                        name,
                        "runs",
                        expected=f"{ref.get(name, 0)} (rank {ranks[0]})",
                        got=runs[r].get(name, 0),
                    )
                )
    embedded = {
        (p.name, len(p.analysis.embedded))
        for ps in plans_by_rank.values()
        for p in ps
        if p.analysis is not None and p.analysis.embedded
    }
    if embedded:
        rep.notes.append(
            "collectives issued inside ops (e.g. the MoE layer's token exchange: "
            + ", ".join(f"{n}: {k}" for n, k in sorted(embedded))
            + ' per graph) are recorded under the graph "kernel" and not validated against a plan'
        )
    unsent = sum(1 for c in rep.checks if c.runs and c.measured_sent is None)
    if unsent:
        rep.notes.append(
            f"{unsent} collective(s) ran through the graph's own op (no native issuer): "
            "their received bytes are checked, their sent bytes are not measured"
        )
    return rep


def validate_run(recorder: Any, backend: Any, *, rank: Optional[int] = None, **kw: Any) -> ValidationReport:
    """One rank, in memory: a :class:`commfuse.Recorder` and the backend (or TrainStep) that compiled."""
    r = recorder.rank if rank is None else rank
    return validate({r: records_from_recorder(recorder)}, {r: plans_from_backend(backend)}, **kw)


def load_records(record_dir: str | Path) -> dict[int, list[RecordedCollective]]:
    d = Path(record_dir)
    out = {}
    for p in sorted(d.glob("rank*.json")):
        m = re.fullmatch(r"rank(\d+)\.json", p.name)
        if m:
            doc = read_json_object(p, "recorder trace", "traceEvents")
            try:
                out[int(m.group(1))] = records_from_trace(doc)
            except ValueError as e:  # an event without the recorder's fields: say which file
                raise InputFileError(p, str(e)) from e
    if not out:
        raise ValueError(
            f"record dir {str(d)!r} holds no rank<r>.json recorder traces "
            "(record with commfuse.record(dir) or COMMFUSE_RECORD_DIR)"
        )
    return out


def load_plans(dump_dir: str | Path, ranks: Iterable[int]) -> dict[int, list[PlannedGraph]]:
    """Plans per rank: from ``rank<r>/`` sub-directories when the dump dir has them, else the
    dump dir's own plans for every rank (plans are identical on every rank)."""
    per = rank_dirs(dump_dir)
    out = {}
    for r in ranks:
        d = per.get(r, None) if per else Path(dump_dir)
        if d is None:
            raise ValueError(f"dump dir {str(dump_dir)!r}: no rank{r} sub-directory")
        plans = plans_from_dump_dir(d)
        if not plans:
            raise ValueError(
                f"dump dir {str(d)!r} holds no lowering_plan.json (compile with "
                "Config(dump_dir=...) and the default lowering='commfuse')"
            )
        out[r] = plans
    return out


def validate_dirs(record_dir: str | Path, dump_dir: str | Path, **kw: Any) -> ValidationReport:
    """``commfuse validate RECORD_DIR DUMP_DIR``: every rank's trace against its plans."""
    records = load_records(record_dir)
    return validate(records, load_plans(dump_dir, records), **kw)
