"""Benchmark runner CLI: every workload x baseline of a suite, side by side, in one run.

    python benchmarks/run.py --suite quick|full|smoke --json out.json [--plot DIR] [--markdown FILE]
    python benchmarks/run.py --from-json out.json --plot DIR      # re-render a stored run
    python benchmarks/run.py --partition-report [--json out.json] # Centauri search on DGX-H100 x2 (predicted)
    python benchmarks/run.py --schedule-report [--json out.json]  # overlap scheduler on DGX-H100 x2 (predicted)
    python benchmarks/run.py --overlap-vs-inductor [--json out.json]  # vs Inductor's overlap scheduler (predicted)
    python benchmarks/run.py --volume-report [--json out.json]    # bytes before/after commfuse per example (counted)
    python benchmarks/run.py --boundary-volume [--json out.json]  # pipeline boundary fusion: bytes + step time
    python benchmarks/run.py --ab commfuse,inductor [--workloads W] [--pairs 20] [--json out.json]  # A/B in one run
    python benchmarks/run.py --gpu [--json out.json]                # one CUDA GPU (docs/benchmarks.md, "GPU mode")

Runs each workload x baseline on a pool of gloo ranks (one intra-op thread
each), then the compile-time scaling points in fresh processes, prints the
table and writes the JSON (after every run, so an interrupted run keeps
what it measured). ``--ab`` instead interleaves the steps of the listed
baselines in one job per workload and reports the first one's speed-up over
each other one with a bootstrap interval (benchmarks/ab.py). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

# Runnable as a script from a checkout: make `benchmarks` and `commfuse` importable
# (the rank pool copies sys.path into its workers).
_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
# Kineto prints a line per profiler start/stop; level 6 silences it. Set before
# the rank processes start so they inherit it.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
# Before anything imports commfuse: the GPU machine's image lacks pydantic; the carried wheels supply it.
from benchmarks.gpu.wheels import ensure_wheels  # noqa: E402

_WHEELS = ensure_wheels()

from benchmarks.ab import MIN_PAIRS, ab_job, ab_tables, compile_order, summarize  # noqa: E402
from benchmarks.ab import settings as ab_settings  # noqa: E402
from benchmarks.baselines import get_baseline  # noqa: E402
from benchmarks.metrics import METRICS, RunRecord, compute_metrics  # noqa: E402
from benchmarks.report import SCHEMA, environment, markdown_tables, text_tables, write_plots  # noqa: E402
from benchmarks.suites import SUITES, Suite, get_suite  # noqa: E402
from benchmarks.workloads import get_workload  # noqa: E402

NOTES = [
    "step times are wall-clock on gloo over loopback on a shared CPU: they show compute and the gloo cost of "
    "each collective, not GPU-interconnect overlap. gloo implements reduce_scatter as a full all_reduce, so "
    "wall-clock on gloo does not show reduce_scatter savings; bytes are therefore counted with NCCL semantics "
    "(logged) and ring conventions (wire) by commfuse.analyze, not measured on the wire.",
    "peak alloc = peak bytes held by torch's CPU allocator during one step above the level at its start "
    "(torch.profiler memory events); memory not allocated through torch's allocator (gloo buffers, Python "
    "objects) is not included.",
    "compile s = first step minus the median step; Inductor-based runs start from a fresh, empty Inductor cache "
    "(cold compile, TORCHINDUCTOR_COMPILE_THREADS=1 per rank); one-time imports are paid by a warm-up job first.",
    "collectives of non-commfuse baselines come from commfuse.analyze on the graphs they executed (Inductor: "
    "after its post-grad passes, bucketing included; eager: AOT-captured forward/backward graphs); for "
    "commfuse baselines from the pipeline's reports. 'unrecog.' counts c10d ops the IR does not know: their "
    "bytes are missing from the totals.",
    "load = the machine's 1-minute load average after each run; above the number of cores, other processes "
    "competed for the CPU and step and compile times are inflated.",
    "'-eager' baselines run the (rewritten) graphs op by op (inner_compiler='eager'); ':none' = no passes, "
    "':<pass>' = only that pass, to attribute gains.",
]


def _settings(suite: Suite) -> dict[str, Any]:
    return {
        "world_size": suite.world_size,
        "backend": "gloo",
        "threads_per_rank": 1,
        "warmup": suite.warmup,
        "steps": suite.steps,
        "step": "forward + loss + backward, gradients set to None (no optimizer)",
        "step_time": "per step the slowest rank after a barrier; median and IQR over the timed steps",
        "memory": "peak CPU-allocator bytes during one profiled step above its start level, max over ranks",
        "compile_time": "first step minus median step; cold Inductor cache per run",
        "scaling_world_size": suite.scaling_world,
        "scaling": {mode: list(layers) for mode, layers in suite.scaling},
    }


def _described(workloads: Sequence[str], baselines: Sequence[str]) -> dict[str, Any]:
    """The ``workloads`` and ``baselines`` entries of a JSON document."""
    return {
        "workloads": {
            w: {
                "family": get_workload(w).family.name,
                "size": get_workload(w).size,
                "description": get_workload(w).family.description,
                "params": get_workload(w).params,
            }
            for w in workloads
        },
        "baselines": {
            b: {"description": get_baseline(b).description, "inner": get_baseline(b).inner} for b in baselines
        },
    }


def _skeleton(suite: Suite) -> dict[str, Any]:
    matrix = suite.matrix()
    workloads = list(dict.fromkeys(w for w, _ in matrix))
    baselines = list(dict.fromkeys(b for _, b in matrix))
    return {
        "schema": SCHEMA,
        "suite": suite.name,
        "suite_description": suite.description,
        "environment": environment(),
        "settings": _settings(suite),
        "metrics": {
            m.name: {"header": m.header, "unit": m.unit, "description": m.description}
            for m in METRICS.values()
        },
        **_described(workloads, baselines),
        "results": [],
        "scaling": {"world_size": suite.scaling_world, "points": []},
        "notes": list(NOTES),
        "wall_s": None,
    }


def _write(doc: dict[str, Any], path: Path | None) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def _load() -> float | None:
    """1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_matrix(suite: Suite, doc: dict[str, Any], json_path: Path | None) -> None:
    """Every (workload, baseline) of the suite, on one pool of gloo ranks per world size."""
    # One pool per world size: a family may need other ranks than the suite's (a 2x2 mesh).
    by_world: dict[int, list[tuple[str, str]]] = {}
    for workload, baseline in suite.matrix():
        world = get_workload(workload).family.world or suite.world_size
        by_world.setdefault(world, []).append((workload, baseline))
    for world, pairs in by_world.items():
        _run_pairs(suite, world, pairs, doc, json_path)


