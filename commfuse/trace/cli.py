"""``python -m commfuse align LOGDIR TRACEDIR -o OUT``: align NCCL logs with kernel traces.

LOGDIR: an NCCL ``NCCL_DEBUG=INFO`` log file or a directory of them (``*.log``, ``*.txt``,
``*.out``, ``*.err``; several processes per file are fine). TRACEDIR: a torch.profiler Chrome
trace (``.json``/``.json.gz``), an ``nsys export --type sqlite`` file, or a directory of them.
Writes the enriched Chrome trace to OUT and prints one line per rank; exit status 1 when
nothing could be aligned. See docs/alignment.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from commfuse.core.errors import ConfigError
from commfuse.trace.align import SYNC_POINTS, AlignConfig, GapRule, align_run
from commfuse.trace.enrich import load_topology, write_enriched
from commfuse.trace.kernel_trace import read_kernel_traces
from commfuse.trace.nccl_log import find_log_files, parse_nccl_logs


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m commfuse align", description=__doc__.splitlines()[0])
    ap.add_argument("logdir", help="NCCL_DEBUG=INFO log file or directory")
    ap.add_argument("tracedir", help="torch.profiler JSON / nsys SQLite file or directory")
    ap.add_argument("-o", "--out", required=True, help="enriched Chrome trace to write")
    ap.add_argument("--topology", default=None,
                    help="peak bandwidth source: a commfuse topology preset (dgx-h100, dgx-h100x2, ...) or JSON "
                         "file; default: the NCCL log's own topology block")
    ap.add_argument("--thesis", action="store_true",
                    help="the thesis's scoring only (op names, Eq. 4.1-4.3, Eq. 4.2 gaps; no attributes/timing)")
    ap.add_argument("--gap-rule", choices=("eq42", "constant", "geometric"), default="eq42")
    ap.add_argument("--sequence-bonus", type=float, default=0.0)
    ap.add_argument("--sync-point", choices=SYNC_POINTS, default="end")
    ap.add_argument("--summary-json", default=None, help="also write the per-rank summary as JSON here")
    args = ap.parse_args(argv)
    try:
        overrides = {"gap": GapRule(args.gap_rule), "sequence_bonus": args.sequence_bonus}
        cfg = AlignConfig.thesis(**overrides) if args.thesis else AlignConfig(**overrides)
        topology = load_topology(args.topology)
        logs = parse_nccl_logs(find_log_files(args.logdir))
        traces = read_kernel_traces(args.tracedir)
        if not logs:
            raise ConfigError(f"no NCCL log lines found under {args.logdir!r}")
        if not traces:
            raise ConfigError(f"no kernel traces found under {args.tracedir!r}")
        run = align_run(logs, traces, cfg, sync_point=args.sync_point)
        path = write_enriched(args.out, run, topology)
    except ConfigError as e:
        print(f"commfuse align: error: {e}", file=sys.stderr)
        return 2
    for ra in run.ranks:
        s = ra.summary()
        print(f"rank {s['rank']}: {s['launches']} launches, {s['kernels']} kernels -> {s['matched']} matched, "
              f"{s['mismatched']} mismatched, {s['unmatched_launches']} launches and {s['unmatched_kernels']} "
              f"kernels unaligned (log->kernel clock: {s['offset_from']}, "
              f"clock offset {run.offsets_ns.get(ra.rank, 0.0) / 1e3:+.3f} us)")
    for note in run.notes:
        print(f"note: {note}")
    for lc in run.comm_map.comms:
        print(f"{lc.name}: nranks {lc.nranks}, ranks {list(lc.ranks)} (by {lc.by})")
    print(f"wrote {path}")
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump({"ranks": [ra.summary() for ra in run.ranks], "notes": run.notes,
                       "clock_offsets_us": {str(r): v / 1e3 for r, v in run.offsets_ns.items()}}, f, indent=1)
    return 0 if any(ra.pairs for ra in run.ranks) else 1


if __name__ == "__main__":
    sys.exit(main())
