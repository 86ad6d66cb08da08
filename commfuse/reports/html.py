"""`commfuse report DUMP_DIR`: one static, self-contained HTML page about a compiled program.

Contract
    :func:`render_html` reads one rank's dump directory (``<kind>_<i>/`` graph dumps,
    ``pipeline.json``, ``lowering_plan.json``, and what ``commfuse.passmgr.report_facts.ReportFacts``
    writes beside them: ``report_facts.json``, ``predicted_trace.json``,
    ``predicted_trace_input.json``) and, optionally, a recorder directory (``rank<r>.json``),
    and returns one HTML document rendered from the Jinja2 templates in ``templates/``
    (``<h2>`` ids in brackets):

    * What commfuse did [summary], the first screen: per graph that runs (forward, backward,
      inference), before and after commfuse, the predicted time and exposed communication
      (the simulator's, with the cost model named) and the collectives and wire bytes per
      rank, with the step total; executor-specific lowerings (``EXECUTOR_LOWERINGS``: the gloo
      reduce_scatter rewrite) shown apart and not counted as commfuse's result; the predicted
      timeline of each graph as it runs; formula checks and, with a recorder, validation.
      "Before" bytes of a forward / backward graph are the joint graph as traced, split by
      direction; "after" is the graph commfuse produced before any executor lowering.
    * Communication volume [volume]: the same before/after per kind, role, process group
      (named by mesh dim where the dumps say) and direction;
    * Collectives [collectives]: every collective, one collapsible block per graph and layer;
    * Pass decisions [passes]: what each pass did and every refusal ("why not fused");
    * Graphs [graphs]: before/after pictures (Graphviz SVGs); a click shows one at full size;
    * Timelines [timelines]: predicted before and as run per graph, measured per rank;
    * Measured vs predicted [validation] (with a recorder directory): the validator's result.

Guarantees
    The page needs no server, loads nothing and runs no script: styles are inline, pictures
    are ``data:`` URIs shown through ``<img>`` (an SVG there never runs scripts), the full-size
    view is a CSS checkbox toggle, timelines are inline SVG. Templates autoescape: every name
    taken from a dump or trace (node, group, layer, pass, refusal, file and track names) is
    HTML-escaped. Dumps written before ``report_facts.json`` existed still render (their
    groups by name, their joint graph undivided, no prediction), with notes saying so.
"""

from __future__ import annotations

import base64
import bisect
import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import jinja2

from commfuse._version import __version__
from commfuse.core.jsonfile import read_json_object, read_model_file
from commfuse.passmgr.report import AnalysisReport, PipelineReport
from commfuse.reports.timeline import (
    EXECUTOR_LOWERINGS,
    PREDICTED_INPUT_TRACE,
    PREDICTED_TRACE,
    REPORT_FACTS,
    RUNTIME_KINDS,
)
from commfuse.reports.validate import ValidationReport, validate_dirs
from commfuse.reports.volume import (
    CollectiveVolume,
    Totals,
    VolumeReport,
    _DIR_RE,
    _stage_files,
    collectives_of,
    graph_dirs,
    group_totals,
    rank_dirs,
    resolve_rank_dir,
    volume_from_dump_dir,
)

KIND_COLORS = {
    "all_reduce": "#e6550d",
    "all_gather": "#3182bd",
    "reduce_scatter": "#31a354",
    "all_to_all": "#756bb1",
    "broadcast": "#8c6d31",
    "reduce": "#d6616b",
}
COMPUTE_COLOR, EXPOSED_COLOR = "#9e9e9e", "#de2d26"

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("commfuse.reports", "templates"),
    autoescape=True,
    trim_blocks=True,
    lstrip_blocks=True,
)


# ----------------------------------------------------------------------------- formatting
def fmt_bytes(x: Optional[int]) -> str:
    if x is None:
        return "?"
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(x) >= k:
            return f"{x / k:,.1f} {unit}"
    return f"{x:,} B"


def fmt_us(x: Optional[float]) -> str:
    if x is None:
        return "?"
    if abs(x) >= 1e6:
        return f"{x / 1e6:,.2f} s"
    if abs(x) >= 1e3:
        return f"{x / 1e3:,.2f} ms"
    return f"{x:,.1f} µs"