def _run_pairs(
    suite: Suite, world: int, pairs: list[tuple[str, str]], doc: dict[str, Any], json_path: Path | None
) -> None:
    """``pairs`` (workload, baseline) on one pool of ``world`` gloo ranks."""
    from benchmarks.measure import measure
    from commfuse.tools.rank_pool import RankPoolError

    with _warm_pool(world, suite.uses_inductor, suite.job_timeout_s) as pool:
        for workload, baseline in pairs:
            record = RunRecord(workload, baseline, world)
            t = time.perf_counter()
            try:
                record.ranks = pool.run(
                    measure, workload, baseline, suite.warmup, suite.steps, timeout=suite.job_timeout_s
                )
            except RankPoolError as exc:  # a failing baseline must not stop the comparison
                record.error = str(exc)
            record.wall_s = time.perf_counter() - t
            metrics = compute_metrics(record)
            doc["results"].append(
                {
                    "workload": workload,
                    "baseline": baseline,
                    "world_size": world,
                    "error": record.error,
                    "wall_s": record.wall_s,
                    # The machine may be shared: other processes' load inflates step and compile times.
                    "load_avg_1m": _load(),
                    "metrics": metrics,
                    "raw": {"ranks": [r.to_json() for r in record.ranks]},
                }
            )
            status = (
                "FAILED"
                if record.error
                else (
                    f"step {METRICS['step_ms_median'].fmt(metrics['step_ms_median'])} ms, "
                    f"compile {METRICS['compile_s'].fmt(metrics['compile_s'])} s, "
                    f"{METRICS['collectives'].fmt(metrics['collectives'])}"
                )
            )
            _log(f"{workload:16s} {baseline:28s} {record.wall_s:6.1f} s  {status}")
            _write(doc, json_path)


