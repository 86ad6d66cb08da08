"""``python -m commfuse align LOGDIR TRACEDIR -o OUT``: align NCCL logs with kernel traces.

LOGDIR: an NCCL ``NCCL_DEBUG=INFO`` log file or a directory of them (``*.log``, ``*.txt``,
``*.out``, ``*.err``; several processes per file are fine). TRACEDIR: a torch.profiler Chrome
trace (``.json``/``.json.gz``), an ``nsys export --type sqlite`` file, or a directory of them.
Writes the enriched Chrome trace to OUT and prints one line per rank; exit status 1 when
nothing could be aligned, with the reason on stderr. See docs/alignment.md and docs/cli.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from commfuse.core.errors import ConfigError
from commfuse.trace.align import SYNC_POINTS, AlignConfig, GapRule, RunAlignment, align_run
from commfuse.trace.enrich import load_topology, write_enriched
from commfuse.trace.kernel_trace import read_kernel_traces
from commfuse.trace.nccl_log import find_log_files, parse_nccl_logs


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``align`` options (the ``commfuse align`` subcommand and :func:`main` share them)."""
    ap.add_argument("logdir", help="NCCL_DEBUG=INFO log file or directory")
    ap.add_argument("tracedir", help="torch.profiler JSON / nsys SQLite file or directory")
    ap.add_argument("-o", "--out", required=True, help="enriched Chrome trace to write (required)")
    ap.add_argument(
        "--topology",
        default=None,
        help="peak bandwidth source: a commfuse topology preset (dgx-h100, dgx-h100x2, ...) or JSON "
        "file; default: the NCCL log's own topology block",
    )
    ap.add_argument(
        "--thesis",
        action="store_true",
        help="the thesis's scoring only (op names, Eq. 4.1-4.3, Eq. 4.2 gaps; no attributes/timing)",
    )
    ap.add_argument(
        "--gap-rule",
        choices=("eq42", "constant", "geometric"),
        default="eq42",
        help="gap penalty: eq42 (thesis Eq. 4.2, growing with the gap run), constant, or geometric",
    )
    ap.add_argument(
        "--sequence-bonus",
        type=float,
        default=0.0,
        help="score added for each match that follows a match (the thesis tests use 1)",
    )
    ap.add_argument(
        "--sync-point",
        choices=SYNC_POINTS,
        default="end",
        help="kernel point the cross-rank clock sync lines up (ends coincide across ranks; "
        "starts differ by arrival)",
    )
    ap.add_argument(
        "--summary-json",
        default=None,
        help="also write the per-rank summary as JSON here (default: not written)",
    )


def _nothing_aligned(result: RunAlignment) -> str:
    """Why exit status 1: the trace was written, but no launch found its kernel."""
    if not result.ranks:
        return "no NCCL log process could be paired with a kernel trace (see the notes above)"
    n_l = sum(len(ra.launches) for ra in result.ranks)
    n_k = sum(len(ra.kernels) for ra in result.ranks)
    if not n_l:
        return f"the logs paired with traces hold no collective launches ({len(result.ranks)} rank(s))"
    if not n_k:
        return f"the traces paired with logs hold no NCCL kernels ({len(result.ranks)} rank(s))"
    return (
        f"no launch was aligned with a kernel on any of {len(result.ranks)} rank(s) ({n_l} launches, "
        f"{n_k} kernels); are the logs and traces from the same run?"
    )


def run(args: argparse.Namespace) -> int:
    """Align, write the enriched trace and report; ConfigError on bad input (the caller prints it).

    Exit status 0 when some launch was aligned, 1 (with the reason on stderr) when none was."""
    overrides = {"gap": GapRule(args.gap_rule), "sequence_bonus": args.sequence_bonus}
    cfg = AlignConfig.thesis(**overrides) if args.thesis else AlignConfig(**overrides)
    topology = load_topology(args.topology)
    logs = parse_nccl_logs(find_log_files(args.logdir))
    traces = read_kernel_traces(args.tracedir)
    if not logs:
        raise ConfigError(f"no NCCL log lines found under {args.logdir!r}")
    if not traces:
        raise ConfigError(f"no kernel traces found under {args.tracedir!r}")
    result = align_run(logs, traces, cfg, sync_point=args.sync_point)
    path = write_enriched(args.out, result, topology)
    for ra in result.ranks:
        s = ra.summary()
        print(
            f"rank {s['rank']}: {s['launches']} launches, {s['kernels']} kernels -> {s['matched']} matched, "
            f"{s['mismatched']} mismatched, {s['unmatched_launches']} launches and {s['unmatched_kernels']} "
            f"kernels unaligned (log->kernel clock: {s['offset_from']}, "
            f"clock offset {result.offsets_ns.get(ra.rank, 0.0) / 1e3:+.3f} us)"
        )
    for note in result.notes:
        print(f"note: {note}")
    for lc in result.comm_map.comms:
        print(f"{lc.name}: nranks {lc.nranks}, ranks {list(lc.ranks)} (by {lc.by})")
    print(f"wrote {path}")
    if args.summary_json:
        try:
            with open(args.summary_json, "w") as f:
                json.dump(
                    {
                        "ranks": [ra.summary() for ra in result.ranks],
                        "notes": result.notes,
                        "clock_offsets_us": {str(r): v / 1e3 for r, v in result.offsets_ns.items()},
                    },
                    f,
                    indent=1,
                )
        except OSError as e:
            raise ConfigError(f"summary JSON: cannot write {args.summary_json!r}: {e}") from e
    if any(ra.pairs for ra in result.ranks):
        return 0
    sys.stdout.flush()  # the reason comes after the per-rank lines it refers to
    print(f"commfuse align: exit status 1: {_nothing_aligned(result)}", file=sys.stderr)
    return 1


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m commfuse.trace.cli``; ``python -m commfuse align`` is the same command."""
    ap = argparse.ArgumentParser(prog="python -m commfuse align", description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        return run(args)
    except ConfigError as e:
        print(f"commfuse align: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
