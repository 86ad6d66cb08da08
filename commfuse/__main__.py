"""Command line: `python -m commfuse demo` (see `python -m commfuse --help`)."""

from __future__ import annotations

import sys

from commfuse.reports import cli
from commfuse.tools.calibrate import main as calibrate_main
from commfuse.tools.demo import demo
from commfuse.tools.profile_overlap import main as profile_overlap_main
from commfuse.trace.cli import main as align_main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "run the 4-rank CPU demo",
                "calibrate": "measure collectives and compute here and write a cost profile",
                "report": "static HTML report of a dump dir (graphs, volume, decisions, timelines)",
                "volume": "communication volume before/after commfuse from a dump dir",
                "validate": "recorded collectives (RECORD_DIR) vs the lowering plans (DUMP_DIR)",
                "align": "align NCCL logs with kernel traces, write an enriched Chrome trace",
                "profile-overlap": "measure DHelix overlap factors (Eq. 1) here and write an OEF profile"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: python -m commfuse <command> [options]\n\ncommands:")
        for name, text in commands.items():
            print(f"  {name:<17}{text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "demo":
        return demo(argv[1:])
    if argv[0] == "calibrate":
        return calibrate_main(argv[1:])
    if argv[0] in ("report", "volume", "validate"):
        return getattr(cli, f"{argv[0]}_main")(argv[1:])
    if argv[0] == "align":
        return align_main(argv[1:])
    if argv[0] == "profile-overlap":
        return profile_overlap_main(argv[1:])
    return 2


if __name__ == "__main__":
    sys.exit(main())
