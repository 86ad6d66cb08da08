"""JSON-serialisable reports: what the IR saw (`analyze`) and what the pipeline did."""

from __future__ import annotations

from collections import defaultdict
from typing import Optional, Union

from pydantic import BaseModel, Field

from commfuse.ir.graph_ir import CollectiveIR
from commfuse.ir.shapes import size_to_json

JsonSize = Union[int, str, None]


class CollectiveReport(BaseModel):
    index: int
    node: str
    kind: str
    group: str
    group_size: Optional[int]
    group_ranks: Optional[list[int]]
    reduce_op: Optional[str]
    dtype: Optional[str]
    input_shapes: list[Optional[list[JsonSize]]]
    output_shapes: list[Optional[list[JsonSize]]]
    logged_bytes: JsonSize
    wire_bytes: JsonSize
    logical_dim: Optional[int]
    logical_concat_dim: Optional[int]
    logical_input: Optional[str]
    logical_output: Optional[str]
    waits: list[str]
    role: str
    role_source: str
    # commfuse's boundary ops (m2ms, stage_transfer; ops/boundary/ir_view.py): bytes this rank receives
    # (logged/wire bytes are what it sends) and the transfers in words
    received_bytes: JsonSize = None
    transfers: Optional[str] = None


class EmbeddedReport(BaseModel):
    """A collective issued from inside an op's kernel (see commfuse.ir.embedded)."""

    node: str
    op: str
    kind: str
    group: str
    group_size: int
    what: str
    logged_bytes: int
    wire_bytes: int
    estimated: bool
    backward: bool


class Totals(BaseModel):
    count: int = 0
    logged_bytes: JsonSize = 0
    wire_bytes: JsonSize = 0


class AnalysisReport(BaseModel):
    """Every collective of one graph with its fields, and totals per kind and per group."""

    graph: str = "graph"
    num_nodes: int
    collectives: list[CollectiveReport]
    by_kind: dict[str, Totals]
    by_group: dict[str, Totals]
    total: Totals
    sequence_hashes: dict[str, str]
    order_hash: str
    # control-flow / higher-order nodes whose subgraphs hold collectives commfuse cannot analyse
    hidden_collectives: dict[str, int] = Field(default_factory=dict)
    # collectives ops issue from their kernels (counted in by_kind/by_group/total too)
    embedded: list[EmbeddedReport] = Field(default_factory=list)

    def to_json(self, **kw) -> str:
        return self.model_dump_json(indent=2, **kw)

    def table(self) -> str:
        """A fixed-width text table, one line per collective kind."""
        w = max([16, *(len(k) + 2 for k in self.by_kind)])  # "many_to_many_scatter" is 20 long
        lines = [f"{'kind':<{w}}{'count':>6}{'logged B/rank':>16}{'wire B/rank':>16}"]
        for k, t in sorted(self.by_kind.items()):
            lines.append(f"{k:<{w}}{t.count:>6}{str(t.logged_bytes):>16}{str(t.wire_bytes):>16}")
        t = self.total
        lines.append(f"{'total':<{w}}{t.count:>6}{str(t.logged_bytes):>16}{str(t.wire_bytes):>16}")
        return "\n".join(lines)


def _shape(s) -> Optional[list[JsonSize]]:
    return None if s is None else [size_to_json(x) for x in s]


def _add(a, b):
    if a is None or b is None:
        return None
    return a + b


