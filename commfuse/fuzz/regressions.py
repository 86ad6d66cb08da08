"""Saved failing programs (tests/fuzz_regressions/*.json) and their replay.

A regression case is one JSON file::

    {
      "format": 1,
      "title": "sink_waits: mismatch",           # one line
      "pipeline": {"name": "sink_waits", "passes": ["sink_waits"], "exact": true},
      "failure": {"kind": "mismatch", "message": "..."},   # what it did when found
      "status": "open" | "fixed",                 # open: still fails (replayed as a strict xfail)
      "found": {"seed": 1, "index": 37, "commfuse": "0.1.0", "ops_before_shrink": 12},
      "note": "...",                              # optional: diagnosis, proposed fix
      "program": {...}                            # a commfuse.fuzz.program.Program
    }

Replaying runs :func:`commfuse.fuzz.check.check_program` on the program with that
pipeline (``"input"``: no pipeline, only the input verification) and reports the
failures of the same pipeline.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from commfuse._version import __version__
from commfuse.fuzz.check import CheckResult, Failure, PipelineSpec, check_program
from commfuse.fuzz.program import Program

FORMAT = 1


@dataclass
class Regression:
    program: Program
    pipeline: Optional[dict]  # PipelineSpec json; None for input-verification failures
    failure_kind: str
    status: str = "open"
    title: str = ""
    message: str = ""
    found: dict = field(default_factory=dict)
    path: Optional[Path] = None
    note: str = ""

    def pipeline_spec(self) -> Optional[PipelineSpec]:
        return None if self.pipeline is None else PipelineSpec.from_json(self.pipeline)

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "title": self.title,
            "pipeline": self.pipeline,
            "failure": {"kind": self.failure_kind, "message": self.message},
            "status": self.status,
            "found": self.found,
            "note": self.note,
            "program": self.program.to_json(),
        }


def make_regression(
    program: Program,
    failure: Failure,
    pipe: Optional[PipelineSpec],
    *,
    found: dict | None = None,
    status: str = "open",
) -> Regression:
    title = f"{failure.pipeline}: {failure.kind} ({program.summary()})"
    return Regression(
        program,
        pipe.to_json() if pipe is not None else None,
        failure.kind,
        status,
        title,
        failure.message[:4000],
        dict(found or {}, commfuse=__version__),
    )


def save_regression(directory: str | Path, reg: Regression) -> Path:
    """Write ``reg`` as ``<pipeline>-<kind>-<hash>.json`` in ``directory``; returns the path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    body = json.dumps(reg.to_json(), indent=1, sort_keys=True)
    digest = hashlib.sha256(reg.program.dumps().encode()).hexdigest()[:10]
    pname = reg.pipeline["name"] if reg.pipeline else "graph"  # failures of the traced graph itself
    path = d / f"{re.sub(r'[^A-Za-z0-9_]+', '_', pname)}-{reg.failure_kind}-{digest}.json"
    path.write_text(body + "\n")
    reg.path = path
    return path


def load_regression(path: str | Path) -> Regression:
    path = Path(path)
    d = json.loads(path.read_text())
    if d.get("format") != FORMAT:
        raise ValueError(f"{path}: regression format {d.get('format')} is not supported (expected {FORMAT})")
    f = d.get("failure", {})
    return Regression(
        Program.from_json(d["program"]),
        d.get("pipeline"),
        f.get("kind", ""),
        d.get("status", "open"),
        d.get("title", ""),
        f.get("message", ""),
        d.get("found", {}),
        path,
        d.get("note", ""),
    )


def load_regressions(directory: str | Path) -> list[Regression]:
    return [load_regression(p) for p in sorted(Path(directory).glob("*.json"))]


def replay(reg: Regression) -> tuple[CheckResult, list[Failure]]:
    """Run the case again; returns the result and the failures of its pipeline (empty: it passes)."""
    pipe = reg.pipeline_spec()
    res = check_program(reg.program, [] if pipe is None else [pipe], check_ir=reg.failure_kind == "ir")
    name = "input" if pipe is None else pipe.name
    relevant = [f for f in res.failures if f.pipeline in (name, "input", "trace", "reference", "ir")]
    return res, relevant
