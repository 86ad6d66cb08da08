"""Graph dumps: FX code, an SVG picture and the analysis JSON, before/after each changing pass.

Layout: ``<dump_dir>/rank<r>/<kind>_<index:03d>/<order:02d>_<label>.{py.txt,svg,json}`` where
``r`` is this process's rank (0 without a process group; ``commfuse.core.dump_layout``), kind
is joint/forward/backward/inference/graph, index counts graphs of that kind compiled by this
process, order is the position in the pipeline and label is ``input`` or ``after_<pass>``. A
pipeline report (``pipeline.json``) closes each directory, and ``<dump_dir>/index.json`` lists
every rank's graphs.

A dump that cannot be written is skipped with a warning: a file system error (read-only
path, disk full) once per process and dump directory, however many graphs fail to write there;
any other failure, or a picture Graphviz cannot draw, once per graph. Dumps are rank-local and
must never change compilation.
"""

from __future__ import annotations

import itertools
import os
import threading
import warnings
from collections import defaultdict
from pathlib import Path

import torch.fx as fx

from commfuse.core.dump_layout import update_dump_index
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.passmgr.render import condensed_dot, dot_to_svg, graph_to_dot
from commfuse.passmgr.report import build_analysis_report

_COUNTERS: dict[tuple[str, str], itertools.count] = defaultdict(itertools.count)
_LOCK = threading.Lock()
# dump directories this process has warned about a file system error in: an unwritable
# directory fails every graph alike
_WARNED_DIRS: set[str] = set()


def next_graph_index(dump_dir: str, kind: str) -> int:
    with _LOCK:
        return next(_COUNTERS[(os.path.abspath(dump_dir), kind)])


class DumpWriter:
    def __init__(
        self, dump_dir: str, kind: str, *, svg_max_nodes: int = 250, index: int | None = None
    ) -> None:
        self.kind = kind
        self.root = os.path.abspath(dump_dir)
        self.index = next_graph_index(dump_dir, kind) if index is None else index
        self.dir = Path(dump_dir) / f"{kind}_{self.index:03d}"
        self.svg_max_nodes = svg_max_nodes
        self._order = 0
        self._failed = False
        self._svg_failed = False

    def _warn(self, what: str, err: BaseException) -> None:
        first = not self._failed
        if first and isinstance(err, OSError):
            with _LOCK:
                first = self.root not in _WARNED_DIRS
                _WARNED_DIRS.add(self.root)
        if first:
            where = (
                f"dumps under {self.root} are skipped"
                if isinstance(err, OSError)
                else "this graph's dumps are skipped"
            )
            warnings.warn(
                f"commfuse: cannot write graph dump {what} ({type(err).__name__}: {err}); "
                f"{where}, compilation is unaffected",
                RuntimeWarning,
                stacklevel=3,
            )
        self._failed = True

    def write_graph(self, label: str, gm: fx.GraphModule, ir: CollectiveIR) -> None:
        if self._failed:
            return
        stem = f"{self._order:02d}_{label}"
        self._order += 1
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / f"{stem}.py.txt").write_text(gm.print_readable(print_output=False))
            report = build_analysis_report(ir, graph=f"{self.kind}_{self.index:03d}/{stem}")
            (self.dir / f"{stem}.json").write_text(report.to_json())
        except Exception as e:  # noqa: BLE001 - any dump failure must not reach compilation
            self._warn(str(self.dir / stem), e)
            return
        self._write_picture(stem, gm, ir)

    def _write_picture(self, stem: str, gm: fx.GraphModule, ir: CollectiveIR) -> None:
        if self._svg_failed:
            return
        title = f"{self.kind} {self.index} {stem}"
        try:
            full = len(gm.graph.nodes) <= self.svg_max_nodes
            dot = graph_to_dot(gm, ir, title=title) if full else condensed_dot(gm, ir, title=title)
            svg = dot_to_svg(dot)
            if svg is not None:
                (self.dir / f"{stem}.svg").write_bytes(svg)
            else:  # Graphviz not installed: the DOT source is still a picture a user can render
                (self.dir / f"{stem}.dot").write_text(dot)
        except Exception as e:  # noqa: BLE001 - a picture that cannot be drawn costs only the picture
            self._svg_failed = True
            warnings.warn(
                f"commfuse: cannot render {self.dir / stem}.svg ({type(e).__name__}: {e}); "
                "SVG dumps are skipped for this graph, text and JSON dumps continue",
                RuntimeWarning,
                stacklevel=3,
            )

    def update_index(self, top: Path, rank: int, world_size: int | None) -> None:
        """Rewrite this rank's entry of the index at the dump dir's top."""
        if self._failed:
            return
        try:
            update_dump_index(top, rank, world_size)
        except Exception as e:  # noqa: BLE001 - same rule as the dumps themselves
            self._warn(str(top / "index.json"), e)

    def write_text(self, name: str, text: str) -> None:
        if self._failed:
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / name).write_text(text)
        except Exception as e:  # noqa: BLE001
            self._warn(str(self.dir / name), e)