def fmt_change(b: Optional[float], a: Optional[float]) -> str:
    if a is None or b is None:
        return "?"
    if a == b:
        return "no change"
    if b == 0:
        return "new"
    pct = 100.0 * (a - b) / b
    return "±0.0%" if abs(pct) < 0.05 else f"{pct:+.1f}%"


def change_class(b: Optional[float], a: Optional[float]) -> str:
    if a is None or b is None or a == b or (b and abs(a - b) / abs(b) < 5e-4):
        return ""
    return "better" if a < b else "worse"


def fmt_int(x: Optional[int]) -> str:
    return "?" if x is None else f"{x:,}"


_ENV.filters.update(bytes=fmt_bytes, us=fmt_us, int=fmt_int)
_ENV.globals.update(
    change=fmt_change,
    change_class=change_class,
    kind_colors=KIND_COLORS,
    compute_color=COMPUTE_COLOR,
    exposed_color=EXPOSED_COLOR,
)


# ----------------------------------------------------------------------------- reading the dumps
@dataclass
class GraphDump:
    """One graph's dump directory, read."""

    name: str
    kind: str
    index: str
    path: Path
    facts: dict[str, Any]
    report: Optional[PipelineReport]
    stages: list[Path]
    input: Optional[AnalysisReport] = None  # the graph the pipeline received
    result: Optional[AnalysisReport] = None  # commfuse's result, before executor lowerings
    as_run: Optional[AnalysisReport] = None  # what runs (after executor lowerings)
    lowered_by: list[str] = field(default_factory=list)  # executor lowerings that changed it

    @property
    def predicted(self) -> dict[str, dict[str, float]]:
        return self.facts.get("predicted", {})


def _read_graph(d: Path) -> GraphDump:
    m = _DIR_RE.match(d.name)
    facts: dict[str, Any] = {}
    if (d / REPORT_FACTS).exists():
        facts = read_json_object(d / REPORT_FACTS, "report facts")
    rep = (
        read_model_file(PipelineReport, d / "pipeline.json", "pipeline report")
        if (d / "pipeline.json").exists()
        else None
    )
    stages = _stage_files(d)
    g = GraphDump(d.name, m["kind"], m["index"], d, facts, rep, stages)
    read = {p: read_model_file(AnalysisReport, p, "analysis dump") for p in stages}
    if stages and stages[0].name.endswith("_input.json"):
        g.input = read[stages[0]]
    g.as_run = (
        rep.analysis
        if rep is not None and rep.analysis is not None
        else (read[stages[-1]] if stages else None)
    )
    g.result = g.as_run
    for i, p in enumerate(stages):
        label = p.stem.split("_", 1)[1] if "_" in p.stem else p.stem
        if label.startswith("after_") and label[len("after_") :] in EXECUTOR_LOWERINGS:
            g.result = read[stages[i - 1]] if i > 0 else None
            g.lowered_by = [
                q.stem.split("_after_", 1)[1]
                for q in stages[i:]
                if "_after_" in q.stem and q.stem.split("_after_", 1)[1] in EXECUTOR_LOWERINGS
            ]
            break
    return g


class GroupNames:
    """Process group name -> what the page calls it: the mesh dim where the dumps say."""

    def __init__(self, graphs: Sequence[GraphDump]) -> None:
        self.info: dict[str, dict[str, Any]] = {}
        for g in graphs:
            for name, info in g.facts.get("groups", {}).items():
                self.info.setdefault(name, info)

    def label(self, name: str) -> str:
        dim = self.info.get(name, {}).get("mesh_dim")
        return f"{dim} (mesh dim)" if dim else f"group {name}"

    def title(self, name: str) -> str:
        i = self.info.get(name)
        if i is None:
            return f"process group {name!r}"
        ranks = i.get("ranks")
        where = f"; mesh dim from the {i['mesh_dim_source']}" if i.get("mesh_dim") else ""
        return (
            f"process group {name!r}, size {i.get('size')}, ranks {ranks if ranks is not None else '?'}, "
            f"role {i.get('role') or 'inferred per collective'}{where}"
        )


@dataclass
class Side:
    """The collectives of one graph on one side, with totals."""

    rows: Optional[list[CollectiveVolume]]

    @property
    def total(self) -> Optional[Totals]:
        if self.rows is None:
            return None
        t = Totals()
        for c in self.rows:
            t.add(c)
        return t

    def kinds(self) -> str:
        if not self.rows:
            return "none"
        return ", ".join(f"{t.count} {k}" for k, t in group_totals(self.rows, "kind").items())


