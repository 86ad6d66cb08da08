"""Volume report: every collective of a program before and after commfuse, per rank.

Contract
    A :class:`VolumeReport` lists, for each graph of a program, the collectives before
    commfuse (the graph the pipeline received) and after (the graph it produced), each with
    kind, group, parallel role, direction (forward / backward where known), logged bytes
    (NCCL count semantics) and wire bytes (ring conventions) per rank -- the IR's numbers
    (:mod:`commfuse.ir.volume`) -- and, where one applies, the analytic formula of
    :mod:`commfuse.costmodel.volume` (Chimera Table 1; the thesis's DP row for gradient
    all_reduces) evaluated on the collective's own shape, with the difference. It totals
    them per kind, group, role and direction, for the *program*: before = the graphs as
    written (joint / inference / plain graph inputs), after = the graphs that run
    (forward / backward / inference / plain graph outputs). It carries the pipeline's
    "why not fused / not partitioned" reasons (every pass's refusals, errors and notes).

    Three sources, one result:

    * :func:`volume_from_graph` -- any FX graph: a copy is analysed, another copy runs the
      configured pipeline (``commfuse.optimize``); direction comes from the graph itself
      (a joint graph's collectives that depend on tangents are backward).
    * :func:`volume_from_reports` -- a compiled model's ``backend.reports`` or a training
      step's ``step.reports`` (PipelineReport objects): "after" from the reports, "before"
      from each graph's dump (``Config(dump_dir=...)``); without dumps "before" is missing
      and the report says so.
    * :func:`volume_from_dump_dir` -- a dump directory on disk: one ``rank<r>/`` sub-directory
      per rank (what commfuse writes, with ``index.json`` beside them) holding ``<kind>_<i>/``
      with ``NN_input.json``, ``NN_after_<pass>.json``, ``pipeline.json``; a rank's own
      directory, or a flat dump dir of an older run, is read as it is.

    Dumps do not record a joint graph's forward/backward split per collective, so from a
    dump the joint graph's "before" side has direction ``joint``; forward and backward
    graphs have their own kind as direction.

Guarantees
    Pure reading: nothing is compiled or communicated and no graph given is modified.
    Byte counts are exact integers; a symbolic size makes the affected totals ``None``.

Source: formulas of "Chimera: Communication Fusion for Hybrid Parallelism in Large Language Models"
(Qin et al., ISCA '25), §3.2, Table 1, and the DP model of the NCCL-trace thesis (L. Borzyk,
"Understanding LLM Communication", Heidelberg University, 2026, §2.4.1).
"""

from __future__ import annotations

import copy
import json
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch

from commfuse.api import analyze, pipeline_for
from commfuse.config import Config
from commfuse.core.jsonfile import read_model_file
from commfuse.core.meta import REPORTS_META
from commfuse.costmodel import volume as V
from commfuse.passmgr.base import Stage
from commfuse.passmgr.report import AnalysisReport, CollectiveReport, PipelineReport
from commfuse.passmgr.report_facts import graph_directions

# graph kinds whose *input* is the program as written, and whose *output* is what runs
_BEFORE_KINDS = ("joint", "inference", "graph")
_AFTER_KINDS = ("forward", "backward", "inference", "graph")
_DIR_RE = re.compile(r"^(?P<kind>[a-z]+)_(?P<index>\d+)$")


# ----------------------------------------------------------------------------- data
@dataclass
class FormulaCheck:
    """An analytic formula for one collective, evaluated on its own shape."""

    name: str  # e.g. "Chimera Table 1, SP all_gather"
    expression: str  # wire formula in Chimera's symbols
    values: str  # the substitution, e.g. "B=2 S=8 H=32 N=4 e=4"
    wire_bytes: int
    logged_bytes: int
    wire_diff: Optional[int]  # IR wire bytes - formula (None: IR size unknown)
    logged_diff: Optional[int]


@dataclass
class CollectiveVolume:
    graph: str  # "joint_000", "forward_000", ... or the graph kind for a graph report
    side: str  # "before" | "after"
    direction: str  # forward | backward | inference | joint (split unknown) | graph
    node: str
    kind: str
    group: str
    group_size: Optional[int]
    role: str
    dtype: Optional[str]
    logged_bytes: Optional[int]
    wire_bytes: Optional[int]
    embedded: str = ""  # non-empty: issued from inside this op (e.g. the MoE layer's dispatch)
    estimated: bool = False  # data-dependent size, estimated (balanced routing)
    formula: Optional[FormulaCheck] = None


