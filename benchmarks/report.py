"""Results of a run: environment, JSON document, text/Markdown tables and PNG charts.

The JSON document (``SCHEMA``) holds every raw number (per-rank step times,
first-step times, peak allocations, per-graph collectives, commfuse pass
records), the computed metrics per workload x baseline, the scaling points,
and where/with what it was measured (machine, versions, date, settings).
Tables and charts are derived from it only, so a stored JSON can be
re-rendered (``python benchmarks/run.py --from-json out.json --plot DIR``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.metrics import METRICS
from benchmarks.scaling import growth_exponent

__all__ = ["SCHEMA", "environment", "markdown_tables", "scaling_summary", "text_tables", "write_plots"]

SCHEMA = "commfuse-bench/1"
# Project goal, reported, never asserted.
GOAL_PIPELINE_S = 5.0
GOAL_FRACTION_OF_INDUCTOR = 0.10


# -------------------------------------------------------------- environment


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _physical_cores() -> int | None:
    try:
        pairs = set()
        phys = core = None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("physical id"):
                phys = line.split(":", 1)[1].strip()
            elif line.startswith("core id"):
                core = line.split(":", 1)[1].strip()
                pairs.add((phys, core))
        return len(pairs) or None
    except OSError:
        return None


def _mem_total_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _git(*args: str) -> str | None:
    """Read-only git queries (commit, dirty state) for provenance."""
    try:
        out = subprocess.run(
            ["git", *args],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment() -> dict[str, Any]:
    import torch

    import commfuse

    try:
        import matplotlib

        mpl = matplotlib.__version__
    except ImportError:
        mpl = None
    status = _git("status", "--porcelain")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu_model": _cpu_model(),
            "logical_cores": os.cpu_count(),
            "physical_cores": _physical_cores(),
            "memory_bytes": _mem_total_bytes(),
            "platform": platform.platform(),
        },
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "commfuse": commfuse.__version__,
            "matplotlib": mpl,
            "git_commit": _git("rev-parse", "--short", "HEAD"),
            "git_dirty": None if status is None else bool(status),
        },
    }


# ------------------------------------------------------------------- tables


def stand_alone_report(args: Any, key: str, measure: Any, render: Any) -> int:
    """The tail of a stand-alone report script (``--json``, ``--markdown``, ``--from-json``):
    measure (or read the stored report under ``key``), print ``render(report)``, write the JSON
    with this machine's environment and the markdown tables."""
    report = json.loads(args.from_json.read_text())[key] if args.from_json else measure()
    text = render(report)
    print(text)
    if args.json and not args.from_json:
        doc = {"schema": SCHEMA, "environment": environment(), key: report}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


def _rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    metrics = [m for m in METRICS.values() if m.in_table]
    header = ["workload", "baseline", "inner"] + [m.header for m in metrics] + ["load"]
    rows = []
    for r in doc["results"]:
        inner = doc["baselines"][r["baseline"]]["inner"]
        if r["error"] is not None:
            cells = [f"FAILED: {r['error'].strip().splitlines()[-1][:60]}"] + [""] * (len(metrics) - 1)
        else:
            cells = [m.fmt(r["metrics"][m.name]) for m in metrics]
        load = r.get("load_avg_1m")
        rows.append([r["workload"], r["baseline"], inner] + cells + ["-" if load is None else f"{load:.1f}"])
    return header, rows


def _fixed(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out)


def _scaling_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    points = doc.get("scaling", {}).get("points", [])
    pass_names = sorted({p for pt in points for p in pt["passes_s"]})
    header = (
        ["mode", "layers", "nodes (joint/fw/bw)", "capture s", "IR build s", "pipeline s"]
        + [f"pass {p} s" for p in pass_names]
        + ["rest s", "compile s", "load"]
    )

    def f(v: float | None, digits: int = 2) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    rows = []
    for p in points:
        if p["error"]:
            rows.append(
                [p["mode"], str(p["layers"]), f"FAILED: {p['error'].strip().splitlines()[-1][:60]}"]
                + [""] * (len(header) - 3)
            )
            continue
        nodes = (
            "/".join(str(p["graph_nodes"].get(k, "-")) for k in ("joint", "forward", "backward"))
            if p["graph_nodes"]
            else "-"
        )
        rows.append(
            [
                p["mode"],
                str(p["layers"]),
                nodes,
                f(p["capture_s"], 1),
                f(p["ir_build_s"], 3),
                f(p["pipeline_s"]),
            ]
            + [f(p["passes_s"].get(n), 3) for n in pass_names]
            + [f(p["rest_s"], 1), f(p["compile_s"], 1), f(p.get("load_avg_1m"), 1)]
        )
    return header, rows


