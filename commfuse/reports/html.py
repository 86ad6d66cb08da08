"""`commfuse report DUMP_DIR`: one static, self-contained HTML page about a compiled program.

Contract
    :func:`render_html` reads one rank's dump directory (``<kind>_<i>/`` graph dumps,
    ``pipeline.json``, ``lowering_plan.json``, ``predicted_trace.json``) and, optionally, a
    recorder directory (``rank<r>.json``), and returns one HTML document with these sections
    (``<h2>`` ids in brackets):

    * Summary [summary]: program totals before/after commfuse, formula checks, validation;
    * Communication volume [volume]: per kind, parallel role, group and direction;
    * Collectives [collectives]: every collective before/after with its analytic formula;
    * Pass decisions [passes]: what each pass did and every refusal ("why not fused");
    * Graphs [graphs]: before/after pictures (the dumps' Graphviz SVGs, collectives filled and
      coloured by group, waits dashed);
    * Timelines [timelines]: the predicted timeline of each lowered graph (simulator trace)
      and, with a recorder directory, the measured one per rank, drawn as inline SVG;
    * Measured vs predicted [validation] (with a recorder directory): the validator's result.

Guarantees
    The page needs no server and loads nothing: styles are inline, pictures are embedded as
    ``data:`` URIs (an SVG shown through ``<img>`` never runs scripts), timelines are inline
    SVG written here, and there is no JavaScript. Every name taken from a dump or trace (node,
    group, pass, refusal, file and track names) is HTML-escaped.
"""

from __future__ import annotations

import base64
import datetime
import html
import json
from pathlib import Path
from typing import Any, Optional, Sequence

from commfuse._version import __version__
from commfuse.core.jsonfile import read_json_object
from commfuse.reports.timeline import PREDICTED_TRACE
from commfuse.reports.validate import ValidationReport, validate_dirs
from commfuse.reports.volume import (Totals, VolumeReport, graph_dirs, rank_dirs, resolve_rank_dir,
                                     volume_from_dump_dir)

_KIND_COLORS = {"all_reduce": "#e6550d", "all_gather": "#3182bd", "reduce_scatter": "#31a354",
                "all_to_all": "#756bb1", "broadcast": "#8c6d31", "reduce": "#d6616b"}
_CSS = """
body{font-family:Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:32px}
h3{font-size:15px;margin-bottom:6px}
table{border-collapse:collapse;font-size:12px;margin:6px 0 14px}
th,td{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.changed td.delta{color:#0a0}tr.worse td.delta{color:#c00}
.bad{color:#c00;font-weight:bold}.ok{color:#0a0;font-weight:bold}.muted{color:#777}
figure{display:inline-block;margin:6px 12px 12px 0;vertical-align:top}
figure img{max-width:660px;max-height:900px;border:1px solid #ddd}
figcaption{font-size:12px;color:#555}
details{margin:4px 0}summary{cursor:pointer}
ul.refusals{font-size:12px;margin:2px 0 8px}
.legend span{display:inline-block;margin-right:12px;font-size:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
pre{font-size:11px;background:#f7f7f7;padding:6px;overflow:auto;max-height:300px}
"""


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _n(x: Optional[int]) -> str:
    return "?" if x is None else f"{x:,}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, cls: str = "", numeric: Sequence[int] = (),
           row_cls: Sequence[str] | None = None) -> str:
    out = [f'<table class="{_e(cls)}">' if cls else "<table>", "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in headers)
           + "</tr>"]
    for i, r in enumerate(rows):
        rc = f' class="{_e(row_cls[i])}"' if row_cls and row_cls[i] else ""
        cells = "".join(f'<td class="num">{_e(v)}</td>' if j in numeric else f"<td>{_e(v)}</td>"
                        for j, v in enumerate(r))
        out.append(f"<tr{rc}>{cells}</tr>")
    out.append("</table>")
    return "\n".join(out)


def _change(b: Optional[int], a: Optional[int]) -> str:
    if a is None or b is None:
        return "?"
    if b == 0:
        return f"{a - b:+,}"
    return f"{a - b:+,} ({100.0 * (a - b) / b:+.1f}%)"