@dataclass
class Totals:
    count: int = 0
    logged_bytes: Optional[int] = 0
    wire_bytes: Optional[int] = 0

    def add(self, c: CollectiveVolume) -> None:
        self.count += 1
        self.logged_bytes = (
            None
            if self.logged_bytes is None or c.logged_bytes is None
            else self.logged_bytes + c.logged_bytes
        )
        self.wire_bytes = (
            None if self.wire_bytes is None or c.wire_bytes is None else self.wire_bytes + c.wire_bytes
        )


@dataclass
class PassReasons:
    """What one pass did on one graph, and why it left candidates alone."""

    graph: str
    name: str
    stage: str
    changed: bool
    counts: dict[str, int] = field(default_factory=dict)
    refusals: list[str] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    error: Optional[str] = None


@dataclass
class GraphVolume:
    name: str
    kind: str
    before: Optional[list[CollectiveVolume]]  # None: not available (no dump)
    after: Optional[list[CollectiveVolume]]
    passes: list[PassReasons] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # pipeline notes, input problems, skipped reason
    dump_dir: Optional[str] = None


@dataclass
class VolumeReport:
    """Before/after volume of a program's graphs, totals, formula checks and pass reasons."""

    source: str
    graphs: list[GraphVolume] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    # -- selections -------------------------------------------------------------
    def program(self, side: str) -> Optional[list[CollectiveVolume]]:
        """The program's collectives on one side: before = graphs as written, after = graphs that run.
        None when a graph's side is unavailable."""
        kinds = _BEFORE_KINDS if side == "before" else _AFTER_KINDS
        out: list[CollectiveVolume] = []
        for g in self.graphs:
            if g.kind not in kinds:
                continue
            cs = g.before if side == "before" else g.after
            if cs is None:
                return None
            out.extend(cs)
        return out

    def totals(self, side: str, by: str = "kind") -> Optional[dict[str, Totals]]:
        """Program totals on `side` grouped by ``kind``, ``group``, ``role`` or ``direction``."""
        cs = self.program(side)
        if cs is None:
            return None
        return group_totals(cs, by)

    def total(self, side: str) -> Optional[Totals]:
        cs = self.program(side)
        if cs is None:
            return None
        t = Totals()
        for c in cs:
            t.add(c)
        return t

    def collectives(self) -> list[CollectiveVolume]:
        return [c for g in self.graphs for side in (g.before, g.after) if side for c in side]

    def formula_mismatches(self) -> list[CollectiveVolume]:
        return [
            c
            for c in self.collectives()
            if c.formula is not None
            and (c.formula.wire_diff not in (0, None) or c.formula.logged_diff not in (0, None))
        ]

    def reasons(self) -> list[PassReasons]:
        return [p for g in self.graphs for p in g.passes]

    # -- output -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for side in ("before", "after"):
            d[f"program_{side}"] = {
                by: ({k: asdict(t) for k, t in tots.items()} if tots is not None else None)
                for by in ("kind", "group", "role", "direction")
                for tots in [self.totals(side, by)]
            }
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def table(self, *, collectives: bool = False, max_reasons: int = 8) -> str:
        """Fixed-width text: program totals before/after per kind, role, group and direction,
        formula checks, and the passes' reasons (at most `max_reasons` refusals per pass)."""
        lines = [f"commfuse volume report: {self.source}"]
        lines.extend(f"note: {n}" for n in self.notes)
        for by in ("kind", "role", "group", "direction"):
            lines.append("")
            lines.extend(_compare_table(by, self.totals("before", by), self.totals("after", by)))
        tb, ta = self.total("before"), self.total("after")
        lines.append(_total_line(tb, ta))
        checked = [c for c in self.collectives() if c.formula is not None]
        bad = self.formula_mismatches()
        lines.append("")
        lines.append(f"analytic formulas: {len(checked)} collectives checked, {len(bad)} differ")
        for c in bad[:20]:
            f = c.formula
            lines.append(
                f"  {c.graph} {c.side} {c.kind} {c.node}: IR wire {c.wire_bytes} vs {f.name} "
                f"{f.wire_bytes} ({f.values}); logged {c.logged_bytes} vs {f.logged_bytes}"
            )
        if collectives:
            lines.append("")
            lines.append(
                f"{'graph':<14}{'side':<7}{'dir':<9}{'kind':<16}{'node':<28}{'group':<8}{'role':<8}"
                f"{'logged':>10}{'wire':>10}  formula"
            )
            for c in self.collectives():
                f = "-" if c.formula is None else f"{c.formula.wire_bytes} ({c.formula.name})"
                lines.append(
                    f"{c.graph:<14}{c.side:<7}{c.direction:<9}{c.kind:<16}{(c.embedded or c.node)[:27]:<28}"
                    f"{c.group[:7]:<8}{c.role:<8}{_fmt(c.logged_bytes):>10}{_fmt(c.wire_bytes):>10}  {f}"
                )
        lines.append("")
        lines.append("pass decisions (why not fused / not partitioned):")
        for p in self.reasons():
            counts = ", ".join(f"{k}={v}" for k, v in sorted(p.counts.items()))
            state = "ERROR " + p.error if p.error else ("changed" if p.changed else "unchanged")
            lines.append(f"  {p.graph} {p.name}: {state}" + (f" ({counts})" if counts else ""))
            for r in p.refusals[:max_reasons]:
                lines.append(f"    - {r}")
            if len(p.refusals) > max_reasons:
                lines.append(f"    ... {len(p.refusals) - max_reasons} more")
        for g in self.graphs:
            for n in g.notes:
                lines.append(f"  {g.name} note: {n}")
        return "\n".join(lines)


