"""Command line: `python -m commfuse demo` (see `python -m commfuse --help`)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "run the 4-rank CPU demo",
                "calibrate": "measure collectives and compute here and write a cost profile"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: python -m commfuse <command> [options]\n\ncommands:")
        for name, text in commands.items():
            print(f"  {name:<10}{text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "demo":
        from .demo import demo

        return demo(argv[1:])
    if argv[0] == "calibrate":
        from .costmodel.calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    return 2


if __name__ == "__main__":
    sys.exit(main())