def scaling_summary(doc: dict[str, Any]) -> list[str]:
    """The project goal, reported honestly: pipeline seconds at the deepest point,
    its fraction of Inductor's compile time, and the growth exponent."""
    points = [p for p in doc.get("scaling", {}).get("points", []) if not p["error"]]
    if not points:
        return ["compile-time scaling: no successful points"]
    lines = []
    by_mode: dict[str, dict[int, dict[str, Any]]] = {}
    for p in points:
        by_mode.setdefault(p["mode"], {})[p["layers"]] = p
    inductor = by_mode.get("inductor", {})
    for mode in ("commfuse", "commfuse-eager"):
        pts = by_mode.get(mode)
        if not pts:
            continue
        layers = sorted(pts)
        deepest = layers[-1]
        t = pts[deepest]["pipeline_s"]
        exp = growth_exponent(layers, [pts[n]["pipeline_s"] for n in layers])
        ok_abs = "meets" if t <= GOAL_PIPELINE_S else "MISSES"
        line = (
            f"{mode}: whole pipeline on the {deepest}-layer fwd+bwd graphs = {t:.2f} s "
            f"({ok_abs} the <= {GOAL_PIPELINE_S:g} s goal)"
        )
        if deepest in inductor:
            ind = inductor[deepest]["compile_s"]
            frac = t / ind
            ok_frac = "meets" if frac <= GOAL_FRACTION_OF_INDUCTOR else "MISSES"
            line += (
                f"; Inductor's own compile of the same model = {ind:.1f} s, pipeline = {100 * frac:.1f}% of it "
                f"({ok_frac} the <= {100 * GOAL_FRACTION_OF_INDUCTOR:g}% goal)"
            )
        else:
            line += "; Inductor compile time not measured in this suite (see --suite full)"
        if exp is not None:
            verdict = "no faster than linear" if exp <= 1.1 else "FASTER than linear"
            line += f"; growth exponent over {layers} layers = {exp:.2f} ({verdict}; 1.0 = linear)"
        lines.append(line)
    return lines


def _load_line(doc: dict[str, Any]) -> list[str]:
    loads = [r.get("load_avg_1m") for r in doc["results"] + doc.get("scaling", {}).get("points", [])]
    loads = [x for x in loads if isinstance(x, (int, float))]
    if not loads:
        return []
    cores = doc["environment"]["machine"]["logical_cores"]
    return [
        f"machine load during the runs (1-min load average): {min(loads):.1f} to {max(loads):.1f} "
        f"on {cores} logical cores"
        + (" -- shared machine, timings inflated" if max(loads) > (cores or 0) else "")
    ]


def _header_lines(doc: dict[str, Any]) -> list[str]:
    env, s = doc["environment"], doc["settings"]
    m, v = env["machine"], env["versions"]
    return [
        f"commfuse benchmarks, suite '{doc['suite']}', {env['date']}",
        f"machine: {m['cpu_model']}, {m['physical_cores']} physical / {m['logical_cores']} logical cores; "
        f"python {v['python']}, torch {v['torch']}, commfuse {v['commfuse']} (git {v['git_commit']}"
        f"{', dirty' if v['git_dirty'] else ''})",
        f"measured here: CPU, {s['backend']}, world size {s['world_size']}, {s['threads_per_rank']} intra-op thread "
        f"per rank, {s['warmup']} warm-up + {s['steps']} timed steps (forward+backward, no optimizer); "
        f"simulated: the executed graphs as captured here (their shapes and groups) priced on DGX-H100 x2 by the "
        f"analytic NCCL cost model (benchmarks/simulated.py)",
    ] + _load_line(doc)


def text_tables(doc: dict[str, Any]) -> str:
    parts = _header_lines(doc) + ["", _fixed(*_rows(doc)), ""]
    parts += [f"  {m.header}: {m.description}" for m in METRICS.values() if m.in_table]
    if doc.get("scaling", {}).get("points"):
        sc = doc["scaling"]
        parts += [
            "",
            f"compile-time scaling: Llama TP+SP, fake process group, world size {sc['world_size']}, "
            "cold compiles (fresh process and Inductor cache per point)",
            _fixed(*_scaling_rows(doc)),
        ]
        parts += [""] + scaling_summary(doc)
    parts += [""] + [f"note: {n}" for n in doc.get("notes", [])]
    return "\n".join(parts)


def markdown_tables(doc: dict[str, Any]) -> str:
    parts = ["\n\n".join(_header_lines(doc)), "", _markdown(*_rows(doc)), ""]
    parts += [f"- **{m.header}**: {m.description}" for m in METRICS.values() if m.in_table]
    if doc.get("scaling", {}).get("points"):
        sc = doc["scaling"]
        parts += [
            "",
            f"Compile-time scaling (Llama TP+SP, fake process group, world size {sc['world_size']}, "
            "cold compiles: fresh process and Inductor cache per point):",
            "",
            _markdown(*_scaling_rows(doc)),
            "",
        ]
        parts += [f"- {line}" for line in scaling_summary(doc)]
    parts += [""] + [f"- Note: {n}" for n in doc.get("notes", [])]
    return "\n".join(parts)


# ------------------------------------------------------------------- charts


def _metric(results: list[dict[str, Any]], workload: str, baseline: str, key: str) -> Any:
    r = next((r for r in results if r["workload"] == workload and r["baseline"] == baseline), None)
    v = None if r is None else r["metrics"].get(key)
    return v if isinstance(v, (int, float)) else None


