"""Run an ordered list of passes with verification, dumps and fallback.

For every pass of the requested stage(s), in order:
1. snapshot the graph;
2. run the pass; if it changed the graph: recompile, drop cached analyses,
   verify (when `config.verify`), dump the new graph;
3. if the pass raised or the verifier rejected its output: with `config.strict`
   re-raise, otherwise restore the snapshot, warn naming the pass and the reason,
   and go on with the next pass.

Only failures that are deterministic in the graph reach step 3 (passes decide
from graph, config and topology), so every rank falls back the same way.
Rank-local failures (dump I/O) are handled inside the dump writer and never
change the graph. If the *input* graph fails verification, no pass runs: a
graph commfuse cannot reason about is left exactly as it was.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Callable, Iterable, Optional

import torch.fx as fx

from commfuse._torch_private import copy_graph, reset_graph_namespace
from commfuse.config import Config
from commfuse.costmodel.topology import Topology
from commfuse.dumps import DumpWriter
from commfuse.errors import PassError, VerificationError
from commfuse.ir.shapes import size_to_json
from commfuse.report import PassRecord, PipelineReport, build_analysis_report
from commfuse.passes.base import Stage
from commfuse.passes.context import PassContext
from commfuse.passes.registry import get_pass
from commfuse.passes.verifier import verify_graph

log = logging.getLogger("commfuse")


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


class Pipeline:
    def __init__(self, config: Config, *, topology: Optional[Topology] = None,
                 group_roles: Optional[dict[str, str]] = None, role_sources: Optional[dict[str, str]] = None) -> None:
        self.config = config
        self.topology = topology
        self.group_roles = group_roles or {}
        self.role_sources = role_sources or {}
        self.passes = [get_pass(name) for name in config.pass_names()]
        self.on_report: Optional[Callable[[PipelineReport], None]] = None
        # where the topology came from ("config", "setup", "detected"): reports name it
        self.topology_source: Optional[str] = "given" if topology is not None else None

    @classmethod
    def for_config(cls, config: Config, dtensor_roles: Optional[dict[str, str]] = None) -> "Pipeline":
        """The pipeline `config` asks for, with the topology and roles from `commfuse.setup` (and
        from the graph's DTensor meshes, ``dtensor_roles``) filled in."""
        from commfuse.session import resolved_roles, resolved_topology

        roles, sources = resolved_roles(config, dtensor_roles)
        topology, source = resolved_topology(config)
        pipeline = cls(config, topology=topology, group_roles=roles, role_sources=sources)
        pipeline.topology_source = source
        return pipeline

    def run(self, gm: fx.GraphModule, *, graph_kind: str, stages: Iterable[Stage],
            dump_if_changed: bool = False) -> PipelineReport:
        """``dump_if_changed``: dump this graph only when a pass changes it (the Dynamo graph
        every compile sees before AOTAutograd, which recognition rarely changes)."""
        stages = set(stages)
        cfg = self.config
        ctx = PassContext(gm, cfg, graph_kind=graph_kind, topology=self.topology,
                          group_roles=self.group_roles, role_sources=self.role_sources)
        dump_dir = cfg.resolved_dump_dir()
        dumper = DumpWriter(dump_dir, graph_kind, svg_max_nodes=cfg.svg_max_nodes) if dump_dir else None
        report = PipelineReport(graph=graph_kind, dump_dir=str(dumper.dir) if dumper else None,
                                topology=_describe_topology(self.topology, self.topology_source))
        selected = [p for p in self.passes if p.stage in stages]
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
            report.notes.append(f"collectives inside control flow / higher-order ops ({hidden}) are not analysed; "
                                "passes treat those nodes as opaque")
        pre = verify_graph(gm, ir=ctx.ir, check_meta=False) if cfg.verify else None
        deferred_input = None
        if dumper and dump_if_changed:
            deferred_input = fx.GraphModule(gm, snapshot_graph(gm.graph))
        elif dumper:
            dumper.write_graph("input", gm, ctx.ir)
        if pre is not None and not pre.ok:
            report.input_problems = pre.problems
            if selected:
                report.skipped_reason = "input graph failed verification; no pass was run"
                warnings.warn(f"commfuse: {graph_kind} graph left unchanged: input graph failed verification: "
                              f"{pre.problems[0]}", RuntimeWarning, stacklevel=2)
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
            t0 = time.perf_counter()
            try:
                result = p.run(ctx)
                record.changed, record.counts, record.refusals = result.changed, result.counts, result.refusals
                record.decisions = result.decisions
                if result.changed:
                    gm.recompile()
                    ctx.invalidate()
                    if cfg.verify:
                        v = verify_graph(gm, ir=ctx.ir, deep=cfg.debug)
                        if not v.ok:
                            raise VerificationError(v.problems, after_pass=p.name)
                    snapshot = None
            except Exception as e:  # noqa: BLE001 - any pass failure falls back (or re-raises when strict)
                record.seconds = time.perf_counter() - t0
                if cfg.strict:
                    if isinstance(e, VerificationError):
                        raise
                    raise PassError(p.name, e) from e
                restore_graph(gm.graph, snapshot)
                gm.recompile()
                ctx.invalidate()
                record.changed, record.error = False, f"{type(e).__name__}: {e}"
                warnings.warn(f"commfuse: pass '{p.name}' failed on the {graph_kind} graph and was skipped "
                              f"(graph restored): {record.error}", RuntimeWarning, stacklevel=2)
                log.debug("pass %s failed", p.name, exc_info=True)
                continue
            record.seconds = time.perf_counter() - t0
            if record.changed and dumper:
                if deferred_input is not None:
                    from commfuse.ir.graph_ir import CollectiveIR

                    dumper.write_graph("input", deferred_input, CollectiveIR(deferred_input, ctx.ir_options))
                    deferred_input = None
                dumper.write_graph(f"after_{p.name}", gm, ctx.ir)

        ir = ctx.ir
        report.analysis = build_analysis_report(ir, graph=graph_kind)
        report.sequence_hashes = report.analysis.sequence_hashes
        report.order_hash = report.analysis.order_hash
        if deferred_input is not None:
            report.dump_dir = None  # unchanged: nothing dumped
        elif dumper:
            dumper.write_text("pipeline.json", report.model_dump_json(indent=2))
        gm.meta.setdefault("commfuse_reports", []).append(report)
        if self.on_report is not None:
            self.on_report(report)
        return report


def _describe_topology(topology: Optional[Topology], source: Optional[str]) -> str:
    if topology is None:
        return "none (cost-model passes refuse; give Config.topology or setup(topology=), or run under torchrun)"
    where = {"config": "Config.topology", "setup": "commfuse.setup", "given": "given",
             "detected": "detected from the torchrun environment"}.get(source or "given", source)
    return (f"{topology.name}: {topology.num_nodes} node(s) x {topology.ranks_per_node} ranks, "
            f"device {topology.device} ({where})")