@dataclass
class RunGraph:
    """A graph that runs, before and after commfuse (and as run, when an executor lowering changed it)."""

    dump: GraphDump
    label: str
    before: Side
    after: Side
    as_run: Side
    before_source: str
    predicted_before: Optional[dict[str, float]]
    predicted_after: Optional[dict[str, float]]
    predicted_as_run: Optional[dict[str, float]]


def _rows(
    a: Optional[AnalysisReport],
    g: GraphDump,
    side: str,
    direction: str,
    directions: Optional[dict[str, str]] = None,
) -> Optional[list[CollectiveVolume]]:
    return (
        None
        if a is None
        else collectives_of(a, graph=g.name, side=side, direction=direction, directions=directions)
    )


def _run_graphs(graphs: Sequence[GraphDump], notes: list[str]) -> list[RunGraph]:
    joints = {g.index: g for g in graphs if g.kind == "joint"}
    runs = [g for g in graphs if g.kind in RUNTIME_KINDS]
    several = len({g.index for g in runs}) > 1
    out = []
    for g in runs:
        before_rows, source = _rows(g.input, g, "before", g.kind), "the graph the scheduling passes received"
        joint = joints.get(g.index) if g.kind in ("forward", "backward") else None
        if joint is not None and joint.input is not None:
            dirs = joint.facts.get("directions")
            if dirs is not None:
                rows = collectives_of(
                    joint.input, graph=g.name, side="before", direction="joint", directions=dirs
                )
                before_rows, source = (
                    [c for c in rows if c.direction == g.kind],
                    f"the joint graph as traced ({joint.name}), its {g.kind} part",
                )
        pred = g.predicted
        out.append(
            RunGraph(
                g,
                g.name if several else g.kind,
                Side(before_rows),
                Side(_rows(g.result, g, "after", g.kind)),
                Side(_rows(g.as_run, g, "as run", g.kind)),
                source,
                pred.get("input"),
                pred.get("commfuse", pred.get("as_run")),
                pred.get("as_run"),
            )
        )
    for j in joints.values():
        if j.input is not None and "directions" not in j.facts:
            notes.append(
                f"{j.name}: the dumps do not split the joint graph into forward and backward (written "
                "before report_facts.json existed): 'before' is each graph as the scheduling passes "
                "received it"
            )
        changed = [p.name for p in (j.report.passes if j.report else []) if p.changed]
        if changed:
            notes.append(
                f"{j.name}: {', '.join(changed)} rewrote the joint graph before it was partitioned: "
                "'before' bytes are the joint graph as traced; 'before' times are the partitioned "
                "graphs, which already hold those rewrites"
            )
    return out


def _total(values: Sequence[Optional[float]]) -> Optional[float]:
    return None if any(v is None for v in values) or not values else sum(values)  # type: ignore[arg-type]


def _summary_rows(runs: Sequence[RunGraph]) -> list[dict[str, Any]]:
    """The first screen's table: one row per graph that runs (and the step), one cell per figure."""

    def pred(r: RunGraph, which: str, key: str) -> Optional[float]:
        p = getattr(r, f"predicted_{which}")
        return None if p is None else p.get(key)

    rows = []
    for r in runs:
        tb, ta = r.before.total, r.after.total
        rows.append(
            {
                "label": r.label,
                "total": False,
                "cells": [
                    {
                        "id": f"time-{r.label}",
                        "fmt": "us",
                        "b": pred(r, "before", "makespan_us"),
                        "a": pred(r, "after", "makespan_us"),
                    },
                    {
                        "id": f"exposed-{r.label}",
                        "fmt": "us",
                        "b": pred(r, "before", "exposed_comm_us"),
                        "a": pred(r, "after", "exposed_comm_us"),
                    },
                    {
                        "id": f"wire-{r.label}",
                        "fmt": "bytes",
                        "b": tb.wire_bytes if tb else None,
                        "a": ta.wire_bytes if ta else None,
                    },
                    {
                        "id": f"count-{r.label}",
                        "fmt": "int",
                        "b": tb.count if tb else None,
                        "a": ta.count if ta else None,
                        "title": f"before: {r.before.kinds()}; after: {r.after.kinds()}",
                    },
                ],
            }
        )
    if len(rows) > 1:
        rows.append(
            {
                "label": "step (" + " + ".join(r.label for r in runs) + ")",
                "total": True,
                "cells": [
                    {
                        "id": f"{what}-step",
                        "fmt": c["fmt"],
                        "b": _total([row["cells"][i]["b"] for row in rows]),
                        "a": _total([row["cells"][i]["a"] for row in rows]),
                    }
                    for i, (what, c) in enumerate(
                        zip(("time", "exposed", "wire", "count"), rows[0]["cells"], strict=True)
                    )
                ],
            }
        )
    return rows