def group_totals(cs: Iterable[CollectiveVolume], by: str) -> dict[str, Totals]:
    if by not in ("kind", "group", "role", "direction"):
        raise ValueError(f"totals: 'by' must be kind, group, role or direction, got {by!r}")
    out: dict[str, Totals] = defaultdict(Totals)
    for c in cs:
        out[getattr(c, by)].add(c)
    return dict(sorted(out.items()))


def _fmt(x: Optional[int]) -> str:
    return "?" if x is None else str(x)


def _delta(a: Optional[int], b: Optional[int]) -> str:
    if a is None or b is None:
        return "?"
    if a == 0:
        return f"{b - a:+d}"
    return f"{b - a:+d} ({100.0 * (b - a) / a:+.1f}%)"


def _compare_table(
    by: str, before: Optional[dict[str, Totals]], after: Optional[dict[str, Totals]]
) -> list[str]:
    keys = sorted(set(before or {}) | set(after or {}))
    lines = [f"{by:<22}{'count':>13}{'logged B/rank':>22}{'wire B/rank':>22}{'wire change':>22}"]
    for k in keys:
        b = (before or {}).get(k, Totals()) if before is not None else None
        a = (after or {}).get(k, Totals()) if after is not None else None
        cnt = f"{b.count if b else '?'} -> {a.count if a else '?'}"
        lg = f"{_fmt(b.logged_bytes) if b else '?'} -> {_fmt(a.logged_bytes) if a else '?'}"
        wr = f"{_fmt(b.wire_bytes) if b else '?'} -> {_fmt(a.wire_bytes) if a else '?'}"
        ch = _delta(b.wire_bytes, a.wire_bytes) if a and b else "?"
        lines.append(f"{k[:21]:<22}{cnt:>13}{lg:>22}{wr:>22}{ch:>22}")
    return lines


def _total_line(b: Optional[Totals], a: Optional[Totals]) -> str:
    if b is None and a is None:
        return "total: n/a"
    cnt = f"{b.count if b else '?'} -> {a.count if a else '?'}"
    lg = f"{_fmt(b.logged_bytes) if b else '?'} -> {_fmt(a.logged_bytes) if a else '?'}"
    wr = f"{_fmt(b.wire_bytes) if b else '?'} -> {_fmt(a.wire_bytes) if a else '?'}"
    return f"{'total':<22}{cnt:>13}{lg:>22}{wr:>22}{(_delta(b.wire_bytes, a.wire_bytes) if a and b else '?'):>22}"


# ----------------------------------------------------------------------------- formulas
def _elt(dtype: Optional[str]) -> Optional[int]:
    if not dtype:
        return None
    dt = getattr(torch, dtype, None)
    return dt.itemsize if isinstance(dt, torch.dtype) else None


