"""Command line for the reports: ``commfuse report``, ``commfuse volume``, ``commfuse validate``.

* ``commfuse report DUMP_DIR [-o FILE] [--record RECORD_DIR] [--rank R] [--profile P]``: the
  static HTML page (default ``DUMP_DIR/report.html``);
* ``commfuse volume DUMP_DIR [--rank R] [--collectives] [--json FILE]``: the volume report as text;
* ``commfuse validate RECORD_DIR DUMP_DIR [--profile P] [--json FILE]``: measured vs predicted,
  exit status 1 when a count or byte mismatch was found.

Each command is an ``add_*_arguments(parser)`` / ``*_run(args)`` pair that ``commfuse.tools.cli``
mounts as a subcommand. The readers raise ``ValueError`` (a directory without dumps or traces)
or ``InputFileError`` (a corrupt file in it); the command line prints those as
``commfuse <cmd>: ...`` and exits with status 2 (docs/cli.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from commfuse.costmodel.profile import CostProfile
from commfuse.reports.html import write_html
from commfuse.reports.validate import validate_dirs
from commfuse.reports.volume import volume_from_dump_dir


def _directory(text: str) -> Path:
    """An input directory that must exist: a usage error naming it, not "holds no dumps"."""
    p = Path(text)
    if not p.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    if not p.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: not a directory")
    return p


_RANK_HELP = "which rank<r>/ sub-directory of the dump dir to read (default: rank 0)"


def add_report_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("dump_dir", type=_directory, help="Config(dump_dir=...) / COMMFUSE_DUMP_DIR of the run")
    ap.add_argument("-o", "--output", type=Path, help="HTML file to write (default: DUMP_DIR/report.html)")
    ap.add_argument(
        "--record",
        type=_directory,
        help="recorder directory (rank<r>.json): measured timelines and "
        "the measured-vs-predicted section (default: none)",
    )
    ap.add_argument("--rank", type=int, help=_RANK_HELP)
    ap.add_argument(
        "--profile",
        type=Path,
        help="cost profile (commfuse calibrate) for predicted times (default: uncalibrated model)",
    )
    ap.add_argument("--title", help="page title (default: 'commfuse report: DUMP_DIR')")


def _profile(path: Path | None) -> CostProfile | None:
    # Loaded here, before any dump is read: a bad profile is reported even where the page
    # would not use it (no --record), instead of being ignored without a word.
    return None if path is None else CostProfile.load(path)


def report_run(args: argparse.Namespace) -> int:
    path = write_html(
        args.dump_dir,
        args.output,
        rank=args.rank,
        record_dir=args.record,
        profile=_profile(args.profile),
        title=args.title,
    )
    print(path)
    return 0


def add_volume_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("dump_dir", type=_directory, help="Config(dump_dir=...) / COMMFUSE_DUMP_DIR of the run")
    ap.add_argument("--rank", type=int, help=_RANK_HELP)
    ap.add_argument("--collectives", action="store_true", help="also list every collective")
    ap.add_argument("--json", type=Path, help="also write the report as JSON here (default: not written)")


def volume_run(args: argparse.Namespace) -> int:
    rep = volume_from_dump_dir(args.dump_dir, rank=args.rank)
    print(rep.table(collectives=args.collectives))
    if args.json:
        args.json.write_text(rep.to_json())
    return 0


def add_validate_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("record_dir", type=_directory, help="recorder directory with rank<r>.json")
    ap.add_argument("dump_dir", type=_directory, help="dump dir with the lowering plans (rank<r>/ or shared)")
    ap.add_argument(
        "--profile", type=Path, help="cost profile for predicted times (default: uncalibrated model)"
    )
    ap.add_argument("--json", type=Path, help="also write the result as JSON here (default: not written)")
    ap.add_argument("--rows", type=int, default=40, help="collectives to list")


def validate_run(args: argparse.Namespace) -> int:
    """Exit status 1, with the count on stderr, when a recorded call does not match its plan."""
    rep = validate_dirs(args.record_dir, args.dump_dir, profile=_profile(args.profile))
    print(rep.table(max_rows=args.rows))
    if args.json:
        args.json.write_text(json.dumps(rep.to_dict(), indent=1, default=str))
    if rep.ok:
        return 0
    sys.stdout.flush()  # the reason comes after the table it refers to
    print(
        f"commfuse validate: exit status 1: {len(rep.mismatches)} mismatch(es) between the recorded calls "
        "and the plans (listed above)",
        file=sys.stderr,
    )
    return 1


__all__ = [
    "add_report_arguments",
    "add_validate_arguments",
    "add_volume_arguments",
    "report_run",
    "validate_run",
    "volume_run",
]