def _compare_rows(before: Optional[dict[str, Totals]], after: Optional[dict[str, Totals]]):
    rows = []
    for k in sorted(set(before or {}) | set(after or {})):
        b = (before or {}).get(k, Totals()) if before is not None else None
        a = (after or {}).get(k, Totals()) if after is not None else None
        rows.append([k, b.count if b else "?", a.count if a else "?",
                     _n(b.logged_bytes) if b else "?", _n(a.logged_bytes) if a else "?",
                     _n(b.wire_bytes) if b else "?", _n(a.wire_bytes) if a else "?",
                     _change(b.wire_bytes, a.wire_bytes) if a and b else "?"])
    return rows


# ----------------------------------------------------------------------------- sections
def _summary(vol: VolumeReport, val: Optional[ValidationReport]) -> str:
    tb, ta = vol.total("before"), vol.total("after")
    rows = [["before (as written)", tb.count if tb else "?", _n(tb.logged_bytes if tb else None),
             _n(tb.wire_bytes if tb else None)],
            ["after (as lowered)", ta.count if ta else "?", _n(ta.logged_bytes if ta else None),
             _n(ta.wire_bytes if ta else None)]]
    parts = [_table(["program", "collectives", "logged B/rank", "wire B/rank"], rows, numeric=(1, 2, 3))]
    if tb and ta:
        parts.append(f"<p>Wire bytes per rank: <b>{_e(_change(tb.wire_bytes, ta.wire_bytes))}</b>.</p>")
    checked = [c for c in vol.collectives() if c.formula is not None]
    bad = vol.formula_mismatches()
    cls = "bad" if bad else "ok"
    parts.append(f'<p>Analytic formulas: {len(checked)} collectives checked, '
                 f'<span class="{cls}">{len(bad)} differ</span>.</p>')
    if val is not None:
        s = val.summary()
        cls = "ok" if val.ok else "bad"
        parts.append(f'<p>Measured vs predicted: {s["ranks"]} rank(s), {s["recorded_calls"]} recorded calls, '
                     f'<span class="{cls}">{s["mismatches"]} mismatch(es)</span> in count and bytes.</p>')
    parts.extend(f'<p class="muted">{_e(n)}</p>' for n in vol.notes)
    return "\n".join(parts)


def _volume(vol: VolumeReport) -> str:
    parts = []
    headers = ["", "count before", "count after", "logged before", "logged after", "wire before", "wire after",
               "wire change"]
    for by, title in (("kind", "per kind"), ("role", "per parallel role"), ("group", "per process group"),
                      ("direction", "per direction")):
        parts.append(f"<h3>{_e(title)} (bytes per rank)</h3>")
        hs = [by] + headers[1:]
        parts.append(_table(hs, _compare_rows(vol.totals("before", by), vol.totals("after", by)),
                            cls=f"volume-{by}", numeric=range(1, 8)))
    return "\n".join(parts)


def _collectives(vol: VolumeReport) -> str:
    rows, rcls = [], []
    for c in vol.collectives():
        f = c.formula
        rows.append([c.graph, c.side, c.direction, c.embedded or c.node, c.kind, c.group, c.group_size, c.role,
                     c.dtype or "", _n(c.logged_bytes), _n(c.wire_bytes) + (" (est.)" if c.estimated else ""),
                     f"{f.name}: {f.expression}, {f.values}" if f else "-",
                     "-" if f is None else f"{_n(f.wire_bytes)} ({'=' if f.wire_diff == 0 else _n(f.wire_diff)})"])
        rcls.append("collective")
    return _table(["graph", "side", "direction", "node", "kind", "group", "N", "role", "dtype", "logged B",
                   "wire B", "analytic formula", "formula wire B (diff)"], rows, cls="collectives",
                  numeric=(6, 9, 10), row_cls=rcls)