@contextlib.contextmanager
def _warm_pool(world: int, with_inductor: bool, timeout_s: float) -> Iterator[Any]:
    """A pool of ``world`` gloo ranks that has paid the one-time costs (``measure.warm_up``)."""
    from benchmarks.measure import warm_up
    from commfuse.tools.rank_pool import RankPool

    with RankPool(world, timeout_s=timeout_s) as pool:
        t = time.perf_counter()
        pool.run(warm_up, with_inductor, timeout=timeout_s)
        _log(f"warm-up ({world} ranks): {time.perf_counter() - t:.1f} s")
        yield pool


def run_ab(
    workloads: dict[str, int],
    executors: Sequence[str],
    *,
    warmup: int,
    pairs: int,
    timeout_s: float,
    command: str,
    warnings: list[str],
    json_path: Path | None,
) -> dict[str, Any]:
    """A/B in one run (benchmarks/ab.py): per workload (name -> world size) one job in which
    the ``executors`` take turns; the first is the candidate, compared with each other one."""
    from commfuse.tools.rank_pool import RankPoolError

    t0 = time.perf_counter()
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "mode": "ab",
        "command": command,
        "environment": environment(),
        "settings": ab_settings(sorted(set(workloads.values())), warmup, pairs),
        "executors": list(executors),
        **_described(list(workloads), executors),
        "warnings": warnings,
        # On a shared machine other processes slow every executor alike (they take turns)
        # but widen the interval.
        "load_avg_1m_before": _load(),
        "load_avg_1m_after": None,
        "results": [],
        "wall_s": None,
    }
    with_inductor = any(get_baseline(e).uses_inductor for e in executors)
    for world in dict.fromkeys(workloads.values()):
        with _warm_pool(world, with_inductor, timeout_s) as pool:
            for workload in (w for w, n in workloads.items() if n == world):
                t = time.perf_counter()
                try:
                    ranks = pool.run(ab_job, workload, executors, warmup, pairs, timeout=timeout_s)
                    result = summarize(workload, executors, ranks)
                except RankPoolError as exc:  # a failing workload must not stop the others
                    result = {"workload": workload, "error": str(exc)}
                result.update(world_size=world, wall_s=time.perf_counter() - t, load_avg_1m=_load())
                doc["results"].append(result)
                status = (
                    "FAILED"
                    if result["error"]
                    else "  ".join(
                        f"vs {c['baseline']}: {c['median']:.3f}x [{c['ci_low']:.3f}, {c['ci_high']:.3f}]"
                        for c in result["comparisons"]
                    )
                )
                _log(f"{workload:16s} {result['wall_s']:6.1f} s  {status}")
                _write(doc, json_path)
    doc["load_avg_1m_after"] = _load()
    doc["wall_s"] = time.perf_counter() - t0
    _write(doc, json_path)
    return doc


def run_suite(suite: Suite, json_path: Path | None, *, scaling: bool = True) -> dict[str, Any]:
    from benchmarks.scaling import run_scaling

    t0 = time.perf_counter()
    doc = _skeleton(suite)
    run_matrix(suite, doc, json_path)
    if scaling and suite.scaling:
        # After the pool is gone: the scaling processes get the machine to themselves.
        points = run_scaling(suite.scaling, suite.scaling_world, timeout_s=suite.job_timeout_s, log=_log)
        doc["scaling"]["points"] = [dataclasses.asdict(p) for p in points]
    doc["wall_s"] = time.perf_counter() - t0
    _write(doc, json_path)
    return doc


