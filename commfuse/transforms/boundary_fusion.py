"""boundary_fusion: fuse each pipeline stage transfer with the collective next to it (Chimera across stages).

Contract
- Matches: ``commfuse::stage_transfer_autograd`` nodes of a pipeline FORWARD graph
  (:func:`commfuse.pipeline.trace_forward`) that pair the positions of two adjacent stages,
  together with, per rule (:mod:`commfuse.analysis.boundary`): an all_gather on the sending stage
  (``ag_p2p``), an all_gather on the receiving stage (``p2p_ag``), an all_to_all on the
  sending stage (``a2a_p2p``), Megatron's g (all_reduce) plus replicated residual adds on
  the sending stage (``ar_p2p``, TP+PP), or a router + dispatch + all_to_all on the receiving
  stage (``p2p_a2a``, PP+EP: opt-in, GPipe only). Other graphs (no boundary op) are left
  alone with a note.
- Does: replaces the pair by ``commfuse::m2ms_autograd`` (plus, for ``ar_p2p``, a
  reduce_scatter on A and an all_gather on B; for ``p2p_a2a``, the router region moved to A
  with its inputs and outputs transferred), traced pre-dispatch and spliced where the
  transfer was. The joint graph derived afterwards (``trace_joint``) holds the reverse
  scatter as the backward, so the runner executes both directions fused.
- Guarantees: forward values equal to the unfused pipeline's (bit for bit for the pure data
  movements ag_p2p, p2p_ag, a2a_p2p; ar_p2p sums over the stage as the all_reduce did;
  p2p_a2a computes the router on another stage from the same values) and the same
  gradients up to summation order (ar_p2p: under the TP contract of the receiving stage,
  which the caller declares); parameters stay their owners' graph inputs (gradients only on
  the owning stage) and ``state_dict`` is untouched;
  every decision depends only on the graph, the layout and the options, the same on every
  rank (the rank's position only picks which chunk a value holds); no process group is
  created or resolved.
- Keeps a rewrite only when the per-rank boundary bytes (Chimera Table 1 conventions; the
  derivation is docs/boundary-fusion.md) do not grow; every transfer left alone is reported
  with the reason of every rule.

Entry points: :func:`fuse_boundaries` (forward GraphModule + PipelineLayout -> report),
:func:`boundary_fusion_pass` (a ``PipelineRunner(forward_passes=[...])`` hook) and the
registered pass ``boundary_fusion`` (stage PRE_AUTOGRAD; finds the layout it needs in
``gm.meta["commfuse.pipeline_layout"]`` or, for graphs of commfuse.pipeline, from the
boundary aliases, without the rank's position).

Requires a ``commfuse::m2ms`` that traces across stages (input of the sending position,
output of the receiving one: ``trace_position(..., pairwise=True)``); without it every
rule refuses with that reason.

Source: Chimera (ISCA '25) §3.3, Tables 1-3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch.fx as fx

from commfuse.analysis.boundary import (
    LAYOUT_META_KEY,
    MATCHERS,
    BoundaryFusionOptions,
    BoundaryMap,
    Env,
    RuleVolume,
    m2ms_traceable_across_stages,
    ring_bytes,
    sites,
)
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.ir.kinds import CollectiveKind
from commfuse.ir.shapes import nbytes
from commfuse.ops import M2MS, M2MS_AUTOGRAD, STAGE_TRANSFER, STAGE_TRANSFER_AUTOGRAD
from commfuse.ops.boundary.ir_view import transfers_of
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext
from commfuse.pipeline.collectives import REDUCE_FROM_GROUP

LAYOUT_META = LAYOUT_META_KEY
_KIND_NAMES = {
    CollectiveKind.ALL_GATHER: "all_gather",
    CollectiveKind.REDUCE_SCATTER: "reduce_scatter",
    CollectiveKind.ALL_TO_ALL: "all_to_all",
    CollectiveKind.ALL_REDUCE: "all_reduce",
}


@dataclass
class BoundaryDecision:
    """What happened to one transfer: the rule applied (with its bytes), or every rule's reason."""

    transfer: str
    boundary: str
    applied: Optional[str]  # the rule name, None when left alone
    description: str = ""
    volume: Optional[RuleVolume] = None
    reasons: dict[str, str] = field(default_factory=dict)  # rule -> why not

    def to_json(self) -> dict:
        return {
            "transfer": self.transfer,
            "boundary": self.boundary,
            "applied": self.applied,
            "description": self.description,
            "volume": self.volume.to_json() if self.volume else None,
            "reasons": dict(self.reasons),
        }