def _int(x: Any) -> Optional[int]:
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    return None


def _numel(shape: Optional[Sequence[Any]]) -> Optional[int]:
    if shape is None:
        return None
    n = 1
    for s in shape:
        if not isinstance(s, int):
            return None
        n *= s
    return n


def _bsh(shape: Sequence[int]) -> tuple[int, int, int]:
    """Chimera's B, S, H read off a shape: H the last dim, S the one before, B the rest."""
    dims = list(shape)
    if not dims:
        return 1, 1, 1
    if len(dims) == 1:
        return 1, 1, dims[0]
    b = 1
    for s in dims[:-2]:
        b *= s
    return b, dims[-2], dims[-1]


def formula_for(c: CollectiveReport) -> Optional[FormulaCheck]:
    """The analytic formula that applies to one collective of an analysis report, if any.

    * all_reduce: Chimera Table 1's TP all_reduce on the buffer ``[B, S, H]``, or the thesis's
      DP all_reduce on ``P`` gradient elements when the role is dp/fsdp;
    * all_gather / reduce_scatter: Table 1's SP all_gather / reduce_scatter on the *full*
      tensor (gather output, scatter input);
    * all_to_all: Table 1's EP all_to_all on the buffer (k folded into it), equal splits;
    * send / recv: Table 1's PP p2p.
    Broadcast and commfuse's rooted reduce have no row (Centauri's substitutes); commfuse's
    boundary ops (``many_to_many_scatter``, ``p2p``) send rank-dependent piece matrices whose
    per-rank volume the IR computes itself (Table 2's boundary rows in costmodel.volume), and
    batched p2p mixes sends and receives: none of these gets a per-collective formula."""

    n, e = c.group_size, _elt(c.dtype)
    if n is None or e is None:
        return None
    kind = c.kind
    full_shape = None
    if kind == "all_gather":
        full_shape = c.output_shapes[0] if len(c.output_shapes) == 1 else None
    elif kind in ("all_reduce", "reduce_scatter", "all_to_all", "send"):
        full_shape = c.input_shapes[0] if len(c.input_shapes) == 1 else None
    elif kind == "recv":
        full_shape = c.output_shapes[0] if len(c.output_shapes) == 1 else None
    if full_shape is None or _numel(full_shape) is None:
        return None
    B, S, H = _bsh(full_shape)
    vals = f"B={B} S={S} H={H} N={n} e={e}"
    if kind == "all_reduce" and c.role in ("dp", "fsdp"):
        P = B * S * H
        name, expr = "thesis DP all_reduce", "2(N-1)/N·P·e"
        wire, logged, vals = (
            V.dp_all_reduce_wire(P, n, elt=e),
            V.dp_all_reduce_logged(P, n, elt=e),
            f"P={P} N={n} e={e}",
        )
    elif kind == "all_reduce":
        name, expr = "Chimera Table 1, TP all_reduce", "2(N-1)/N·B·S·H·e"
        wire, logged = V.tp_all_reduce_wire(B, S, H, n, e), V.tp_all_reduce_logged(B, S, H, n, e)
    elif kind == "all_gather":
        name, expr = "Chimera Table 1, SP all_gather", "(N-1)/N·B·S·H·e"
        wire, logged = V.sp_all_gather_wire(B, S, H, n, e), V.sp_all_gather_logged(B, S, H, n, e)
    elif kind == "reduce_scatter":
        name, expr = "Chimera Table 1, reduce_scatter", "(N-1)/N·B·S·H·e"
        wire, logged = V.reduce_scatter_wire(B, S, H, n, e), V.reduce_scatter_logged(B, S, H, n, e)
    elif kind == "all_to_all":
        name, expr = "Chimera Table 1, EP all_to_all", "(N-1)/N·B·S·H·k·e (k in the buffer)"
        wire, logged = V.ep_all_to_all_wire(B, S, H, n, 1, e), V.ep_all_to_all_logged(B, S, H, n, 1, e)
    elif kind == "send":
        name, expr = "Chimera Table 1, PP p2p", "B·S·H·e"
        wire, logged = V.pp_p2p_wire(B, S, H, e), V.pp_p2p_logged(B, S, H, e)
    elif kind == "recv":
        name, expr = "Chimera Table 1, PP p2p (receiving side sends 0)", "0; logged B·S·H·e"
        wire, logged = 0, V.pp_p2p_logged(B, S, H, e)
    else:
        return None
    wire_i, logged_i = _exact_int(wire), _exact_int(logged)
    if wire_i is None or logged_i is None:
        return None
    iw, il = _int(c.wire_bytes), _int(c.logged_bytes)
    return FormulaCheck(
        name,
        expr,
        vals,
        wire_i,
        logged_i,
        None if iw is None else iw - wire_i,
        None if il is None else il - logged_i,
    )


