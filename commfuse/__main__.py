"""Command line: `python -m commfuse demo` (see `python -m commfuse --help` and docs/cli.md)."""

from __future__ import annotations

import sys

from commfuse.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
