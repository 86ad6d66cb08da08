"""Run an ordered list of passes with verification, instrumentation and fallback.

For every pass of the requested stage(s), in order (:meth:`Pipeline.run`):
1. snapshot the graph;
2. run the pass as a step (:func:`run_step`): if it changed the graph, recompile, drop the
   analyses it does not preserve, verify (when ``config.verify``);
3. if the pass raised or the verifier rejected its output: with ``config.strict``
   re-raise, otherwise restore the snapshot, warn naming the pass and the reason, and go
   on with the next pass.

A pipeline of passes is itself a pass (:class:`PassPipeline`): Chimera is one, its steps
run by the same :func:`run_step`. What happens around the passes -- graph dumps before and
after each changing pass, per-pass timing, handing the report to whoever compiles -- is
instrumentation (:class:`Instrumentation`), not code in the passes or in this loop. Two
instruments feed PyTorch's own tools: :class:`StructuredTrace` (graphs and decisions as
``torch._logging`` structured-trace artifacts under ``TORCH_TRACE``, read by tlparse) and
:class:`PassLog` (one summary line per pass on the ``commfuse`` logger, ``TORCH_LOGS=commfuse``).
Each is added only when its output is wanted, so neither costs anything otherwise.

Only failures that are deterministic in the graph reach step 3 (passes decide from graph,
config, topology and session, the same on every rank), so every rank falls back the same
way. Rank-local failures (dump I/O) are handled inside the dump writer and never change
the graph. If the *input* graph fails verification, no pass runs: a graph commfuse cannot
reason about is left exactly as it was.
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Optional, Sequence, Type

import torch.fx as fx

from commfuse.core.dump_layout import rank_dump_dir
from commfuse.core.errors import PassError, VerificationError
from commfuse.core.meta import REPORTS_META
from commfuse.core.ranks import process_rank, process_world_size, warn_rank0
from commfuse.core.torch_private import (
    copy_graph,
    reset_graph_namespace,
    structured_trace_enabled,
    trace_artifact,
)
from commfuse.costmodel.analytic import AnalyticCostModel
from commfuse.costmodel.topology import Topology
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.ir.shapes import size_to_json
from commfuse.passmgr.base import GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext, SessionState
from commfuse.passmgr.dumps import DumpWriter
from commfuse.passmgr.gate import judge
from commfuse.passmgr.instrument import Instrumentation
from commfuse.passmgr.report_facts import ReportFacts
from commfuse.passmgr.report import PassRecord, PipelineReport, build_analysis_report
from commfuse.passmgr.verifier import verify_graph

if TYPE_CHECKING:
    from commfuse.config import Config

log = logging.getLogger(__name__)


def snapshot_graph(graph: fx.Graph) -> fx.Graph:
    return copy_graph(graph)


def restore_graph(graph: fx.Graph, snapshot: fx.Graph) -> None:
    """Make `graph` (same object: callers such as Inductor hold it) equal to `snapshot` again."""
    for node in reversed(list(graph.nodes)):
        node.users.clear()
        graph.erase_node(node)
    reset_graph_namespace(graph)
    val_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(snapshot, val_map)
    graph.output(out)


def run_step(
    p: GraphPass,
    ctx: PassContext,
    *,
    where: Optional[str] = None,
    snapshot: Optional[fx.Graph] = None,
    judged: bool = True,
) -> PassResult:
    """Run ``p`` as one step of a pipeline: a change is recompiled, the analyses ``p`` does not
    preserve are dropped, and the graph is verified (``Config.verify``; raises
    :class:`VerificationError` naming ``where``, default the pass). Then the step-time gate
    (:mod:`commfuse.passmgr.gate`) judges a gated pass's change and restores the graph as it was
    when the change is predicted slower. ``snapshot``: a copy of the graph as it was before ``p``
    when the caller already holds one (otherwise one is taken when the gate needs it).
    ``judged=False``: the caller judges the change (a nested pipeline judges its sequence)."""
    gated = judged and p.gated and ctx.config.gates_by_step_time
    if gated and snapshot is None:
        snapshot = snapshot_graph(ctx.gm.graph)
    result = p.run(ctx)
    if result.changed:
        ctx.gm.recompile()
        ctx.invalidate(p.preserves)
        if ctx.config.verify:
            v = verify_graph(ctx.gm, ir=ctx.ir, deep=ctx.config.debug)
            if not v.ok:
                raise VerificationError(v.problems, after_pass=where or p.name)
        if gated:
            assert snapshot is not None  # taken above when gated
            before = fx.GraphModule(ctx.gm, snapshot)
            verdict = judge(ctx, before, CollectiveIR(before, ctx.ir_options))
            result.decisions = [*result.decisions, verdict.decision()]
            if not verdict.kept:
                restore_graph(ctx.gm.graph, snapshot)
                ctx.gm.recompile()
                ctx.invalidate()
                return PassResult(
                    False,
                    counts={**result.counts, "reverted_by_gate": 1},
                    refusals=[*result.refusals, verdict.refusal()],
                    decisions=result.decisions,
                )
    return result


class PassPipeline(GraphPass):
    """A fixed sequence of passes run as one pass (a nested pipeline).

    Each step runs through :func:`run_step` (recompile, invalidate, verify between steps); the
    result reports every step's counts prefixed with the step's name (``step.count``) and every
    refusal prefixed with it (``step: why``). Subclasses set ``name``, ``stage`` and ``steps``.
    """

    # The step-time gate judges the sequence, not each step: a step may only prepare the next
    # (Chimera's all_reduce split costs a latency that motion and fusion then pay back).
    steps: ClassVar[tuple[Type[GraphPass], ...]] = ()

    def run_steps(self, ctx: PassContext) -> list[tuple[str, PassResult]]:
        out = []
        for cls in self.steps:
            step = cls()
            out.append((step.name, run_step(step, ctx, where=f"{self.name}/{step.name}", judged=False)))
        return out

    @staticmethod
    def combine(results: Sequence[tuple[str, PassResult]]) -> PassResult:
        counts: dict[str, int] = {}
        refusals: list[str] = []
        decisions: list[dict] = []
        for name, r in results:
            counts.update({f"{name}.{k}": v for k, v in r.counts.items()})
            refusals.extend(f"{name}: {why}" for why in r.refusals)
            decisions.extend({"step": name, **d} for d in r.decisions)
        return PassResult(
            any(r.changed for _, r in results), counts=counts, refusals=refusals, decisions=decisions
        )

    def run(self, ctx: PassContext) -> PassResult:
        return self.combine(self.run_steps(ctx))


class PassTimer(Instrumentation):
    """Wall time of every pass into its record (``seconds``)."""

    def __init__(self) -> None:
        self._t0 = 0.0

    def before_pass(self, p: GraphPass, record: PassRecord) -> None:
        self._t0 = time.perf_counter()

    def after_pass(self, p: GraphPass, record: PassRecord, gm: fx.GraphModule, ctx: PassContext) -> None:
        record.seconds = time.perf_counter() - self._t0


class GraphDumps(Instrumentation):
    """The graph before the first pass and after every changing pass (code, analysis JSON,
    picture), and the pipeline report, under ``dump_dir/rank<r>/<graph kind>_<index>/``
    (``rank``: this process's, None without a process group; see ``core/dump_layout.py``),
    then the index at ``dump_dir/index.json``.

    ``only_if_changed``: write nothing unless a pass changes the graph (the input is then
    written from a copy taken before the first pass)."""

    def __init__(
        self,
        dump_dir: str,
        graph_kind: str,
        *,
        svg_max_nodes: int,
        only_if_changed: bool = False,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ) -> None:
        self.rank = 0 if rank is None else rank
        self.top, mine = rank_dump_dir(dump_dir, self.rank)
        self.world_size = world_size
        self.writer = DumpWriter(str(mine), graph_kind, svg_max_nodes=svg_max_nodes)
        self.only_if_changed = only_if_changed
        self._deferred_input: Optional[fx.GraphModule] = None

    def before_pipeline(self, gm: fx.GraphModule, ctx: PassContext, report: PipelineReport) -> None:
        report.dump_dir = str(self.writer.dir)
        if self.only_if_changed:
            self._deferred_input = fx.GraphModule(gm, snapshot_graph(gm.graph))
        else:
            self.writer.write_graph("input", gm, ctx.ir)

    def after_pass(self, p: GraphPass, record: PassRecord, gm: fx.GraphModule, ctx: PassContext) -> None:
        if not record.changed:
            return
        if self._deferred_input is not None:
            self.writer.write_graph(
                "input", self._deferred_input, CollectiveIR(self._deferred_input, ctx.ir_options)
            )
            self._deferred_input = None
        self.writer.write_graph(f"after_{p.name}", gm, ctx.ir)

    def after_pipeline(self, gm: fx.GraphModule, ctx: PassContext, report: PipelineReport) -> None:
        if self._deferred_input is not None:
            report.dump_dir = None  # unchanged: nothing dumped
        else:
            self.writer.write_text("pipeline.json", report.model_dump_json(indent=2))
            self.writer.update_index(self.top, self.rank, self.world_size)


def graph_text(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False)


class StructuredTrace(Instrumentation):
    """The pipeline in torch's structured trace (``TORCH_TRACE=dir``; tlparse lists the artifacts
    beside Dynamo's, AOTAutograd's and Inductor's, under the compile they belong to):

    * ``commfuse_<kind>_input`` (string): the graph before the first pass;
    * ``commfuse_<kind>_after_<pass>`` (string): the graph after every pass that changed it;
    * ``commfuse_<kind>_pass_<pass>`` (json): every pass that ran, changed or not -- its counts,
      refusals (why it left something alone), decisions, error, seconds;
    * ``commfuse_<kind>_report`` (json): the pipeline report (collectives before/after, hashes).

    ``only_if_changed``: as for the dumps, the graph before the passes is emitted only once a
    pass changes it (the Dynamo graph, which torch's trace already holds)."""

    def __init__(self, graph_kind: str, *, only_if_changed: bool = False) -> None:
        self.prefix = f"commfuse_{graph_kind}"
        self.only_if_changed = only_if_changed
        self._input: Optional[str] = None

    def before_pipeline(self, gm: fx.GraphModule, ctx: PassContext, report: PipelineReport) -> None:
        if self.only_if_changed:
            self._input = graph_text(gm)  # the passes rewrite gm in place
        else:
            trace_artifact(f"{self.prefix}_input", "string", lambda: graph_text(gm))

    def after_pass(self, p: GraphPass, record: PassRecord, gm: fx.GraphModule, ctx: PassContext) -> None:
        if record.changed and self._input is not None:
            text, self._input = self._input, None
            trace_artifact(f"{self.prefix}_input", "string", lambda: text)
        trace_artifact(f"{self.prefix}_pass_{p.name}", "json", lambda: record.model_dump_json(indent=1))
        if record.changed:
            trace_artifact(f"{self.prefix}_after_{p.name}", "string", lambda: graph_text(gm))

    def after_pipeline(self, gm: fx.GraphModule, ctx: PassContext, report: PipelineReport) -> None:
        if self.only_if_changed and not report.changed:
            return
        trace_artifact(f"{self.prefix}_report", "json", lambda: report.model_dump_json(indent=1))


def pass_summary(record: PassRecord) -> str:
    """One line: what a pass did to a graph, or why it did nothing."""
    if record.error is not None:
        return f"{record.name}: failed, graph restored: {record.error}"
    counts = ", ".join(f"{k}={v}" for k, v in record.counts.items() if v)
    what = "changed" if record.changed else "unchanged"
    line = (
        f"{record.name}: {what}" + (f" ({counts})" if counts else "") + f" in {record.seconds * 1e3:.1f} ms"
    )
    if record.refusals:
        line += f"; {len(record.refusals)} refusal(s), first: {record.refusals[0]}"
    return line


class PassLog(Instrumentation):
    """Pass summaries on this module's logger (a child of ``commfuse``: ``TORCH_LOGS=commfuse``):
    at INFO one line per pass and one per graph (collectives per kind before and after), at DEBUG
    (``TORCH_LOGS=+commfuse``) also every refusal and decision."""

    def __init__(self, graph_kind: str) -> None:
        self.graph_kind = graph_kind

    def after_pass(self, p: GraphPass, record: PassRecord, gm: fx.GraphModule, ctx: PassContext) -> None:
        log.info("commfuse: %s graph: %s", self.graph_kind, pass_summary(record))
        if log.isEnabledFor(logging.DEBUG):
            for why in record.refusals:
                log.debug("commfuse: %s graph: %s refused: %s", self.graph_kind, p.name, why)
            for d in record.decisions:
                log.debug(
                    "commfuse: %s graph: %s decided: %s", self.graph_kind, p.name, json.dumps(d, default=str)
                )

    def after_pipeline(self, gm: fx.GraphModule, ctx: PassContext, report: PipelineReport) -> None:
        changed = [p.name for p in report.passes if p.changed]
        log.info(
            "commfuse: %s graph: %d pass(es) ran, %s; collectives %s -> %s%s",
            self.graph_kind,
            len(report.passes),
            f"changed by {', '.join(changed)}" if changed else "unchanged",
            report.input_kinds or "{}",
            report.output_kinds or "{}",
            f" ({report.skipped_reason})" if report.skipped_reason else "",
        )


class ReportTo(Instrumentation):
    """Hand every finished report to ``callback`` (the backend collects them per compile)."""

    def __init__(self, callback: Callable[[PipelineReport], None]) -> None:
        self.callback = callback

    def after_pipeline(self, gm: fx.GraphModule, ctx: PassContext, report: PipelineReport) -> None:
        self.callback(report)


class Pipeline:
    """The passes ``passes`` (instances, in order) with what they decide from: ``config``,
    ``topology`` (``topology_source`` says where it came from, for reports), the groups'
    roles, the ``session`` (``commfuse.setup``'s sub-groups and communicator pool), and
    ``cost_model``, a calibrated model to price with instead of the topology's nominal one
    (``cost_label`` names it in reports), and this process's ``rank``.
    ``instruments`` run on every graph, after the pipeline's own (timing, and dumps when
    the config asks for them)."""

    def __init__(
        self,
        passes: Sequence[GraphPass],
        config: "Config",
        *,
        topology: Optional[Topology] = None,
        group_roles: Optional[dict[str, str]] = None,
        role_sources: Optional[dict[str, str]] = None,
        session: Optional[SessionState] = None,
        topology_source: Optional[str] = None,
        cost_model: Optional[AnalyticCostModel] = None,
        cost_label: Optional[str] = None,
        rank: Optional[int] = None,
        instruments: Sequence[Instrumentation] = (),
        partitions: Sequence[Sequence[Sequence[int]]] = (),
    ) -> None:
        self.config = config
        self.topology = topology
        self.group_roles = group_roles or {}
        self.role_sources = role_sources or {}
        self.session = session
        self.cost_model = cost_model
        self.cost_label = cost_label
        self.rank = rank
        self.partitions = [list(part) for part in partitions]
        self.passes = list(passes)
        self.instruments = list(instruments)
        # where the topology came from ("config", "setup", "detected"): reports name it
        self.topology_source: Optional[str] = topology_source or ("given" if topology is not None else None)
        # graphs run with more_stages=True: their report, continued by the next run on them (see `run`)
        self._open: "weakref.WeakKeyDictionary[fx.GraphModule, _OpenRun]" = weakref.WeakKeyDictionary()

    def _instruments(self, graph_kind: str, dump_if_changed: bool) -> list[Instrumentation]:
        out: list[Instrumentation] = [PassTimer()]
        dump_dir = self.config.resolved_dump_dir()
        if dump_dir:
            # every rank gets the same dump dir: each writes under its own rank<r>/
            rank = self.rank if self.rank is not None else process_rank()
            out.append(
                GraphDumps(
                    dump_dir,
                    graph_kind,
                    svg_max_nodes=self.config.svg_max_nodes,
                    only_if_changed=dump_if_changed,
                    rank=rank,
                    world_size=process_world_size(),
                )
            )
            # what `commfuse report` reads beside the dumps: predicted timelines, group and layer names
            out.append(ReportFacts(graph_kind))
        # after the timer: the pass records they emit carry their seconds
        if structured_trace_enabled():
            out.append(StructuredTrace(graph_kind, only_if_changed=dump_if_changed))
        if log.isEnabledFor(logging.INFO):
            out.append(PassLog(graph_kind))
        return out + self.instruments

    def run(
        self,
        gm: fx.GraphModule,
        *,
        graph_kind: str,
        stages: Iterable[Stage],
        dump_if_changed: bool = False,
        more_stages: bool = False,
        notes: Sequence[str] = (),
    ) -> PipelineReport:
        """Run the passes of ``stages`` on ``gm``; returns the graph's report.

        ``dump_if_changed``: dump this graph only when a pass changes it (the Dynamo graph
        every compile sees before AOTAutograd, which recognition rarely changes). ``notes``:
        what the caller did to the graph before the passes, for the report.

        One graph, one report: ``more_stages=True`` says that other stages will run on this
        very ``gm`` later (Inductor runs the JOINT passes of an inference graph in its
        joint-graph hook and the SCHEDULE passes when it compiles it). The next run of this
        pipeline on ``gm`` under the same ``graph_kind`` then continues this report and its
        instruments (dumps go on in the same directory) instead of starting a new one, and
        instruments' ``after_pipeline`` sees the same report again."""
        stages = set(stages)
        cfg = self.config
        ctx = PassContext(
            gm,
            cfg,
            graph_kind=graph_kind,
            topology=self.topology,
            group_roles=self.group_roles,
            role_sources=self.role_sources,
            session=self.session,
            cost_model=self.cost_model,
            rank=self.rank,
            partitions=self.partitions,
        )
        earlier = self._open.pop(gm, None)
        if earlier is not None and earlier.report.graph != graph_kind:
            earlier = None
        if earlier is None:
            instruments = self._instruments(graph_kind, dump_if_changed)
            report = PipelineReport(
                graph=graph_kind,
                topology=_describe_topology(self.topology, self.topology_source, self.cost_label),
            )
            _describe_input(ctx, report)
        else:
            instruments, report = earlier.instruments, earlier.report
        if more_stages:
            # the value holds the instruments, which may hold gm: the entry goes when the next run takes it
            self._open[gm] = _OpenRun(report, instruments)
        report.notes.extend(notes)
        selected = [p for p in self.passes if p.stage in stages]
        pre = verify_graph(gm, ir=ctx.ir, check_meta=False) if cfg.verify else None
        if earlier is None:
            for ins in instruments:
                ins.before_pipeline(gm, ctx, report)
        if pre is not None and not pre.ok:
            report.input_problems = [*report.input_problems, *pre.problems]
            if selected:
                report.skipped_reason = "input graph failed verification; no pass was run"
                warn_rank0(
                    f"commfuse: {graph_kind} graph left unchanged: input graph failed verification: "
                    f"{pre.problems[0]}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            selected = []

        # The graph as it was before the current pass, to restore if the pass fails. A pass that
        # reports no change left the graph as it was (the pipeline trusts that report: it neither
        # recompiles nor verifies then), so its snapshot serves the next pass too; copying a large
        # graph before every pass was a good part of a compile.
        snapshot: Optional[fx.Graph] = None
        for p in selected:
            record = PassRecord(name=p.name, stage=p.stage.value)
            report.passes.append(record)
            if snapshot is None:
                snapshot = snapshot_graph(gm.graph)
            restore_to = snapshot  # the graph before this pass, whatever the pass does to `snapshot`
            for ins in instruments:
                ins.before_pass(p, record)
            try:
                result = run_step(p, ctx, snapshot=snapshot)
                record.changed, record.counts, record.refusals = (
                    result.changed,
                    result.counts,
                    result.refusals,
                )
                record.decisions = result.decisions
                if result.changed:
                    snapshot = None
            except Exception as e:  # noqa: BLE001 - any pass failure falls back (or re-raises when strict)
                record.changed, record.error = False, f"{type(e).__name__}: {e}"
                if not cfg.strict:
                    restore_graph(gm.graph, restore_to)
                    gm.recompile()
                    ctx.invalidate()
                for ins in instruments:
                    ins.after_pass(p, record, gm, ctx)
                if cfg.strict:
                    if isinstance(e, VerificationError):
                        raise
                    raise PassError(p.name, e) from e
                # every rank runs the same pass on the same graph and fails alike: one copy
                warn_rank0(
                    f"commfuse: pass '{p.name}' failed on the {graph_kind} graph and was skipped "
                    f"(graph restored): {record.error}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                log.debug("pass %s failed", p.name, exc_info=True)
                continue
            for ins in instruments:
                ins.after_pass(p, record, gm, ctx)

        report.analysis = build_analysis_report(ctx.ir, graph=graph_kind)
        report.sequence_hashes = report.analysis.sequence_hashes
        report.order_hash = report.analysis.order_hash
        if earlier is None:
            gm.meta.setdefault(REPORTS_META, []).append(report)
        for ins in instruments:
            ins.after_pipeline(gm, ctx, report)
        return report


@dataclass
class _OpenRun:
    """The report and instruments of a graph that more stages will run on."""

    report: PipelineReport
    instruments: list[Instrumentation]


def _describe_input(ctx: PassContext, report: PipelineReport) -> None:
    """Collectives per kind and wire bytes of the graph before any pass; what is not analysed."""
    wire: Any = 0
    for c in ctx.ir.collectives:
        report.input_kinds[c.kind.value] = report.input_kinds.get(c.kind.value, 0) + 1
        wire = wire + (c.wire_bytes or 0)
    for e in ctx.ir.embedded:  # collectives ops issue from their kernels, as the analysis counts them
        for t in e.transfers:
            wire = wire + (t.wire_bytes or 0)
    report.input_wire_bytes = size_to_json(wire)
    if ctx.ir.hidden_collectives:
        hidden = ", ".join(f"{n.name}: {k}" for n, k in ctx.ir.hidden_collectives.items())
        report.notes.append(
            f"collectives inside control flow / higher-order ops ({hidden}) are not analysed; "
            "passes treat those nodes as opaque"
        )


def _describe_topology(
    topology: Optional[Topology], source: Optional[str], cost_label: Optional[str] = None
) -> str:
    if cost_label is not None:
        return f"{_describe_topology(topology, source)}; priced with {cost_label}"
    if topology is None:
        return (
            "none (cost-model passes refuse; give Config.topology or setup(topology=), or run under torchrun)"
        )
    where = {
        "config": "Config.topology",
        "setup": "commfuse.setup",
        "given": "given",
        "detected": "detected from the torchrun environment",
        "cost_profile": "Config.cost_profile",
    }.get(source or "given", source)
    return (
        f"{topology.name}: {topology.num_nodes} node(s) x {topology.ranks_per_node} ranks, "
        f"device {topology.device} ({where})"
    )


__all__ = [
    "GraphDumps",
    "Instrumentation",
    "PassLog",
    "PassPipeline",
    "PassTimer",
    "Pipeline",
    "ReportTo",
    "StructuredTrace",
    "pass_summary",
    "restore_graph",
    "run_step",
    "snapshot_graph",
]
