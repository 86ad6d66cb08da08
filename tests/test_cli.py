"""The ``commfuse`` command line (commfuse/tools/cli.py; docs/cli.md): one argparse parser,
``--version``, help with defaults, and bad input as one ``commfuse <cmd>: <path>: <what>`` line
with exit status 2, never a traceback.

Most tests call ``main(argv)`` in-process (a subprocess pays the torch import, seconds each);
two run ``python -m commfuse`` for real: the closed pipe and a smoke check of the entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse
from commfuse import Config
from commfuse.__main__ import main
from commfuse._version import __version__
from commfuse.testing.fake_pg import fake_process_group
from commfuse.tools.cli import COMMANDS, EXIT_PIPE_CLOSED, HelpFormatter, build_parser

ROOT = Path(__file__).resolve().parents[1]
ALIGN_FIX = Path(__file__).parent / "fixtures" / "alignment"
CORRUPT = '{"collectives": [1, 2'  # cut off mid-write


def _traced_forward() -> torch.fx.GraphModule:
    def f(x, w):
        a = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", "0"))
        return a + 1, torch.mm(w, w)

    return make_fx(f, tracing_mode="fake")(torch.randn(4, 4), torch.randn(4, 4))


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory) -> Path:
    """A real dump dir of one small forward graph (rank0/forward_000/...)."""
    d = tmp_path_factory.mktemp("dumps")
    with fake_process_group(2, rank=0):
        commfuse.optimize(
            _traced_forward(), Config(passes=["sink_waits"], dump_dir=str(d)), graph_kind="forward"
        )
    return d


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _one_error_line(err: str, prefix: str) -> str:
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("commfuse ")]
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


# ----------------------------------------------------------------------------- parser, version, help


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"commfuse {__version__}\n"


def test_unknown_command_is_a_usage_error_naming_it(capsys):
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'frobnicate'" in err and err.startswith("usage: commfuse")
    assert main([]) == 2
    assert "required: COMMAND" in capsys.readouterr().err
    assert main(["volume", "--no-such-flag", "."]) == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_top_level_help_lists_every_command_and_the_exit_statuses(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for c in COMMANDS:
        assert f"    {c.name}" in out
    for status in ("  0 ", "  1 ", "  2 ", f"  {EXIT_PIPE_CLOSED} "):
        assert status in out
    assert {c.name for c in COMMANDS} == {
        "demo",
        "calibrate",
        "report",
        "volume",
        "validate",
        "align",
        "profile-overlap",
        "emulate",
    }


@pytest.mark.parametrize("name", [c.name for c in COMMANDS])
def test_every_subcommand_help_works_and_every_option_says_its_default(name, capsys):
    assert main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: commfuse {name}") and "exit status: 0 success" in out
    parser = _subparsers()[name]
    fmt = HelpFormatter(prog="commfuse")
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{name} {action.dest}: no help text"
        if action.option_strings:
            text = fmt._get_help_string(action)
            assert "default" in text or (action.required and "required" in text), (name, action.dest, text)
    if name == "validate":
        assert "(default: 40)" in out.replace("\n", " ").replace("  ", " ")


# ----------------------------------------------------------------------------- bad input: one line, exit 2


def test_missing_input_directory(tmp_path, capsys):
    assert main(["volume", str(tmp_path / "nope")]) == 2
    assert f"{tmp_path / 'nope'}: no such directory" in capsys.readouterr().err


def test_corrupt_json_in_a_dump_dir_names_the_file(tmp_path, capsys):
    g = tmp_path / "rank0" / "forward_000"
    g.mkdir(parents=True)
    bad = g / "00_input.json"
    bad.write_text(CORRUPT)
    assert main(["volume", str(tmp_path)]) == 2
    line = _one_error_line(capsys.readouterr().err, "commfuse volume: ")
    assert line.startswith(f"commfuse volume: {bad}: not valid JSON (analysis dump): ")
    assert main(["report", str(tmp_path), "-o", str(tmp_path / "r.html")]) == 2
    _one_error_line(capsys.readouterr().err, f"commfuse report: {bad}: not valid JSON")
    # valid JSON, wrong content: pydantic's complaint, with the file and the field
    bad.write_text(json.dumps({"num_nodes": "many"}))
    assert main(["volume", str(tmp_path)]) == 2
    line = _one_error_line(capsys.readouterr().err, f"commfuse volume: {bad}: not a valid analysis dump: ")
    assert "num_nodes" in line


def test_corrupt_recorder_trace_names_the_file(tmp_path, dump_dir, capsys):
    rec = tmp_path / "record"
    rec.mkdir()
    (rec / "rank0.json").write_text(CORRUPT)
    assert main(["validate", str(rec), str(dump_dir)]) == 2
    _one_error_line(
        capsys.readouterr().err, f"commfuse validate: {rec / 'rank0.json'}: not valid JSON (recorder trace)"
    )


def test_a_json_file_of_the_wrong_shape_names_the_file(tmp_path, dump_dir, capsys):
    rec = tmp_path / "record"
    rec.mkdir()
    (rec / "rank0.json").write_text("[1]")
    assert main(["validate", str(rec), str(dump_dir)]) == 2
    _one_error_line(
        capsys.readouterr().err,
        f"commfuse validate: {rec / 'rank0.json'}: not a recorder trace: expected a JSON object, got list",
    )
    (rec / "rank0.json").write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "comm"}]}))
    assert main(["validate", str(rec), str(dump_dir)]) == 2
    _one_error_line(
        capsys.readouterr().err, f"commfuse validate: {rec / 'rank0.json'}: recorder trace: event"
    )


def test_corrupt_cost_profile_names_the_file(tmp_path, dump_dir, capsys):
    prof = tmp_path / "profile.json"
    prof.write_text(CORRUPT)
    assert main(["report", str(dump_dir), "-o", str(tmp_path / "r.html"), "--profile", str(prof)]) == 2
    _one_error_line(capsys.readouterr().err, f"commfuse report: {prof}: cannot read profile file: Expecting")
    prof.write_text("[1, 2]")
    assert main(["report", str(dump_dir), "-o", str(tmp_path / "r.html"), "--profile", str(prof)]) == 2
    _one_error_line(
        capsys.readouterr().err, f"commfuse report: {prof}: a profile file must hold a JSON object"
    )


def test_corrupt_topology_file_names_the_file(tmp_path, capsys):
    topo = tmp_path / "topo.json"
    topo.write_text(CORRUPT)
    argv = [
        "align",
        str(ALIGN_FIX / "nccl_node-1.log"),
        str(ALIGN_FIX / "torch_trace_rank0.json"),
        "-o",
        str(tmp_path / "e.json"),
        "--topology",
        str(topo),
    ]
    assert main(argv) == 2
    _one_error_line(capsys.readouterr().err, f"commfuse align: {topo}: cannot read topology file: Expecting")


def test_unwritable_output_names_the_file(dump_dir, tmp_path, capsys):
    out = tmp_path / "no" / "such" / "dir" / "v.json"
    assert main(["volume", str(dump_dir), "--json", str(out)]) == 2
    _one_error_line(capsys.readouterr().err, f"commfuse volume: {out}: No such file or directory")


def test_bad_option_value_is_exit_2(capsys):
    assert main(["profile-overlap", "-o", "x.json", "--world-size", "1"]) == 2
    _one_error_line(capsys.readouterr().err, "commfuse profile-overlap: --world-size must be >= 2")


# ----------------------------------------------------------------------------- exit status 1 says why


def test_align_says_why_it_exits_1(tmp_path, capsys):
    """A kernel trace of another run (rank 99) pairs with no log process: the enriched trace is
    still written, and stderr says why the status is 1."""
    doc = json.loads((ALIGN_FIX / "torch_trace_rank0.json").read_text())
    doc["distributedInfo"]["rank"] = 99
    trace = tmp_path / "trace_rank99.json"
    trace.write_text(json.dumps(doc))
    out = tmp_path / "e.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["align", str(ALIGN_FIX / "nccl_node-1.log"), str(trace), "-o", str(out)]) == 1
    cap = capsys.readouterr()
    assert f"wrote {out}" in cap.out and out.exists()
    line = _one_error_line(cap.err, "commfuse align: exit status 1: ")
    assert "no NCCL log process could be paired with a kernel trace" in line


def test_validate_says_why_it_exits_1(monkeypatch, tmp_path, capsys):
    class Failing:
        ok, mismatches = False, ["a", "b"]

        def table(self, max_rows):
            return "the table"

    monkeypatch.setattr("commfuse.reports.cli.validate_dirs", lambda *a, **k: Failing())
    assert main(["validate", str(tmp_path), str(tmp_path)]) == 1
    cap = capsys.readouterr()
    assert cap.out == "the table\n"
    _one_error_line(cap.err, "commfuse validate: exit status 1: 2 mismatch(es) between the recorded calls")


# ----------------------------------------------------------------------------- the real entry point


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }


def test_python_m_commfuse_smoke():
    r = subprocess.run(
        [sys.executable, "-m", "commfuse", "--version"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, f"commfuse {__version__}\n", "")


def test_closed_stdout_is_a_quiet_exit_141(dump_dir):
    """``commfuse volume DIR | head``: the reader is gone. The read end is closed before the child
    writes anything, so its write fails whatever the output's size (a reader that closes after one
    line would race with a child whose whole output fits the pipe buffer)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "commfuse", "volume", str(dump_dir), "--collectives"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        cwd=ROOT,
    )
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == EXIT_PIPE_CLOSED
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


# ----------------------------------------------------------------------------- the docs follow the parser


def test_docs_cli_md_lists_every_command_and_option():
    doc = (ROOT / "docs" / "cli.md").read_text()
    for name, parser in _subparsers().items():
        assert f"`commfuse {name}" in doc and f"| `{name}` |" in doc, name
        for action in parser._actions:
            for opt in action.option_strings:
                if opt not in ("-h", "--help"):
                    assert f"`{opt}`" in doc, (name, opt)
    for status in ("| 0 |", "| 1 |", "| 2 |", f"| {EXIT_PIPE_CLOSED} |"):
        assert status in doc
    readme = (ROOT / "README.md").read_text()
    assert all(f"`{c.name}`" in readme or f"python -m commfuse {c.name}" in readme for c in COMMANDS)
