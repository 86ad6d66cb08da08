"""The ``commfuse`` command line: one argparse parser with a subparser per command.

``python -m commfuse <command> ...`` and the installed ``commfuse`` script both call :func:`main`.
Each command module supplies an ``add_arguments(parser)`` / ``run(args) -> int`` pair; this module
mounts them, prints bad input as one ``commfuse <command>: <what is wrong>`` line (the file first
when a file is at fault) instead of a traceback, and turns a closed stdout into a quiet exit.
The exit statuses are listed in :data:`EXIT_STATUS` and in docs/cli.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from commfuse._version import __version__
from commfuse.core.errors import CommfuseError, InputFileError
from commfuse.reports import cli as reports_cli
from commfuse.tools import calibrate, demo, emulate_cli, profile_overlap
from commfuse.trace import cli as align_cli

#: 128 + SIGPIPE: what a tool killed by SIGPIPE reports, so `set -o pipefail` scripts see the
#: usual status for "the reader stopped reading" (`commfuse volume DIR | head`).
EXIT_PIPE_CLOSED = 141

EXIT_STATUS = """\
exit status:
  0    success
  1    the command ran and reports a failure it found, with the reason on stderr:
       validate (a recorded call differs from its plan), align (no launch could be
       aligned with a kernel), demo (the compiled loss left eager's tolerance)
  2    usage error or bad input: unknown command or option, bad option value, a missing,
       unreadable or corrupt input file or directory ("commfuse CMD: PATH: what is wrong")
  130  interrupted (Ctrl-C)
  141  stdout was closed before the output was written (e.g. piped into head)
"""


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, as ``ArgumentDefaultsHelpFormatter`` does,
    except where the help already says it; an option without a default (None) says in its help
    what happens without it, and a flag reads "(default: off)" rather than "(default: False)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            not action.option_strings
            or action.required
            or action.default in (None, argparse.SUPPRESS)
            or "default" in text
        ):
            return text
        if action.default is False:
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


class _TopHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """The top-level help keeps the exit-status table's line breaks."""


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    #: When the command exits with status 1 (None: it does not).
    status_1: Optional[str] = None
    #: Beyond CommfuseError and OSError, what the command's library raises for bad input
    #: (the report readers raise ValueError for a directory without dumps or traces).
    bad_input: tuple[type[BaseException], ...] = ()

    def epilog(self) -> str:
        one = f"1 {self.status_1}; " if self.status_1 else ""
        return (
            f"exit status: 0 success; {one}2 usage error or bad input (the message names the file "
            f"and what is wrong); {EXIT_PIPE_CLOSED} stdout closed early. See `commfuse --help`."
        )


COMMANDS: tuple[Command, ...] = (
    Command(
        "demo",
        "run the 4-rank CPU demo: a TP+SP Llama block compiled with commfuse vs eager",
        demo.add_arguments,
        demo.run,
        "the compiled loss left eager's tolerance on a rank",
    ),
    Command(
        "calibrate",
        "measure collectives and compute here and write a cost profile",
        calibrate.add_arguments,
        calibrate.run,
    ),
    Command(
        "report",
        "static HTML report of a dump dir (graphs, volume, decisions, timelines)",
        reports_cli.add_report_arguments,
        reports_cli.report_run,
        bad_input=(ValueError,),
    ),
    Command(
        "volume",
        "communication volume before/after commfuse from a dump dir",
        reports_cli.add_volume_arguments,
        reports_cli.volume_run,
        bad_input=(ValueError,),
    ),
    Command(
        "validate",
        "recorded collectives (RECORD_DIR) vs the lowering plans (DUMP_DIR); exit 1 on a mismatch",
        reports_cli.add_validate_arguments,
        reports_cli.validate_run,
        "a recorded call differs from its plan (count or bytes)",
        (ValueError,),
    ),
    Command(
        "align",
        "align NCCL logs with kernel traces, write an enriched Chrome trace",
        align_cli.add_arguments,
        align_cli.run,
        "no launch could be aligned with a kernel (the trace is still written)",
    ),
    Command(
        "emulate",
        "run a command's ranks on an emulated cluster network (namespaces, shaped links)",
        emulate_cli.add_arguments,
        emulate_cli.run,
    ),
    Command(
        "profile-overlap",
        "measure DHelix overlap factors (Eq. 1) here and write an OEF profile",
        profile_overlap.add_arguments,
        profile_overlap.run,
    ),
)


_BY_NAME = {c.name: c for c in COMMANDS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commfuse",
        formatter_class=_TopHelpFormatter,
        description="The tools of commfuse, a torch.compile backend for distributed training.\n"
        "`commfuse COMMAND --help` lists a command's options and their defaults.",
        epilog=EXIT_STATUS + "\nReference: docs/cli.md.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"commfuse {__version__}",
        help="print commfuse's version and exit",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", required=True)
    for c in COMMANDS:
        p = sub.add_parser(
            c.name, help=c.help, description=c.help, formatter_class=HelpFormatter, epilog=c.epilog()
        )
        c.add_arguments(p)
        # The name, not the Command: demo hands `args` to spawned rank processes (pickled).
        p.set_defaults(_command=c.name)
    return parser


def _fail(name: str, what: str, status: int = 2) -> int:
    print(f"commfuse {name}: {what}", file=sys.stderr)
    return status


def _stdout_closed() -> int:
    # The reader went away; nothing is wrong with the command. What is still buffered would
    # raise again in the interpreter's final flush ("Exception ignored ... BrokenPipeError"),
    # so stdout's descriptor is pointed at devnull first (the recipe of Python's signal docs).
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a stdout without a descriptor (captured in-process)
        pass
    return EXIT_PIPE_CLOSED


def _describe_os_error(e: OSError) -> str:
    if e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)


def _run(args: argparse.Namespace) -> int:
    c = _BY_NAME[args._command]
    try:
        status = c.run(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return status
    except BrokenPipeError:
        return _stdout_closed()
    except InputFileError as e:
        return _fail(c.name, f"{e.path}: {e.problem}")
    except OSError as e:
        return _fail(c.name, _describe_os_error(e))
    except (CommfuseError, *c.bad_input) as e:
        return _fail(c.name, str(e))
    except KeyboardInterrupt:
        return _fail(c.name, "interrupted", 130)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command; returns the exit status (never raises SystemExit, so tests can call it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --help, --version (0) and usage errors (2): argparse printed them
            sys.stdout.flush()
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        return _run(args)
    except BrokenPipeError:
        return _stdout_closed()


__all__ = ["COMMANDS", "EXIT_PIPE_CLOSED", "EXIT_STATUS", "HelpFormatter", "build_parser", "main"]