def _passes(vol: VolumeReport) -> str:
    parts = []
    by_graph: dict[str, list] = {}
    for p in vol.reasons():
        by_graph.setdefault(p.graph, []).append(p)
    for g in vol.graphs:
        ps = by_graph.get(g.name, [])
        if not ps and not g.notes:
            continue
        parts.append(f"<h3>{_e(g.name)}</h3>")
        rows = []
        for p in ps:
            counts = ", ".join(f"{k}={v}" for k, v in sorted(p.counts.items()) if v)
            state = "error (graph restored)" if p.error else ("changed" if p.changed else "unchanged")
            rows.append([p.name, p.stage, state, counts, len(p.refusals), p.error or ""])
        parts.append(_table(["pass", "stage", "result", "counts", "refusals", "error"], rows, cls="passes",
                            numeric=(4,)))
        for p in ps:
            if p.refusals:
                items = "".join(f"<li>{_e(r)}</li>" for r in p.refusals)
                parts.append(f"<details><summary>{_e(p.name)}: {len(p.refusals)} refusal(s) "
                             f"(why not fused / moved / partitioned)</summary><ul class=\"refusals\">{items}</ul>"
                             "</details>")
            if p.decisions:
                parts.append(f"<details><summary>{_e(p.name)}: {len(p.decisions)} decision(s)</summary>"
                             f"<pre>{_e(json.dumps(p.decisions, indent=1, default=str))}</pre></details>")
        for n in g.notes:
            parts.append(f'<p class="muted">note: {_e(n)}</p>')
    return "\n".join(parts) or "<p>No pass reports in the dumps.</p>"


def _picture(path: Path, caption: str) -> str:
    if path.suffix == ".svg":
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        return (f'<figure><img alt="{_e(caption)}" src="data:image/svg+xml;base64,{data}">'
                f"<figcaption>{_e(caption)}</figcaption></figure>")
    return (f"<figure><figcaption>{_e(caption)} (Graphviz not installed: DOT source)</figcaption>"
            f"<pre>{_e(path.read_text())}</pre></figure>")


def _graphs(dirs: Sequence[Path]) -> str:
    parts = []
    for d in dirs:
        pics = sorted([*d.glob("[0-9][0-9]_*.svg"), *d.glob("[0-9][0-9]_*.dot")])
        if not pics:
            continue
        first, last = pics[0], pics[-1]
        parts.append(f"<h3>{_e(d.name)}</h3>")
        stages = ", ".join(p.stem for p in pics)
        parts.append(f'<p class="muted">dumped stages: {_e(stages)}. Collectives are filled boxes coloured by '
                     "process group, their waits dashed boxes.</p>")
        parts.append(_picture(first, f"{d.name} before: {first.stem}"))
        if last != first:
            parts.append(_picture(last, f"{d.name} after: {last.stem}"))
    return "\n".join(parts) or "<p>No graph pictures in the dumps.</p>"


def _trace_events(trace: dict[str, Any]) -> tuple[dict[tuple[Any, Any], str], list[dict[str, Any]]]:
    names: dict[tuple[Any, Any], str] = {}
    events = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "M" and ev.get("name") == "thread_name":
            names[(ev.get("pid"), ev.get("tid"))] = str(ev.get("args", {}).get("name", ev.get("tid")))
        elif ev.get("ph") == "X" and isinstance(ev.get("ts"), (int, float)) and isinstance(ev.get("dur"), (int, float)):
            events.append(ev)
    return names, events


def _event_color(ev: dict[str, Any]) -> str:
    cat = str(ev.get("cat", ""))
    if cat.startswith("comm"):
        kind = cat.split(",", 1)[1] if "," in cat else ""
        return _KIND_COLORS.get(kind, "#636363")
    if "exposed" in cat or cat == "wait" or str(ev.get("name", "")).startswith("wait"):
        return "#de2d26"
    return "#9e9e9e"


def _compressor(events: Sequence[dict[str, Any]]):
    """Map trace time to plot time with idle gaps cut short: a stretch where no event runs and
    that is longer than 2% of the busy time is drawn as 1% of it (a recording spans compiles and
    the Python between steps). Returns (map, plotted span, [(plotted x, real gap us)])."""
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
        import bisect

        i = max(0, bisect.bisect_right(starts, t) - 1)
        return offsets[i] + min(t - merged[i][0], merged[i][1] - merged[i][0])

    span = offsets[-1] + merged[-1][1] - merged[-1][0]
    return to_plot, max(span, 1e-9), gaps, busy