def _lowerings(runs: Sequence[RunGraph]) -> list[dict[str, Any]]:
    out = []
    for r in runs:
        if not r.dump.lowered_by:
            continue
        a, z = r.after.total, r.as_run.total
        out.append(
            {
                "graph": r.label,
                "passes": ", ".join(r.dump.lowered_by),
                "before": r.after.kinds(),
                "after": r.as_run.kinds(),
                "wire_before": a.wire_bytes if a else None,
                "wire_after": z.wire_bytes if z else None,
                "time_before": (r.predicted_after or {}).get("makespan_us"),
                "time_after": (r.predicted_as_run or {}).get("makespan_us"),
            }
        )
    return out


# ----------------------------------------------------------------------------- timelines
def _trace_events(trace: dict[str, Any]) -> tuple[dict[tuple[Any, Any], str], list[dict[str, Any]]]:
    names: dict[tuple[Any, Any], str] = {}
    events = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "M" and ev.get("name") == "thread_name":
            names[(ev.get("pid"), ev.get("tid"))] = str(ev.get("args", {}).get("name", ev.get("tid")))
        elif (
            ev.get("ph") == "X"
            and isinstance(ev.get("ts"), (int, float))
            and isinstance(ev.get("dur"), (int, float))
        ):
            events.append(ev)
    return names, events


def _event_color(ev: dict[str, Any]) -> str:
    cat = str(ev.get("cat", ""))
    if cat.startswith("comm"):
        kind = cat.split(",", 1)[1] if "," in cat else ""
        return KIND_COLORS.get(kind, "#636363")
    if "exposed" in cat or cat == "wait" or str(ev.get("name", "")).startswith("wait"):
        return EXPOSED_COLOR
    return COMPUTE_COLOR


def _compressor(events: Sequence[dict[str, Any]]):
    """Map trace time to plot time with idle gaps cut short: a stretch where no event runs and
    that is longer than 2% of the busy time is drawn as 1% of it (a recording spans compiles and
    the Python between steps). Returns (map, plotted span, [(plotted x, real gap us)], busy)."""
    iv = sorted((ev["ts"], ev["ts"] + ev["dur"]) for ev in events)
    merged: list[list[float]] = []
    for a, b in iv:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    busy = sum(b - a for a, b in merged) or 1.0
    cut, shown = 0.02 * busy, 0.01 * busy
    offsets = [0.0]  # plotted start of each busy block
    gaps: list[tuple[float, float]] = []
    for i in range(1, len(merged)):
        gap = merged[i][0] - merged[i - 1][1]
        drawn = shown if gap > cut else gap
        offsets.append(offsets[-1] + (merged[i - 1][1] - merged[i - 1][0]) + drawn)
        if gap > cut:
            gaps.append((offsets[-1] - drawn / 2, gap))
    starts = [a for a, _ in merged]

    def to_plot(t: float) -> float:
        i = max(0, bisect.bisect_right(starts, t) - 1)
        return offsets[i] + min(t - merged[i][0], merged[i][1] - merged[i][0])

    span = offsets[-1] + merged[-1][1] - merged[-1][0]
    return to_plot, max(span, 1e-9), gaps, busy