def _embedded_formula(kind: str, group_size: int, logged: int, wire: int) -> Optional[FormulaCheck]:
    """An op-internal all_to_all (MoE dispatch/combine): Table 1's EP row on its buffer."""

    if kind != "all_to_all" or group_size is None:
        return None
    w = _exact_int(V.ep_all_to_all_wire(1, 1, logged, group_size, 1))
    if w is None:
        return None
    return FormulaCheck(
        "Chimera Table 1, EP all_to_all",
        "(N-1)/N·B·S·H·k·e (k, e in the buffer)",
        f"buffer={logged} B N={group_size}",
        w,
        logged,
        wire - w,
        0,
    )


def _exact_int(x: Any) -> Optional[int]:
    try:
        import sympy

        x = sympy.nsimplify(x)
        if x.is_Integer:
            return int(x)
        if x.is_Rational:  # a ring share that is not a whole byte: truncated as the IR's JSON does
            return int(x)
    except (TypeError, ValueError, AttributeError):
        return None
    return None


# ----------------------------------------------------------------------------- building
def collectives_of(
    analysis: AnalysisReport,
    *,
    graph: str,
    side: str,
    direction: str,
    directions: Optional[dict[str, str]] = None,
) -> list[CollectiveVolume]:
    """Rows for every collective (and op-internal transfer) of one analysis report.

    ``directions``: node name -> forward/backward, when the graph is at hand."""
    rows: list[CollectiveVolume] = []
    for c in analysis.collectives:
        d = (directions or {}).get(c.node, direction)
        rows.append(
            CollectiveVolume(
                graph,
                side,
                d,
                c.node,
                c.kind,
                c.group,
                c.group_size,
                c.role,
                c.dtype,
                _int(c.logged_bytes),
                _int(c.wire_bytes),
                formula=formula_for(c),
            )
        )
    for e in analysis.embedded:
        d = direction
        if direction in ("joint", "graph") and directions is not None:
            d = "backward" if e.backward else "forward"
        rows.append(
            CollectiveVolume(
                graph,
                side,
                d,
                e.node,
                e.kind,
                e.group,
                e.group_size,
                "ep",
                None,
                e.logged_bytes,
                e.wire_bytes,
                embedded=f"{e.op} {e.what}",
                estimated=e.estimated,
                formula=_embedded_formula(e.kind, e.group_size, e.logged_bytes, e.wire_bytes),
            )
        )
    return rows


def _passes_of(graph: str, rep: Optional[PipelineReport]) -> tuple[list[PassReasons], list[str]]:
    if rep is None:
        return [], []
    passes = [
        PassReasons(
            graph, p.name, p.stage, p.changed, dict(p.counts), list(p.refusals), list(p.decisions), p.error
        )
        for p in rep.passes
    ]
    notes = list(rep.notes) + [f"input problem: {x}" for x in rep.input_problems]
    if rep.skipped_reason:
        notes.append(f"skipped: {rep.skipped_reason}")
    return passes, notes


def _has_tangents(gm) -> bool:
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)


def copy_graph_module(gm):
    import torch.fx as fx

    new = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    new.meta = {k: v for k, v in gm.meta.items() if k != REPORTS_META}
    return new