class SingleReport(NamedTuple):
    """One report the runner prints instead of the suite: its module, run and table functions,
    the JSON key it is stored under, and its flag's help."""

    module: str
    run: str
    tables: str
    key: str
    help: str


# The single reports (predicted unless marked): argparse flag (--name-with-dashes) -> report.
_REPORTS = {
    "overlap_vs_inductor": SingleReport(
        "benchmarks.overlap_vs_inductor",
        "run_overlap_vs_inductor",
        "overlap_tables",
        "overlap_vs_inductor",
        "only commfuse's scheduling vs Inductor's overlap scheduler on TP+SP, SimpleFSDP and MoE "
        "blocks (DGX-H100 x2, same estimates, predicted)",
    ),
    "schedule_report": SingleReport(
        "benchmarks.schedule_report",
        "run_schedule_report",
        "schedule_tables",
        "schedule",
        "only the overlap scheduler report (SimpleFSDP Llama layer, DGX-H100 x2, predicted; and "
        "its compile time on 32 layers)",
    ),
    "partition_report": SingleReport(
        "benchmarks.partition_report",
        "run_partition_report",
        "partition_tables",
        "partition",
        "only the Centauri partition search report (SimpleFSDP Llama layer, DGX-H100 x2, predicted)",
    ),
    "lagom_report": SingleReport(
        "benchmarks.lagom_report",
        "run_lagom_report",
        "lagom_tables",
        "lagom",
        "only Lagom's per-collective communicator settings on the TP+SP, SimpleFSDP and MoE "
        "blocks (DGX-H100 x2, predicted: makespan default NCCL vs Lagom, evaluations, "
        "communicator memory)",
    ),
    # measured, not predicted: gloo ranks on this machine
    "lowering_overlap": SingleReport(
        "benchmarks.lowering_overlap",
        "run_lowering_overlap",
        "lowering_overlap_tables",
        "lowering_overlap",
        "only the lowering report: measured step time (median, IQR) and measured overlap of "
        "commfuse's runtime vs Inductor default / with comm passes, 2 gloo ranks",
    ),
    "gloo_reduce_scatter": SingleReport(
        "benchmarks.gloo_reduce_scatter",
        "run_gloo_reduce_scatter",
        "gloo_reduce_scatter_tables",
        "gloo_reduce_scatter",
        "only gloo reduce_scatter vs all_to_all + local sum on 2 and 4 gloo ranks (measured, with "
        "the gloo_reduce_scatter pass's predicted decision per size)",
    ),
    # counted, not timed: the IR's byte counts of the compiled example programs (fake process group)
    "volume_report": SingleReport(
        "benchmarks.volume_report",
        "run_volume_report",
        "volume_tables",
        "volume",
        "only the volume report of every example workload: bytes per rank before/after commfuse "
        "by kind, role and direction, Table 1 formula checks, pass reasons (fake process group)",
    ),
    # synthesised from recorded sequences, not timed: NCCL log / kernel trace alignment F1
    "alignment_f1": SingleReport(
        "benchmarks.alignment_f1",
        "run_alignment_f1",
        "alignment_f1_tables",
        "alignment_f1",
        "only the NCCL log / kernel trace alignment F1 per scenario and example model, next to "
        "the NCCL-trace thesis's numbers (synthesised from recorded sequences)",
    ),
    # counted (bytes, one process) and measured (step time, 4 gloo ranks): pipeline boundary fusion
    "boundary_volume": SingleReport(
        "benchmarks.boundary_volume",
        "run_boundary_volume",
        "boundary_volume_tables",
        "boundary_volume",
        "only pipeline boundary fusion: bytes per rank before/after per Table 2 transition vs the "
        "derivation (counted) and step time fused vs unfused on 4 gloo ranks (measured)",
    ),
    # counted (bytes, one process, fake process group): Chimera's fusion across the two dims of a mesh
    "mesh_transitions": SingleReport(
        "benchmarks.mesh_transitions",
        "run_mesh_transitions",
        "mesh_transitions_tables",
        "mesh_transitions",
        "only the TP->EP transition on 2-D meshes [2,2], [4,2], [2,4]: bytes per rank before/after "
        "fuse_collectives across groups vs the closed form and Table 2's range (counted)",
    ),
    # predicted (fake process group, one process): torchtitan's dropless exchange cut along the hidden dim
    "hidden_exchange": SingleReport(
        "benchmarks.hidden_exchange",
        "run_hidden_exchange",
        "hidden_exchange_tables",
        "hidden_exchange",
        "only hidden_exchange_partition on a torchtitan-style dropless MoE block (8 EP ranks, one and "
        "two DGX-H100 nodes): per exchange the decision, the graph's makespan and exposed "
        "communication whole / with the pass / forced to two blocks (predicted)",
    ),
    # decided (compiled on 2 gloo ranks): the passes' decisions with and without a calibrated profile
    "calibrated_decisions": SingleReport(
        "benchmarks.calibrated_decisions",
        "run_calibrated_decisions",
        "calibrated_decisions_tables",
        "calibrated_decisions",
        "only the decisions of the default pipeline with the nominal cost model vs the committed "
        "calibrated profile of this machine, per workload, and whether every rank agrees (2 gloo ranks)",
    ),
    # predicted (assumed overlap factors) for a TP=8 Llama layer, and measured on 4 gloo ranks: DHelix
    "dhelix_report": SingleReport(
        "benchmarks.dhelix_report",
        "run_dhelix_report",
        "dhelix_tables",
        "dhelix",
        "only DHelix strand interleaving: a TP=8 Llama layer, sequential vs Eq. 2 plan time on "
        "DGX-A100 and A40-PCIe (predicted, illustrative OEF) next to the paper's gains; the "
        "training step with and without interleaving on 4 gloo ranks (measured)",
    ),
    # measured on 2 and 4 gloo ranks, counted at 1024 simulated ranks: the cross-rank agreement net
    "agreement_cost": SingleReport(
        "benchmarks.agreement_cost",
        "run_agreement_cost",
        "agreement_cost_tables",
        "agreement_cost",
        "only the agreement net's cost per compiled graph at its first execution: time and Store "
        "requests and bytes on 2 and 4 gloo ranks (measured), and the Store traffic at 1024 ranks "
        "(counted on simulated ranks)",
    ),
}


