"""Command line for the reports: ``commfuse report``, ``commfuse volume``, ``commfuse validate``.

* ``commfuse report DUMP_DIR [-o FILE] [--record RECORD_DIR] [--rank R] [--profile P]``: the
  static HTML page (default ``DUMP_DIR/report.html``);
* ``commfuse volume DUMP_DIR [--rank R] [--collectives] [--json FILE]``: the volume report as text;
* ``commfuse validate RECORD_DIR DUMP_DIR [--profile P] [--json FILE]``: measured vs predicted,
  exit status 1 when a count or byte mismatch was found.

Bad arguments (a directory without dumps or traces) exit with status 2 and a message naming
the argument.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from commfuse.reports.html import write_html
from commfuse.reports.validate import validate_dirs
from commfuse.reports.volume import volume_from_dump_dir


def _fail(msg: str) -> int:
    print(f"commfuse: {msg}", file=sys.stderr)
    return 2


def report_main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="commfuse report", description="one static HTML page from a dump dir")
    ap.add_argument("dump_dir", type=Path, help="Config(dump_dir=...) / COMMFUSE_DUMP_DIR of the run")
    ap.add_argument("-o", "--output", type=Path, help="HTML file to write (default DUMP_DIR/report.html)")
    ap.add_argument("--record", type=Path, help="recorder directory (rank<r>.json): measured timelines and "
                                                 "the measured-vs-predicted section")
    ap.add_argument("--rank", type=int, help="which rank<r>/ sub-directory to show (default 0)")
    ap.add_argument("--profile", type=Path, help="cost profile (commfuse calibrate) for predicted times")
    ap.add_argument("--title", help="page title")
    args = ap.parse_args(argv)

    try:
        path = write_html(args.dump_dir, args.output, rank=args.rank, record_dir=args.record,
                          profile=args.profile, title=args.title)
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        return _fail(f"report: {e}")
    print(path)
    return 0


def volume_main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="commfuse volume", description="communication volume before/after commfuse")
    ap.add_argument("dump_dir", type=Path)
    ap.add_argument("--rank", type=int, help="which rank<r>/ sub-directory (default 0)")
    ap.add_argument("--collectives", action="store_true", help="also list every collective")
    ap.add_argument("--json", type=Path, help="write the report as JSON here")
    args = ap.parse_args(argv)

    try:
        rep = volume_from_dump_dir(args.dump_dir, rank=args.rank)
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        return _fail(f"volume: {e}")
    print(rep.table(collectives=args.collectives))
    if args.json:
        args.json.write_text(rep.to_json())
    return 0


def validate_main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="commfuse validate",
                                 description="recorded collectives vs the lowering plans, per rank")
    ap.add_argument("record_dir", type=Path, help="recorder directory with rank<r>.json")
    ap.add_argument("dump_dir", type=Path, help="dump dir with the lowering plans (rank<r>/ or shared)")
    ap.add_argument("--profile", type=Path, help="cost profile for predicted times (default: uncalibrated)")
    ap.add_argument("--json", type=Path, help="write the result as JSON here")
    ap.add_argument("--rows", type=int, default=40, help="collectives to list (default 40)")
    args = ap.parse_args(argv)

    try:
        rep = validate_dirs(args.record_dir, args.dump_dir, profile=args.profile)
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        return _fail(f"validate: {e}")
    print(rep.table(max_rows=args.rows))
    if args.json:
        args.json.write_text(json.dumps(rep.to_dict(), indent=1, default=str))
    return 0 if rep.ok else 1
