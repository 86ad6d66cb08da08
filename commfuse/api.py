"""`commfuse.optimize` and `commfuse.analyze`: the pass list on any FX graph; `pipeline_for`: the
pipeline a config asks for, with what the job's session knows."""

from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed as dist
import torch.fx as fx

from commfuse.config import Config, default_config
from commfuse.core.meta import REPORTS_META
from commfuse.costmodel.profile import CostProfile
from commfuse.ir.graph_ir import CollectiveIR, IRBuildOptions
from commfuse.passmgr.base import Stage
from commfuse.passmgr.pipeline import Pipeline
from commfuse.passmgr.report import AnalysisReport, PipelineReport, build_analysis_report
from commfuse.session import current_session, resolved_roles, resolved_topology
from commfuse.transforms.registry import get_pass


def pipeline_for(config: Config, dtensor_roles: Optional[dict[str, str]] = None,
                 dtensor_partitions: Sequence[Sequence[Sequence[int]]] = ()) -> Pipeline:
    """The pipeline `config` asks for, with the topology, roles and session state from
    `commfuse.setup` (and the roles and dims' blocks of the graph's DTensor meshes,
    ``dtensor_roles`` and ``dtensor_partitions``) filled in."""
    roles, sources = resolved_roles(config, dtensor_roles)
    topology, source = resolved_topology(config)
    cost_model = cost_label = None
    if config.cost_profile is not None:
        # every rank reads the same file (Config checked it), so every rank prices the same
        profile = CostProfile.load(config.cost_profile)
        if topology is None:
            topology, source = profile.resolve_topology(), "cost_profile"
        cost_model = profile.build_model(topology)
        cost_label = f"cost profile {config.cost_profile} ({profile.backend}, fingerprint {profile.fingerprint()})"
    return Pipeline([get_pass(name) for name in config.pass_names()], config, topology=topology,
                    group_roles=roles, role_sources=sources, session=current_session(), topology_source=source,
                    cost_model=cost_model, cost_label=cost_label, partitions=dtensor_partitions,
                    rank=dist.get_rank() if dist.is_available() and dist.is_initialized() else None)


def optimize(gm: fx.GraphModule, config: Optional[Config] = None, *, graph_kind: str = "graph") -> fx.GraphModule:
    """Run the configured pipeline (joint-stage passes, then schedule-stage passes) on `gm` in place.

    Accepts any FX GraphModule, e.g. a whole training step traced with `make_fx`.
    Returns `gm`; the pipeline report is appended to `gm.meta["commfuse_reports"]`
    (see `last_report`).
    """
    pipeline = pipeline_for(config or default_config())
    pipeline.run(gm, graph_kind=graph_kind, stages={Stage.JOINT, Stage.SCHEDULE})
    return gm


def last_report(gm: fx.GraphModule) -> Optional[PipelineReport]:
    reports = gm.meta.get(REPORTS_META) or []
    return reports[-1] if reports else None


def analyze(gm: fx.GraphModule, config: Optional[Config] = None, *, graph: str = "graph") -> AnalysisReport:
    """Every collective of `gm` with kind, group, bytes, logical dim and role; totals per kind and group."""
    roles, sources = resolved_roles(config or default_config())
    ir = CollectiveIR(gm, IRBuildOptions(group_roles=roles, role_sources=sources))
    return build_analysis_report(ir, graph=graph)