def timeline_svg(
    trace: dict[str, Any],
    *,
    title: str,
    width: int = 1200,
    kind: str = "",
    names_of: Optional[GroupNames] = None,
) -> str:
    """A Chrome trace (simulator or recorder) as an inline SVG: one lane per track, one bar per
    event (neighbours of one colour closer than half a pixel drawn as one bar), idle gaps cut
    short (marked with a dashed line and their length)."""
    names, events = _trace_events(trace)
    if not events:
        return _ENV.get_template("timeline.svg.j2").render(title=title, empty=True, kind=kind)
    lanes = sorted({(ev.get("pid"), ev.get("tid")) for ev in events}, key=lambda k: (str(k[0]), str(k[1])))
    lane_of = {k: i for i, k in enumerate(lanes)}
    several_pids = len({p for p, _ in lanes}) > 1
    to_plot, span, gaps, busy = _compressor(events)
    label_w, lane_h, top = 170, 18, 22
    plot_w = width - label_w - 10
    t0 = min(ev["ts"] for ev in events)
    bars: list[dict[str, Any]] = []
    last: dict[int, dict[str, Any]] = {}
    for ev in sorted(events, key=lambda e: e["ts"]):
        i = lane_of[(ev.get("pid"), ev.get("tid"))]
        a, b = to_plot(ev["ts"]), to_plot(ev["ts"] + ev["dur"])
        x, w, color = label_w + a / span * plot_w, max((b - a) / span * plot_w, 0.5), _event_color(ev)
        prev = last.get(i)
        if prev is not None and prev["color"] == color and x - (prev["x"] + prev["w"]) < 0.5:
            prev["w"] = max(prev["w"], x + w - prev["x"])
            prev["n"] += 1
            prev["dur"] += ev["dur"]
            continue
        bar = {
            "x": x,
            "y": top + i * lane_h + 1,
            "w": w,
            "color": color,
            "n": 1,
            "dur": ev["dur"],
            "name": str(ev.get("name", "")),
            "cat": str(ev.get("cat", "")),
            "at": ev["ts"] - t0,
        }
        bars.append(bar)
        last[i] = bar
    lane_rows = []
    for (pid, tid), i in lane_of.items():
        name = names.get((pid, tid), f"track {tid}")
        if names_of is not None and name.startswith("comm:"):  # the simulator's stream of a process group
            name = "comm: " + names_of.label(name[len("comm:") :])
        lane_rows.append({"y": top + i * lane_h, "label": (f"{name} [{pid}]" if several_pids else name)[:28]})
    bottom = top + lane_h * len(lanes)
    return _ENV.get_template("timeline.svg.j2").render(
        title=title,
        empty=False,
        kind=kind,
        width=width,
        height=bottom + 24,
        label_w=label_w,
        plot_w=plot_w,
        lane_h=lane_h,
        top=top,
        bottom=bottom,
        lanes=lane_rows,
        bars=bars,
        gaps=[{"x": label_w + gx / span * plot_w, "gap": gap} for gx, gap in gaps],
        busy=busy,
        extent=max(ev["ts"] + ev["dur"] for ev in events) - t0,
    )


def _predicted_timelines(graphs: Sequence[GraphDump], names: GroupNames) -> list[dict[str, Any]]:
    out = []
    for g in graphs:
        for fname, what in (
            (PREDICTED_INPUT_TRACE, "before commfuse (as the scheduling passes received it)"),
            (PREDICTED_TRACE, "as run"),
        ):
            p = g.path / fname
            if p.exists():
                trace = read_json_object(p, "predicted trace", "traceEvents")
                model = trace.get("otherData", {}).get("cost_model", "")
                out.append(
                    {
                        "graph": g.name,
                        "what": what,
                        "model": model,
                        "as_run": fname == PREDICTED_TRACE,
                        "svg": timeline_svg(
                            trace, title=f"{g.name} predicted, {what}", kind="predicted", names_of=names
                        ),
                    }
                )
    return out


# ----------------------------------------------------------------------------- tables
def _volume_tables(
    before: list[CollectiveVolume], after: list[CollectiveVolume], names: GroupNames
) -> list[dict[str, Any]]:
    tables = []
    for by, title in (
        ("kind", "per kind"),
        ("role", "per parallel role"),
        ("group", "per process group"),
        ("direction", "per direction"),
    ):
        tb, ta = group_totals(before, by), group_totals(after, by)
        rows = []
        for k in sorted(set(tb) | set(ta)):
            b, a = tb.get(k, Totals()), ta.get(k, Totals())
            rows.append(
                {
                    "key": names.label(k) if by == "group" else k,
                    "title": names.title(k) if by == "group" else "",
                    "b": b,
                    "a": a,
                }
            )
        tables.append({"by": by, "title": title, "rows": rows})
    return tables