@dataclass
class BoundaryFusionReport:
    changed: bool
    decisions: list[BoundaryDecision] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bytes_before: dict[int, dict[str, int]] = field(default_factory=dict)  # stage -> op -> bytes (measured)
    bytes_after: dict[int, dict[str, int]] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        out = {r: 0 for r in MATCHERS}
        for d in self.decisions:
            if d.applied:
                out[d.applied] += 1
        return out

    @property
    def refusals(self) -> list[str]:
        out = []
        for d in self.decisions:
            if d.applied is None:
                why = "; ".join(f"{r}: {w}" for r, w in d.reasons.items())
                out.append(f"{d.transfer} ({d.boundary}): not fused: {why}")
        return out + list(self.notes)

    def to_json(self) -> dict:
        return {
            "changed": self.changed,
            "counts": self.counts,
            "decisions": [d.to_json() for d in self.decisions],
            "notes": list(self.notes),
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
        }


# ------------------------------------------------------------------------------------ bytes
def measured_bytes(gm: fx.GraphModule, bmap: BoundaryMap) -> dict[int, dict[str, int]]:
    """Per stage, per op kind: the bytes one rank of that stage (at this graph's position) sends
    in the graph's collectives, Chimera Table 1 conventions, read from the CollectiveIR (and
    commfuse.pipeline's reduce_from_group, an all_reduce the IR does not list)."""

    out: dict[int, dict[str, int]] = {}

    def add(stage: int, op: str, b: int) -> None:
        d = out.setdefault(stage, {})
        d[op] = d.get(op, 0) + int(b)

    p = bmap.position or 0
    for c in CollectiveIR(gm).collectives:
        if c.kind in _KIND_NAMES and c.group.name in bmap.stage_groups:
            n = bmap.stage_size(c.group.name)
            add(
                bmap.stage_groups[c.group.name],
                _KIND_NAMES[c.kind],
                ring_bytes(_KIND_NAMES[c.kind], n, c.input_bytes),
            )
        elif c.kind in (CollectiveKind.P2P, CollectiveKind.M2MS):
            t = transfers_of(c.start)
            bd = bmap.boundaries.get(c.group.name)
            if t is None or bd is None:
                continue
            op = "m2ms" if c.kind is CollectiveKind.M2MS else "stage_transfer"
            for side in (bd.a, bd.b):
                sent = t.sent_bytes(side.boundary_ranks[p]) if p < len(side.boundary_ranks) else 0
                if sent:
                    add(side.stage, op, sent)
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is REDUCE_FROM_GROUP and n.args[2] in bmap.stage_groups:
            add(
                bmap.stage_groups[n.args[2]],
                "all_reduce",
                ring_bytes("all_reduce", int(n.args[1]), nbytes(n.args[0])),
            )
    return out


# ------------------------------------------------------------------------------------ driver
def _has_boundary_ops(gm: fx.GraphModule) -> bool:
    ops = (STAGE_TRANSFER, STAGE_TRANSFER_AUTOGRAD, M2MS, M2MS_AUTOGRAD)
    return any(n.op == "call_function" and n.target in ops for n in gm.graph.nodes)