def volume_from_graph(gm, config=None, *, graph_kind: str = "graph", optimize: bool = True) -> VolumeReport:
    """Volume of `gm` as given (before) and after the configured pipeline (on a copy).

    ``graph_kind`` picks the pipeline stages the backend would run on such a graph: "joint"
    (a joint forward+backward graph) the JOINT-stage passes, "forward" / "backward" the
    SCHEDULE-stage passes, "inference" / "graph" both (as ``commfuse.optimize``). A graph
    with tangent inputs has its collectives split into forward/backward directions."""

    cfg = config or Config()
    direction = graph_kind if graph_kind in ("forward", "backward", "inference") else "graph"
    before_gm = copy_graph_module(gm)
    dirs = graph_directions(before_gm) if _has_tangents(before_gm) and direction == "graph" else None
    before = collectives_of(
        analyze(before_gm, cfg, graph=graph_kind),
        graph=graph_kind,
        side="before",
        direction=direction,
        directions=dirs,
    )
    after, passes, notes = None, [], []
    if optimize:
        after_gm = copy_graph_module(gm)
        # The stages the backend runs on such a graph (joint: JOINT; partitioned: SCHEDULE).
        stages = {"joint": {Stage.JOINT}, "forward": {Stage.SCHEDULE}, "backward": {Stage.SCHEDULE}}.get(
            graph_kind, {Stage.JOINT, Stage.SCHEDULE}
        )
        rep = pipeline_for(cfg.model_copy(update={"dump_dir": None})).run(
            after_gm, graph_kind=graph_kind, stages=stages
        )
        passes, notes = _passes_of(graph_kind, rep)
        dirs_after = graph_directions(after_gm) if dirs is not None else None
        after = collectives_of(
            analyze(after_gm, cfg, graph=graph_kind),
            graph=graph_kind,
            side="after",
            direction=direction,
            directions=dirs_after,
        )
    kind = "graph" if graph_kind in ("joint", "graph") else graph_kind
    g = GraphVolume(graph_kind, kind, before, after, passes, notes)
    return VolumeReport(source=f"graph ({graph_kind}, {len(gm.graph.nodes)} nodes)", graphs=[g])


def _read_analysis(path: Path) -> AnalysisReport:
    return read_model_file(AnalysisReport, path, "analysis dump")


def _stage_files(d: Path) -> list[Path]:
    """The graph's dumps in pipeline order: NN_input.json, NN_after_<pass>.json."""
    return sorted(p for p in d.glob("[0-9][0-9]_*.json"))


def graph_dirs(dump_dir: str | Path) -> list[Path]:
    """Graph dump directories (``<kind>_<i>``) of one rank's dump dir, in kind then index order."""
    d = Path(dump_dir)
    found = [p for p in d.iterdir() if p.is_dir() and _DIR_RE.match(p.name)] if d.is_dir() else []
    order = {"dynamo": 0, "joint": 1, "inference": 2, "graph": 3, "forward": 4, "backward": 5}
    return sorted(found, key=lambda p: (order.get(_DIR_RE.match(p.name)["kind"], 9), p.name))


def rank_dirs(dump_dir: str | Path) -> dict[int, Path]:
    """``rank<r>/`` sub-directories of a dump dir (one per rank), if the run wrote them."""
    d = Path(dump_dir)
    out = {}
    if d.is_dir():
        for p in d.iterdir():
            m = re.fullmatch(r"rank(\d+)", p.name)
            if p.is_dir() and m:
                out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def resolve_rank_dir(dump_dir: str | Path, rank: Optional[int] = None) -> Path:
    """`dump_dir` itself, or its ``rank<r>`` sub-directory (rank 0 unless given) when it has those."""
    ranks = rank_dirs(dump_dir)
    if not ranks:
        if rank not in (None, 0) and not graph_dirs(dump_dir):
            raise ValueError(f"dump dir {str(dump_dir)!r} has no rank{rank} sub-directory")
        return Path(dump_dir)
    r = 0 if rank is None else rank
    if r not in ranks:
        raise ValueError(f"dump dir {str(dump_dir)!r}: no rank{r} sub-directory (have {sorted(ranks)})")
    return ranks[r]


def _graph_from_dir(d: Path) -> GraphVolume:
    kind = _DIR_RE.match(d.name)["kind"]
    rep = None
    if (d / "pipeline.json").exists():
        rep = read_model_file(PipelineReport, d / "pipeline.json", "pipeline report")
    stages = _stage_files(d)
    before_a = _read_analysis(stages[0]) if stages and stages[0].name.endswith("_input.json") else None
    after_a = (
        rep.analysis
        if rep is not None and rep.analysis is not None
        else (_read_analysis(stages[-1]) if stages else None)
    )
    direction = (
        kind if kind in ("forward", "backward", "inference") else ("joint" if kind == "joint" else "graph")
    )
    before = (
        None
        if before_a is None
        else collectives_of(before_a, graph=d.name, side="before", direction=direction)
    )
    after = (
        None if after_a is None else collectives_of(after_a, graph=d.name, side="after", direction=direction)
    )
    passes, notes = _passes_of(d.name, rep)
    return GraphVolume(d.name, kind, before, after, passes, notes, dump_dir=str(d))