def _collective_blocks(graphs: Sequence[GraphDump], names: GroupNames) -> list[dict[str, Any]]:
    """Per graph, one block per layer (the layer that traced each collective, from the facts)."""
    out = []
    for g in graphs:
        layers = g.facts.get("layers", {})
        sides = (
            [("before", g.input), ("after", g.as_run)] if g.input is not g.as_run else [("after", g.as_run)]
        )
        by_layer: dict[str, list[dict[str, Any]]] = {}
        order: list[str] = []
        for side, a in sides:
            if a is None:
                continue
            for c in collectives_of(a, graph=g.name, side=side, direction=g.kind):
                layer = layers.get(c.node, "embedded in an op" if c.embedded else "(no layer recorded)")
                if layer not in by_layer:
                    by_layer[layer] = []
                    order.append(layer)
                f = c.formula
                by_layer[layer].append(
                    {
                        "c": c,
                        "group": names.label(c.group),
                        "group_title": names.title(c.group),
                        "formula": f"{f.name}: {f.expression}, {f.values}" if f else "-",
                        "formula_wire": "-"
                        if f is None
                        else f"{fmt_int(f.wire_bytes)} ({'=' if f.wire_diff == 0 else fmt_int(f.wire_diff)})",
                        "mismatch": f is not None and f.wire_diff not in (0, None),
                    }
                )
        blocks = []
        for layer in sorted(order, key=_layer_key):
            rows = by_layer[layer]
            t = {s: Side([r["c"] for r in rows if r["c"].side == s]).total for s in ("before", "after")}
            blocks.append(
                {
                    "layer": layer,
                    "rows": rows,
                    "before": t["before"],
                    "after": t["after"],
                    "mismatches": sum(r["mismatch"] for r in rows),
                }
            )
        if blocks:
            out.append({"graph": g.name, "blocks": blocks, "count": sum(len(b["rows"]) for b in blocks)})
    return out


def _layer_key(name: str) -> tuple:
    parts = name.replace("(", "~").split(".")
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts)


def _passes(vol: VolumeReport) -> list[dict[str, Any]]:
    by_graph: dict[str, list] = {}
    for p in vol.reasons():
        by_graph.setdefault(p.graph, []).append(p)
    out = []
    for g in vol.graphs:
        ps = by_graph.get(g.name, [])
        if not ps and not g.notes:
            continue
        rows = []
        for p in ps:
            rows.append(
                {
                    "p": p,
                    "counts": ", ".join(f"{k}={v}" for k, v in sorted(p.counts.items()) if v),
                    "state": "error (graph restored)"
                    if p.error
                    else ("changed" if p.changed else "unchanged"),
                    "executor": p.name in EXECUTOR_LOWERINGS,
                    "decisions": json.dumps(p.decisions, indent=1, default=str) if p.decisions else "",
                }
            )
        out.append(
            {
                "graph": g.name,
                "rows": rows,
                "notes": g.notes,
                "changed": sum(1 for p in ps if p.changed),
                "refusals": sum(len(p.refusals) for p in ps),
            }
        )
    return out


def _pictures(graphs: Sequence[GraphDump]) -> list[dict[str, Any]]:
    out = []
    for g in graphs:
        pics = sorted([*g.path.glob("[0-9][0-9]_*.svg"), *g.path.glob("[0-9][0-9]_*.dot")])
        if not pics:
            continue
        shown = [("before", pics[0])] + ([("after", pics[-1])] if pics[-1] != pics[0] else [])
        figs = []
        for side, p in shown:
            fig = {
                "caption": f"{g.name} {side}: {p.stem}",
                "id": f"pic-{g.name}-{side}",
                "svg": p.suffix == ".svg",
            }
            if fig["svg"]:
                fig["src"] = "data:image/svg+xml;base64," + base64.b64encode(p.read_bytes()).decode("ascii")
            else:
                text = p.read_text()
                fig["dot"] = text if len(text) < 20000 else text[:20000] + "\n..."
                fig["path"] = str(p)
            figs.append(fig)
        out.append({"graph": g.name, "stages": ", ".join(p.stem for p in pics), "figures": figs})
    return out