def fuse_boundaries(
    forward_gm: fx.GraphModule,
    layout=None,
    *,
    options: Optional[BoundaryFusionOptions] = None,
    input_names: Optional[Sequence[str]] = None,
) -> BoundaryFusionReport:
    """Rewrite ``forward_gm`` (a pipeline forward graph) in place; see the module docstring.

    ``layout``: the :class:`~commfuse.pipeline.PipelineLayout` (None: read from the graph's
    aliases, position unknown). ``input_names``: the ``InputSpec.name`` of each graph input
    (``options.replicated_inputs`` refers to them)."""
    options = options or BoundaryFusionOptions()
    if not isinstance(options, BoundaryFusionOptions):
        raise TypeError(f"options: expected BoundaryFusionOptions, got {type(options).__name__}")
    if not _has_boundary_ops(forward_gm):
        return BoundaryFusionReport(
            False, notes=["no pipeline boundary op (stage_transfer / m2ms) in the graph: nothing to fuse"]
        )
    if layout is not None:
        bmap, notes = BoundaryMap.from_layout(layout), []
    else:
        bmap, notes = BoundaryMap.from_graph(forward_gm)
    report = BoundaryFusionReport(False, notes=list(notes))
    report.bytes_before = measured_bytes(forward_gm, bmap)
    site_list, site_notes = sites(forward_gm, bmap)
    report.notes.extend(site_notes)
    unsupported = m2ms_traceable_across_stages() if site_list else None
    env = Env(forward_gm, bmap, options, input_names)
    for site in site_list:
        decision = BoundaryDecision(site.node.name, site.boundary.group, None)
        report.decisions.append(decision)
        if unsupported:
            decision.reasons["all rules"] = unsupported
            continue
        for rule in options.rules:
            m = MATCHERS[rule](site, env)
            if isinstance(m, str):
                decision.reasons[rule] = m
                continue
            if m.volume.bytes_after > m.volume.bytes_before:
                decision.reasons[rule] = (
                    f"{m.description}: per-rank boundary bytes would grow "
                    f"{m.volume.bytes_before} -> {m.volume.bytes_after}"
                )
                continue
            m.apply()
            forward_gm.graph.lint()
            forward_gm.recompile()
            env.refresh()
            decision.applied, decision.description, decision.volume = rule, m.description, m.volume
            report.changed = True
            break
    report.bytes_after = measured_bytes(forward_gm, bmap)
    return report


def boundary_fusion_pass(options: Optional[BoundaryFusionOptions] = None) -> Callable[[Any], None]:
    """A ``PipelineRunner(forward_passes=[...])`` hook: fuses the program's forward graph with
    its layout and input names; each build's report is appended to the hook's ``reports``."""
    reports: list[BoundaryFusionReport] = []

    def hook(program) -> None:
        rep = fuse_boundaries(
            program.forward, program.layout, options=options, input_names=[s.name for s in program.inputs]
        )
        reports.append(rep)

    hook.reports = reports  # type: ignore[attr-defined]
    return hook


class BoundaryFusion(GraphPass):
    __doc__ = __doc__
    name = "boundary_fusion"
    stage = Stage.PRE_AUTOGRAD
    # Boundary fusion rewrites the FORWARD graph of commfuse.pipeline (autograd-level
    # commfuse::stage_transfer_autograd between the stage groups of a pipeline layout, every stage traced
    # per position), before the joint graph exists; the fuzzer generates ATen graphs of functional
    # collectives on its own groups, where the pass finds no pipeline boundary and returns unchanged.
    fuzz = FuzzSpec(
        not_fuzzed="runs on commfuse.pipeline forward graphs (stage_transfer_autograd between pipeline stage groups, traced per "
        "position), which the fuzzer's ATen programs never contain, so a registration would check nothing. Covered "
        "instead by tests/test_boundary_fusion.py: randomised cases per rule (shapes, gather dims 0-2, views after the "
        "collective, other users of the received shard, residual orders, 1-3 micro-batches, GPipe/1F1B) fused vs "
        "unfused on 4 gloo ranks (test_random_boundary_cases_match_unfused), every workload at 2 and 3 micro-batches "
        "with both schedules, the byte formulas, and every refusal."
    )

    def run(self, ctx: PassContext) -> PassResult:
        gm = ctx.gm
        layout = gm.meta.get(LAYOUT_META) if hasattr(gm, "meta") else None
        rep = fuse_boundaries(gm, layout)
        if rep.changed:
            ctx.invalidate()
        decisions = [d.to_json() for d in rep.decisions if d.applied]
        return PassResult(rep.changed, counts=rep.counts, refusals=rep.refusals, decisions=decisions)


__all__ = [
    "BoundaryDecision",
    "BoundaryFusion",
    "BoundaryFusionOptions",
    "BoundaryFusionReport",
    "LAYOUT_META",
    "boundary_fusion_pass",
    "fuse_boundaries",
    "measured_bytes",
]
