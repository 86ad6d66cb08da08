"""`commfuse emulate`: the command line of commfuse.emulate (docs/emulate.md)."""

from __future__ import annotations

import argparse

from commfuse.core.errors import ConfigError
from commfuse.emulate.launch import check_can_emulate, exec_emulated, network_spec
from commfuse.emulate.presets import PRESETS, preset


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        help=f"the cluster to emulate: {', '.join(sorted(PRESETS))} (no default: required unless --list)",
    )
    p.add_argument("--nodes", type=int, default=1, help="nodes")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node")
    p.add_argument(
        "--no-link-check",
        action="store_true",
        help="start the ranks without first measuring each link against the preset",
    )
    p.add_argument(
        "--tolerance", type=float, default=0.10, help="how far a measured link may be off its rate"
    )
    p.add_argument("--no-pin", action="store_true", help="do not pin rank r to core r mod the cores")
    p.add_argument("--list", action="store_true", help="list the presets and their rates, then exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command every rank runs")


def run(a: argparse.Namespace) -> int:
    if a.list:
        for p in PRESETS.values():
            print(p.describe())
        return 0
    if a.preset is None:
        raise ConfigError("emulate: --preset is required (or --list)")
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        raise ConfigError("emulate: no command: write it after --, e.g. -- python train.py")
    spec = network_spec(
        preset(a.preset),
        a.nodes,
        a.ranks_per_node,
        check=not a.no_link_check,
        tolerance=a.tolerance,
        pin=not a.no_pin,
    )
    check_can_emulate()
    exec_emulated(spec, command)
    return 0  # not reached: the process is now the emulated cluster