def timeline_svg(trace: dict[str, Any], *, title: str, width: int = 1200) -> str:
    """A Chrome trace (simulator or recorder) as an inline SVG: one lane per track, one bar per
    event, idle gaps cut short (marked with a dashed line and their length)."""
    names, events = _trace_events(trace)
    if not events:
        return f'<p class="muted">{_e(title)}: no events.</p>'
    lanes = sorted({(ev.get("pid"), ev.get("tid")) for ev in events}, key=lambda k: (str(k[0]), str(k[1])))
    lane_of = {k: i for i, k in enumerate(lanes)}
    several_pids = len({p for p, _ in lanes}) > 1
    to_plot, span, gaps, busy = _compressor(events)
    label_w, lane_h, top = 170, 18, 22
    plot_w = width - label_w - 10
    height = top + lane_h * len(lanes) + 24
    out = [f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'role="img" aria-label="{_e(title)}">',
           f'<text x="0" y="14" font-size="12" font-weight="bold">{_e(title)}</text>']
    for (pid, tid), i in lane_of.items():
        y = top + i * lane_h
        name = names.get((pid, tid), f"track {tid}")
        label = f"{name} [{pid}]" if several_pids else name
        out.append(f'<text x="0" y="{y + 12}" font-size="11">{_e(label[:28])}</text>')
        out.append(f'<rect x="{label_w}" y="{y}" width="{plot_w}" height="{lane_h - 2}" fill="#fafafa"/>')
    t0 = min(ev["ts"] for ev in events)
    for ev in events:
        i = lane_of[(ev.get("pid"), ev.get("tid"))]
        a, b = to_plot(ev["ts"]), to_plot(ev["ts"] + ev["dur"])
        x = label_w + a / span * plot_w
        w = max((b - a) / span * plot_w, 0.5)
        tip = f"{ev.get('name', '')} ({ev.get('cat', '')}): {ev['dur']:,.1f} us at {ev['ts'] - t0:,.1f} us"
        out.append(f'<rect x="{x:.2f}" y="{top + i * lane_h + 1}" width="{w:.2f}" height="{lane_h - 4}" '
                   f'fill="{_event_color(ev)}"><title>{_e(tip)}</title></rect>')
    bottom = top + lane_h * len(lanes)
    for gx, gap in gaps:
        x = label_w + gx / span * plot_w
        out.append(f'<line x1="{x:.2f}" y1="{top}" x2="{x:.2f}" y2="{bottom}" stroke="#555" stroke-dasharray="2,2">'
                   f'<title>{_e(f"idle {gap:,.0f} us, not to scale")}</title></line>')
    y = bottom + 14
    cut = f"; {len(gaps)} idle gap(s) cut (dashed)" if gaps else ""
    out.append(f'<text x="{label_w}" y="{y}" font-size="11">busy {busy:,.0f} us{_e(cut)}</text>')
    out.append(f'<text x="{width - 10}" y="{y}" font-size="11" text-anchor="end">'
               f'{max(ev["ts"] + ev["dur"] for ev in events) - t0:,.0f} us from first to last event</text>')
    out.append("</svg>")
    return "\n".join(out)


def _legend() -> str:
    items = [("compute", "#9e9e9e"), ("blocked in a wait", "#de2d26")] + list(_KIND_COLORS.items())
    return '<p class="legend">' + "".join(f'<span><i style="background:{c}"></i>{_e(n)}</span>'
                                          for n, c in items) + "</p>"


def _timelines(dirs: Sequence[Path], record_dir: Optional[Path]) -> str:
    parts = [_legend(), "<h3>Predicted (simulator)</h3>"]
    found = False
    for d in dirs:
        p = d / PREDICTED_TRACE
        if p.exists():
            trace = read_json_object(p, "predicted trace", "traceEvents")
            model = trace.get("otherData", {}).get("cost_model", "")
            parts.append(timeline_svg(trace, title=f"{d.name} predicted ({model})"))
            found = True
    if not found:
        parts.append('<p class="muted">No predicted_trace.json in the dumps (compile inside '
                     "commfuse.reports.predict_timelines(), or call write_predicted_trace(gm, dump_dir)).</p>")
    parts.append("<h3>Measured (runtime recorder)</h3>")
    traces = sorted(record_dir.glob("rank*.json")) if record_dir is not None else []
    if not traces:
        parts.append('<p class="muted">No recorder traces given (commfuse report DUMP_DIR --record RECORD_DIR; '
                     "record with commfuse.record(dir) or COMMFUSE_RECORD_DIR).</p>")
    for p in traces:
        trace = read_json_object(p, "recorder trace", "traceEvents")
        parts.append(timeline_svg(trace, title=f"{p.stem} measured"))
    return "\n".join(parts)


