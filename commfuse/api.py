"""`commfuse.optimize` and `commfuse.analyze`: the pass list on any FX graph."""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from commfuse.config import Config, default_config
from commfuse.ir.graph_ir import CollectiveIR, IRBuildOptions
from commfuse.passes.base import Stage
from commfuse.passes.pipeline import Pipeline
from commfuse.report import AnalysisReport, PipelineReport, build_analysis_report
from commfuse.session import resolved_roles


def optimize(gm: fx.GraphModule, config: Optional[Config] = None, *, graph_kind: str = "graph") -> fx.GraphModule:
    """Run the configured pipeline (joint-stage passes, then schedule-stage passes) on `gm` in place.

    Accepts any FX GraphModule, e.g. a whole training step traced with `make_fx`.
    Returns `gm`; the pipeline report is appended to `gm.meta["commfuse_reports"]`
    (see `last_report`).
    """
    pipeline = Pipeline.for_config(config or default_config())
    pipeline.run(gm, graph_kind=graph_kind, stages={Stage.JOINT, Stage.SCHEDULE})
    return gm


def last_report(gm: fx.GraphModule) -> Optional[PipelineReport]:
    reports = gm.meta.get("commfuse_reports") or []
    return reports[-1] if reports else None


def analyze(gm: fx.GraphModule, config: Optional[Config] = None, *, graph: str = "graph") -> AnalysisReport:
    """Every collective of `gm` with kind, group, bytes, logical dim and role; totals per kind and group."""
    roles, sources = resolved_roles(config or default_config())
    ir = CollectiveIR(gm, IRBuildOptions(group_roles=roles, role_sources=sources))
    return build_analysis_report(ir, graph=graph)