def build_analysis_report(ir: CollectiveIR, *, graph: str = "graph") -> AnalysisReport:
    rows: list[CollectiveReport] = []
    sums: dict[str, dict[str, list]] = {
        "kind": defaultdict(lambda: [0, 0, 0]),
        "group": defaultdict(lambda: [0, 0, 0]),
    }
    total = [0, 0, 0]

    def count(kind: str, group: str, logged, wire) -> None:
        for acc in (sums["kind"][kind], sums["group"][group], total):
            acc[0] += 1
            acc[1] = _add(acc[1], logged)
            acc[2] = _add(acc[2], wire)

    for c in ir.collectives:
        rows.append(
            CollectiveReport(
                index=c.index,
                node=c.name,
                kind=c.kind.value,
                group=c.group.name,
                group_size=c.group.size,
                group_ranks=list(c.group.ranks) if c.group.ranks is not None else None,
                reduce_op=c.reduce_op,
                dtype=str(c.dtype).replace("torch.", "") if c.dtype is not None else None,
                input_shapes=[_shape(s) for s in c.input_shapes],
                output_shapes=[_shape(s) for s in c.output_shapes],
                logged_bytes=size_to_json(c.logged_bytes),
                wire_bytes=size_to_json(c.wire_bytes),
                logical_dim=c.logical_dim,
                logical_concat_dim=c.logical_concat_dim,
                logical_input=c.logical_input.name if c.logical_input is not None else None,
                logical_output=c.logical_output.name if c.logical_output is not None else None,
                waits=[w.name for w in c.waits],
                role=c.role.value,
                role_source=c.role_source,
                received_bytes=size_to_json(c.extra.get("received_bytes")),
                transfers=c.extra["boundary"].describe() if "boundary" in c.extra else None,
            )
        )
        count(c.kind.value, c.group.name, c.logged_bytes, c.wire_bytes)

    embedded = []
    for e in ir.embedded:
        for t in e.transfers:
            embedded.append(
                EmbeddedReport(
                    node=e.node.name,
                    op=str(e.node.target),
                    kind=t.kind.value,
                    group=t.group,
                    group_size=t.group_size,
                    what=t.what,
                    logged_bytes=t.logged_bytes,
                    wire_bytes=t.wire_bytes,
                    estimated=t.estimated,
                    backward=e.node in ir.backward_nodes,
                )
            )
            count(t.kind.value, t.group, t.logged_bytes, t.wire_bytes)

    def totals(acc) -> Totals:
        return Totals(count=acc[0], logged_bytes=size_to_json(acc[1]), wire_bytes=size_to_json(acc[2]))

    return AnalysisReport(
        graph=graph,
        num_nodes=len(ir.gm.graph.nodes),
        collectives=rows,
        by_kind={k: totals(v) for k, v in sorted(sums["kind"].items())},
        by_group={k: totals(v) for k, v in sorted(sums["group"].items())},
        total=totals(total),
        sequence_hashes=ir.sequence_hashes(),
        order_hash=ir.order_hash(),
        hidden_collectives={n.name: k for n, k in ir.hidden_collectives.items()},
        embedded=embedded,
    )


class PassRecord(BaseModel):
    name: str
    stage: str
    changed: bool = False
    counts: dict[str, int] = Field(default_factory=dict)
    refusals: list[str] = Field(default_factory=list)
    decisions: list[dict] = Field(default_factory=list)
    error: Optional[str] = None  # set when the pass failed and the graph was restored
    seconds: float = 0.0


class PipelineReport(BaseModel):
    graph: str
    passes: list[PassRecord] = Field(default_factory=list)
    input_problems: list[str] = Field(default_factory=list)  # verifier findings on the input graph
    notes: list[str] = Field(default_factory=list)  # what the pipeline saw but could not act on
    skipped_reason: Optional[str] = None
    sequence_hashes: dict[str, str] = Field(default_factory=dict)
    order_hash: str = ""
    dump_dir: Optional[str] = None
    analysis: Optional[AnalysisReport] = None  # the graph after the pipeline
    input_kinds: dict[str, int] = Field(default_factory=dict)  # collectives per kind before the pipeline
    # wire bytes per rank of the graph's collectives before the pipeline (int, or a symbolic size)
    input_wire_bytes: Optional[Union[int, str]] = None
    topology: Optional[str] = None  # the topology the passes used, and where it came from

    @property
    def changed(self) -> bool:
        return any(p.changed for p in self.passes)

    @property
    def output_wire_bytes(self) -> Optional[Union[int, str]]:
        """Wire bytes per rank of the graph's collectives after the pipeline (as ``input_wire_bytes``)."""
        return self.analysis.total.wire_bytes if self.analysis is not None else None

    @property
    def output_kinds(self) -> dict[str, int]:
        """Collectives per kind after the pipeline."""
        out: dict[str, int] = {}
        for c in self.analysis.collectives if self.analysis is not None else []:
            out[c.kind] = out.get(c.kind, 0) + 1
        return out