def _validation(val: ValidationReport) -> dict[str, Any]:
    rows = []
    for c in val.checks:
        err = c.time_error
        rows.append(
            [
                c.rank,
                c.graph,
                c.index,
                c.name,
                c.kind,
                c.runs,
                fmt_int(c.predicted_sent),
                fmt_int(c.measured_sent),
                fmt_int(c.predicted_received),
                fmt_int(c.measured_received),
                fmt_int(c.predicted_logged),
                fmt_int(c.measured_logged),
                "?" if c.measured_us is None else f"{c.measured_us:,.0f}",
                "?" if c.predicted_us is None else f"{c.predicted_us:,.0f}",
                "?" if err is None else f"{100 * err:+.0f}%",
            ]
        )
    return {"v": val, "s": val.summary(), "rows": rows}


# ----------------------------------------------------------------------------- page
def render_html(
    dump_dir: str | Path,
    *,
    rank: Optional[int] = None,
    record_dir: str | Path | None = None,
    profile: Any = None,
    title: Optional[str] = None,
) -> str:
    """The report page for one rank's dumps (``rank``: which ``rank<r>/`` when the dir has several)."""

    d = resolve_rank_dir(dump_dir, rank)
    ranks = sorted(rank_dirs(dump_dir))
    vol = volume_from_dump_dir(d)
    graphs = [_read_graph(p) for p in graph_dirs(d)]
    names = GroupNames(graphs)
    notes: list[str] = []
    runs = _run_graphs(graphs, notes)
    rec = Path(record_dir) if record_dir is not None else None
    val = validate_dirs(rec, dump_dir, profile=profile) if rec is not None else None
    models = sorted({g.facts["cost_model"] for g in graphs if g.facts.get("cost_model")})
    errors = [
        f"{g.name} ({stage}): {e}"
        for g in graphs
        for stage, e in g.facts.get("prediction_errors", {}).items()
    ]
    if any(r.predicted_after is None for r in runs):
        notes.append(
            "no prediction for some graphs: "
            + (
                "; ".join(errors)
                if errors
                else "dumps written before report_facts.json existed (recompile with dump_dir set)"
            )
        )
    before = [c for r in runs if r.before.rows for c in r.before.rows]
    after = [c for r in runs if r.after.rows for c in r.after.rows]
    timelines = _predicted_timelines(graphs, names)
    measured = []
    for p in sorted(rec.glob("rank*.json")) if rec is not None else []:
        trace = read_json_object(p, "recorder trace", "traceEvents")
        measured.append(
            {
                "name": p.stem,
                "svg": timeline_svg(trace, title=f"{p.stem} measured", kind="measured", names_of=names),
            }
        )
    checked = [c for c in vol.collectives() if c.formula is not None]
    # the volume report's note that the dumps hold no joint split is moot where report_facts.json gave one
    split = all("directions" in g.facts for g in graphs if g.kind == "joint")
    notes += [n for n in vol.notes if not (split and n.startswith("before = joint graph"))]
    sections = [
        ("summary", "What commfuse did"),
        ("volume", "Communication volume"),
        ("collectives", "Collectives"),
        ("passes", "Pass decisions"),
        ("graphs", "Graphs"),
        ("timelines", "Timelines"),
    ]
    if val is not None:
        sections.append(("validation", "Measured vs predicted"))
    return _ENV.get_template("report.html.j2").render(
        heading=title or f"commfuse report: {d}",
        version=__version__,
        now=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        source=vol.source,
        ranks=ranks,
        rank=0 if rank is None else rank,
        record=str(rec) if rec else None,
        sections=sections,
        runs=runs,
        summary=_summary_rows(runs),
        lowerings=_lowerings(runs),
        models=models,
        notes=notes,
        timelines=timelines,
        measured=measured,
        formulas_checked=len(checked),
        formulas_bad=len(vol.formula_mismatches()),
        validation=_validation(val) if val is not None else None,
        volume=_volume_tables(before, after, names),
        collectives=_collective_blocks(graphs, names),
        passes=_passes(vol),
        pictures=_pictures(graphs),
        legend=[("compute", COMPUTE_COLOR), ("blocked in a wait (exposed)", EXPOSED_COLOR)]
        + list(KIND_COLORS.items()),
        executor_lowerings=EXECUTOR_LOWERINGS,
    )


def write_html(dump_dir: str | Path, out: str | Path | None = None, **kw: Any) -> Path:
    """Write the page (default ``<dump_dir>/report.html``) and return its path."""
    path = Path(out) if out is not None else Path(dump_dir) / "report.html"
    text = render_html(dump_dir, **kw)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