def _ab_from_args(ap: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """``--ab``: check its options (errors name the option), then :func:`run_ab`."""
    executors = [e for e in args.ab.split(",") if e]
    if len(executors) < 2 or len(set(executors)) < len(executors):
        ap.error("--ab: two or more different baselines, the candidate first (e.g. --ab commfuse,inductor)")
    try:
        compile_order(executors)  # every name is a baseline, and they can share one process
    except (KeyError, ValueError) as e:
        ap.error(f"--ab: {e.args[0]}")
    if args.plot or args.from_json:
        ap.error(
            "--ab: --plot and --from-json do not apply (re-render a stored A/B run with --from-json alone)"
        )
    suite = get_suite(args.suite)
    try:
        workloads = {
            w: args.world or get_workload(w).family.world or suite.world_size
            for w in (args.workloads.split(",") if args.workloads else suite.workloads)
        }
    except KeyError as e:
        ap.error(f"--workloads: {e.args[0]}")
    pairs = MIN_PAIRS if args.pairs is None else args.pairs
    if pairs < 1 or (args.warmup or 0) < 0 or (args.world is not None and args.world < 1):
        ap.error("--pairs and --world must be >= 1, --warmup >= 0")
    warnings = []
    if pairs < MIN_PAIRS:
        warnings.append(f"{pairs} pairs (< {MIN_PAIRS}): too few for a trustworthy interval; smoke use only")
        _log(f"warning: {warnings[-1]}")
    return run_ab(
        workloads,
        executors,
        warmup=suite.warmup if args.warmup is None else args.warmup,
        pairs=pairs,
        timeout_s=suite.job_timeout_s,
        command="python benchmarks/run.py " + shlex.join(argv),
        warnings=warnings,
        json_path=args.json,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="commfuse benchmark runner (workloads x baselines, one run)")
    ap.add_argument("--suite", choices=sorted(SUITES), default="quick")
    ap.add_argument("--json", type=Path, help="write every raw number and the metrics here")
    ap.add_argument("--plot", type=Path, help="write comparison.png and scaling.png into this directory")
    ap.add_argument("--markdown", type=Path, help="write the tables as Markdown here")
    ap.add_argument("--no-scaling", action="store_true", help="skip the compile-time scaling points")
    ap.add_argument(
        "--workloads",
        default=None,
        metavar="NAME[,NAME]",
        help="run only these of the suite's workloads (e.g. llama_tp_sp:s; default: all of them)",
    )
    ap.add_argument("--from-json", type=Path, help="re-render a stored run instead of measuring")
    ap.add_argument(
        "--ab",
        metavar="EXEC,EXEC[,EXEC]",
        help="A/B in one run: these baselines take turns step by step on the same ranks; the first "
        "(the candidate) is compared with each other one (speed-up with a 95%% bootstrap interval)",
    )
    ap.add_argument(
        "--pairs",
        type=int,
        metavar="N",
        help=f"with --ab: timed rounds, one step per baseline each (default and minimum {MIN_PAIRS}; "
        "fewer only for smoke runs, with a warning)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        metavar="N",
        help="with --ab: untimed rounds after the first step (default: the suite's)",
    )
    ap.add_argument(
        "--world",
        type=int,
        metavar="N",
        help="with --ab: ranks (default: the workload family's world size, else the suite's)",
    )
    for name, rep in _REPORTS.items():
        ap.add_argument("--" + name.replace("_", "-"), action="store_true", help=rep.help)
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="only the GPU mode on one CUDA GPU (runtime streams on NCCL, "
        "Inductor regions, DHelix, compute model vs measured kernels): benchmarks/results/gpu-<date>.*",
    )
    args = ap.parse_args(argv)
    if args.gpu:
        from benchmarks.gpu.mode import gpu_main

        return gpu_main(args.json, ap.error, wheels=_WHEELS)

    for name, rep in _REPORTS.items():
        if getattr(args, name):
            mod = importlib.import_module(rep.module)
            report = getattr(mod, rep.run)()
            print(getattr(mod, rep.tables)(report))
            _write({"schema": SCHEMA, "environment": environment(), rep.key: report}, args.json)
            return 0

    ab_only = [f"--{k}" for k in ("pairs", "warmup", "world") if getattr(args, k) is not None]
    if ab_only and not args.ab:
        ap.error(f"{', '.join(ab_only)}: only with --ab")
    if args.ab:
        doc = _ab_from_args(ap, args, sys.argv[1:] if argv is None else argv)
    elif args.from_json:
        doc = json.loads(args.from_json.read_text())
    else:
        suite = get_suite(args.suite)
        if args.workloads:
            try:
                suite = suite.only(args.workloads.split(","))
            except KeyError as e:
                ap.error(f"--workloads: {e.args[0]}")
        doc = run_suite(suite, args.json, scaling=not args.no_scaling)
    ab = doc.get("mode") == "ab"
    print(ab_tables(doc) if ab else text_tables(doc))
    if doc.get("wall_s") is not None:
        print(f"\nwall time: {doc['wall_s']:.0f} s")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text((ab_tables(doc, markdown=True) if ab else markdown_tables(doc)) + "\n")
    if args.plot and not ab:
        for path in write_plots(doc, args.plot):
            print(f"wrote {path}")
    failed = [r for r in doc["results"] if r["error"]] + [
        p for p in doc.get("scaling", {}).get("points", []) if p["error"]
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