def write_plots(doc: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """comparison.png (step time, compile time, wire bytes per workload x baseline)
    and scaling.png (compile-time stages vs layers); returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    results = [r for r in doc["results"] if r["error"] is None]
    workloads = list(dict.fromkeys(r["workload"] for r in doc["results"]))
    baselines = list(dict.fromkeys(r["baseline"] for r in doc["results"]))
    if results:
        panels = [
            ("step_ms_median", "step time, median (ms)", "step_ms_iqr", 1.0),
            ("compile_s", "compile time (s)", None, 1.0),
            ("wire_bytes", "wire bytes / rank (KiB)", None, 1 / 1024),
        ]
        # ~0.25 inch per bar, within a width that still renders legibly.
        width_in = min(18.0, max(8.0, 0.25 * len(workloads) * max(1, len(baselines))))
        fig, axes = plt.subplots(len(panels), 1, figsize=(width_in, 11))
        width = 0.8 / max(1, len(baselines))
        for ax, (key, title, err_key, scale) in zip(axes, panels, strict=True):
            for j, b in enumerate(baselines):
                xs, ys, errs = [], [], []
                for i, w in enumerate(workloads):
                    r = next((r for r in results if r["workload"] == w and r["baseline"] == b), None)
                    v = None if r is None else r["metrics"].get(key)
                    if isinstance(v, (int, float)):
                        xs.append(i + (j - (len(baselines) - 1) / 2) * width)
                        ys.append(v * scale)
                        e = r["metrics"].get(err_key) if err_key else None  # type: ignore[index]
                        errs.append(e / 2 if isinstance(e, (int, float)) else 0.0)
                ax.bar(xs, ys, width, yerr=errs if err_key else None, label=b, capsize=2)
                if key in ("wire_bytes", "logged_bytes"):
                    # Bytes of ops the IR does not recognise are missing: say so on the bar.
                    for x, y, w in zip(
                        xs, ys, [w for w in workloads if _metric(results, w, b, key) is not None], strict=True
                    ):
                        if (_metric(results, w, b, "unrecognised_collectives") or 0) > 0:
                            ax.annotate("*", (x, y), ha="center", va="bottom", fontsize=12, color="red")
            ax.set_title(title)
            ax.set_xticks(range(len(workloads)))
            ax.set_xticklabels(workloads, rotation=15, fontsize=8)
        axes[0].legend(fontsize=7, ncol=min(len(baselines), 7), loc="upper left")
        if any((r["metrics"].get("unrecognised_collectives") or 0) > 0 for r in results):
            axes[-1].set_title(
                axes[-1].get_title() + "  (* = some collectives not recognised by the IR: bytes undercounted)"
            )
        s = doc["settings"]
        fig.suptitle(
            f"commfuse benchmarks ({doc['suite']}): measured on CPU, {s['backend']}, "
            f"{s['world_size']} ranks; error bars = IQR",
            fontsize=10,
        )
        fig.tight_layout()
        path = out / "comparison.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    points = [p for p in doc.get("scaling", {}).get("points", []) if not p["error"]]
    if points:
        fig, ax = plt.subplots(figsize=(8, 5.5))
        series: dict[str, list[tuple[int, float]]] = {}
        for p in points:
            if p["mode"] == "inductor":
                series.setdefault("Inductor compile (torch.compile default)", []).append(
                    (p["layers"], p["compile_s"])
                )
                continue
            series.setdefault(f"{p['mode']}: whole pipeline", []).append((p["layers"], p["pipeline_s"]))
            if p["mode"] == "commfuse-eager":
                series.setdefault("capture (Dynamo+AOT to joint)", []).append((p["layers"], p["capture_s"]))
                series.setdefault("IR build (joint+fw+bw)", []).append((p["layers"], p["ir_build_s"]))
                for name, secs in p["passes_s"].items():
                    series.setdefault(f"pass {name}", []).append((p["layers"], secs))
            if p["mode"] == "commfuse":
                series.setdefault("commfuse: Inductor lowering (rest)", []).append((p["layers"], p["rest_s"]))
        for label, pts in series.items():
            pts = sorted((x, y) for x, y in pts if y is not None and y > 0)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
        ref = sorted(series.get("commfuse-eager: whole pipeline", []))
        if len(ref) >= 2 and ref[0][1]:
            x0, y0 = ref[0]
            xs = [x for x, _ in ref]
            ax.plot(
                xs,
                [y0 * x / x0 for x in xs],
                color="grey",
                linestyle="--",
                linewidth=0.8,
                label="linear growth from the first pipeline point",
            )
        ax.axhline(
            GOAL_PIPELINE_S, color="grey", linestyle=":", label=f"goal: pipeline <= {GOAL_PIPELINE_S:g} s"
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("Llama layers (TP+SP, fake PG)")
        ax.set_ylabel("seconds (cold)")
        ax.set_title(f"compile-time scaling, world size {doc['scaling']['world_size']}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / "scaling.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
