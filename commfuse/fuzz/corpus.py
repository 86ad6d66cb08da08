"""A frozen set of fuzz programs: what CI checks on every run.

A campaign on a seed generates its programs from the generator and the registered passes
(every fourth program is drawn for a constrained pass), so a change to either changes the
programs, and an unrelated change could meet a newly found failure. A corpus stores the
programs themselves: the same commit checks the same programs on every run, and the set
changes only when someone rewrites the file (``python -m commfuse.fuzz --write-corpus``).
Finding new failures is the long campaign's job (docs/contributing.md, "The long campaign").

A corpus is one JSON file::

    {
      "format": 1,
      "seed": 20240, "start": 0, "features": ["..."],     # how the programs were generated
      "command": "python -m commfuse.fuzz --write-corpus ...",
      "programs": [{"index": 0, "program": {...}}, ...]    # commfuse.fuzz.program.Program
    }
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from commfuse.fuzz.check import PipelineSpec, all_pipelines
from commfuse.fuzz.program import Program
from commfuse.fuzz.targets import program_for

FORMAT = 1


class CorpusError(ValueError):
    """A corpus file that cannot be read: the message names the file and the field."""


@dataclass
class Corpus:
    seed: int
    programs: list[tuple[int, Program]]  # (index in the seed's campaign, program)
    start: int = 0
    features: tuple[str, ...] = ()
    command: str = ""
    path: Optional[Path] = field(default=None, compare=False)

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "seed": self.seed,
            "start": self.start,
            "features": list(self.features),
            "command": self.command,
            "programs": [{"index": i, "program": p.to_json()} for i, p in self.programs],
        }


def make_corpus(
    seed: int,
    programs: int,
    *,
    start: int = 0,
    features: Sequence[str] = (),
    pipelines: Optional[Sequence[PipelineSpec]] = None,
) -> Corpus:
    """Programs ``start .. start+programs-1`` of ``seed`` as a campaign with ``pipelines``
    (default: every registered pass and the default pipeline) would generate them."""

    pipes = list(pipelines) if pipelines is not None else all_pipelines()
    progs = [(i, program_for(seed, i, pipes, features)) for i in range(start, start + programs)]
    cmd = [
        "python",
        "-m",
        "commfuse.fuzz",
        "--write-corpus",
        "FILE",
        "--seed",
        str(seed),
        "--programs",
        str(programs),
    ]
    if start:
        cmd += ["--start", str(start)]
    for f in features:
        cmd += ["--feature", f]
    return Corpus(seed, progs, start=start, features=tuple(features), command=shlex.join(cmd))


def save_corpus(path: str | Path, corpus: Corpus) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # one program per line: a regenerated corpus diffs program by program
    body = ",\n".join(
        json.dumps({"index": i, "program": p.to_json()}, sort_keys=True) for i, p in corpus.programs
    )
    head = {k: v for k, v in corpus.to_json().items() if k != "programs"}
    text = json.dumps(head, sort_keys=True)[:-1] + ', "programs": [\n' + body + "\n]}\n"
    path.write_text(text)
    corpus.path = path
    return path


def load_corpus(path: str | Path) -> Corpus:
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CorpusError(f"{path}: cannot read the fuzz corpus: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorpusError(
            f"{path}: field 'format' must be {FORMAT}, got {doc.get('format') if isinstance(doc, dict) else doc!r}"
        )
    for key, typ in (("seed", int), ("programs", list)):
        if not isinstance(doc.get(key), typ):
            raise CorpusError(f"{path}: field {key!r} must be a {typ.__name__}")
    progs = []
    for k, entry in enumerate(doc["programs"]):
        try:
            progs.append((int(entry["index"]), Program.from_json(entry["program"])))
        except (KeyError, TypeError, ValueError) as e:
            raise CorpusError(
                f"{path}: programs[{k}] is not a program entry ({type(e).__name__}: {e})"
            ) from e
    return Corpus(
        doc["seed"],
        progs,
        start=int(doc.get("start", 0)),
        features=tuple(doc.get("features", ())),
        command=str(doc.get("command", "")),
        path=path,
    )