def _validation(val: ValidationReport) -> str:
    s = val.summary()
    parts = [f"<p>Cost model for times: {_e(val.cost_model)}. Measured time: issue to Work completion, median "
             f"over runs after the first. Total measured {s['measured_us']:,.0f} us, predicted "
             f"{s['predicted_us']:,.0f} us.</p>"]
    if val.mismatches:
        parts.append('<p class="bad">Mismatches:</p><ul>' + "".join(f"<li>{_e(m.describe())}</li>"
                                                                   for m in val.mismatches) + "</ul>")
    else:
        parts.append('<p class="ok">No mismatch: every planned collective was recorded once per run, in order, '
                     "with exactly the predicted bytes.</p>")
    rows = []
    for c in val.checks:
        err = c.time_error
        rows.append([c.rank, c.graph, c.index, c.name, c.kind, c.runs, _n(c.predicted_sent), _n(c.measured_sent),
                     _n(c.predicted_received), _n(c.measured_received), _n(c.predicted_logged),
                     _n(c.measured_logged), "?" if c.measured_us is None else f"{c.measured_us:,.0f}",
                     "?" if c.predicted_us is None else f"{c.predicted_us:,.0f}",
                     "?" if err is None else f"{100 * err:+.0f}%"])
    parts.append(_table(["rank", "graph", "#", "node", "kind", "runs", "sent pred", "sent meas", "recv pred",
                         "recv meas", "logged pred", "logged meas", "meas us", "pred us", "time error"], rows,
                        cls="validation", numeric=(0, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13)))
    parts.extend(f'<p class="muted">note: {_e(n)}</p>' for n in val.notes)
    return "\n".join(parts)


# ----------------------------------------------------------------------------- page
def render_html(dump_dir: str | Path, *, rank: Optional[int] = None, record_dir: str | Path | None = None,
                profile: Any = None, title: Optional[str] = None) -> str:
    """The report page for one rank's dumps (``rank``: which ``rank<r>/`` when the dir has several)."""

    d = resolve_rank_dir(dump_dir, rank)
    ranks = sorted(rank_dirs(dump_dir))
    shown = "" if len(ranks) < 2 else (f"; ranks dumped: {', '.join(map(str, ranks))}, this page shows rank "
                                        f"{0 if rank is None else rank} (--rank R for another)")
    vol = volume_from_dump_dir(d)
    dirs = graph_dirs(d)
    rec = Path(record_dir) if record_dir is not None else None
    val = validate_dirs(rec, dump_dir, profile=profile) if rec is not None else None
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    heading = title or f"commfuse report: {d}"
    sections = [("summary", "Summary", _summary(vol, val)),
                ("volume", "Communication volume", _volume(vol)),
                ("collectives", "Collectives", _collectives(vol)),
                ("passes", "Pass decisions", _passes(vol)),
                ("graphs", "Graphs", _graphs(dirs)),
                ("timelines", "Timelines", _timelines(dirs, rec))]
    if val is not None:
        sections.append(("validation", "Measured vs predicted", _validation(val)))
    nav = " | ".join(f'<a href="#{i}">{_e(t)}</a>' for i, t, _ in sections)
    body = "\n".join(f'<section><h2 id="{i}">{_e(t)}</h2>\n{content}\n</section>' for i, t, content in sections)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(heading)}</title><style>{_CSS}</style></head><body>\n"
            f"<h1>{_e(heading)}</h1>\n<p class=\"muted\">commfuse {_e(__version__)}, generated {_e(now)}; "
            f"source {_e(vol.source)}{_e(shown)}{'; recorder ' + _e(rec) if rec else ''}. Bytes are per rank: logged = "
            "NCCL count semantics, wire = ring conventions.</p>\n"
            f"<nav>{nav}</nav>\n{body}\n</body></html>\n")


def write_html(dump_dir: str | Path, out: str | Path | None = None, **kw: Any) -> Path:
    """Write the page (default ``<dump_dir>/report.html``) and return its path."""
    path = Path(out) if out is not None else Path(dump_dir) / "report.html"
    text = render_html(dump_dir, **kw)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