def volume_from_dump_dir(dump_dir: str | Path, *, rank: Optional[int] = None) -> VolumeReport:
    """Volume of everything one rank dumped (``rank``: which ``rank<r>/`` sub-directory, default 0)."""
    d = resolve_rank_dir(dump_dir, rank)
    dirs = graph_dirs(d)
    if not dirs:
        raise ValueError(
            f"dump dir {str(dump_dir)!r} holds no graph dumps (<kind>_<index>/ directories); "
            "set Config(dump_dir=...) or COMMFUSE_DUMP_DIR when compiling"
        )
    rep = VolumeReport(source=f"dump dir {d}", graphs=[_graph_from_dir(p) for p in dirs])
    if any(g.kind == "joint" for g in rep.graphs):
        rep.notes.append(
            "before = joint graph as traced (its forward/backward split is not in the dumps: "
            "direction 'joint'); after = forward + backward graphs as lowered"
        )
    rewritten = [
        f"{g.name}: {p.name}" for g in rep.graphs if g.kind == "dynamo" for p in g.passes if p.changed
    ]
    if rewritten:
        rep.notes.append(
            "the program was rewritten before AOTAutograd traced it ("
            + ", ".join(rewritten)
            + "): 'before' is the traced graph after that rewrite, not the program as written"
        )
    return rep


def volume_from_reports(reports: Sequence[PipelineReport], *, source: str = "compiled model") -> VolumeReport:
    """Volume from a compiled model's ``backend.reports`` (or ``TrainStep.reports``).

    "after" is each report's analysis; "before" comes from the graph's input dump when the
    pipeline dumped (``Config(dump_dir=...)``), else it is missing (noted)."""
    counters: dict[str, int] = defaultdict(int)
    graphs = []
    missing = False
    for rep in reports:
        if rep.graph == "dynamo":
            continue
        name = Path(rep.dump_dir).name if rep.dump_dir else f"{rep.graph}_{counters[rep.graph]:03d}"
        counters[rep.graph] += 1
        kind = rep.graph
        direction = (
            kind
            if kind in ("forward", "backward", "inference")
            else ("joint" if kind == "joint" else "graph")
        )
        before = None
        if rep.dump_dir:
            stages = _stage_files(Path(rep.dump_dir))
            if stages and stages[0].name.endswith("_input.json"):
                before = collectives_of(
                    _read_analysis(stages[0]), graph=name, side="before", direction=direction
                )
        if before is None and kind in _BEFORE_KINDS:
            missing = True
        after = (
            None
            if rep.analysis is None
            else collectives_of(rep.analysis, graph=name, side="after", direction=direction)
        )
        passes, notes = _passes_of(name, rep)
        graphs.append(GraphVolume(name, kind, before, after, passes, notes, dump_dir=rep.dump_dir))
    out = VolumeReport(source=source, graphs=graphs)
    if missing:
        out.notes.append("'before' needs the input dumps: compile with Config(dump_dir=...) to get it")
    return out


def volume_report(obj: Any, config=None, **kw: Any) -> VolumeReport:
    """Dispatch: a GraphModule, a backend / TrainStep (``.reports``), a list of reports or a dump dir."""
    import torch.fx as fx

    if isinstance(obj, fx.GraphModule):
        return volume_from_graph(obj, config, **kw)
    if isinstance(obj, (str, Path)):
        return volume_from_dump_dir(obj, **kw)
    if hasattr(obj, "reports"):
        return volume_from_reports(obj.reports, source=type(obj).__name__)
    if isinstance(obj, (list, tuple)):
        return volume_from_reports(list(obj))
    raise TypeError(
        f"volume_report: expected a GraphModule, a backend/TrainStep, reports or a dump dir, "
        f"got {type(obj).__name__}"
    )
