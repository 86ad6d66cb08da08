"""`commfuse.optimize` and `commfuse.analyze`: the pass list on any FX graph; `pipeline_for`: the
pipeline a config asks for, with what the job's session knows."""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch.distributed as dist
import torch.fx as fx

from commfuse.config import Config, default_config
from commfuse.core.meta import REPORTS_META
from commfuse.core.ranks import warn_rank0
from commfuse.costmodel.profile import CostProfile
from commfuse.ir.fake_values import FakeValuesError, ensure_fake_values
from commfuse.ir.graph_ir import CollectiveIR, IRBuildOptions
from commfuse.passmgr.base import Stage
from commfuse.passmgr.pipeline import Pipeline
from commfuse.passmgr.report import AnalysisReport, PipelineReport, build_analysis_report
from commfuse.session import current_session, resolved_roles, resolved_topology
from commfuse.transforms.registry import get_pass

log = logging.getLogger(__name__)


def pipeline_for(
    config: Config,
    dtensor_roles: Optional[dict[str, str]] = None,
    dtensor_partitions: Sequence[Sequence[Sequence[int]]] = (),
) -> Pipeline:
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
        cost_label = (
            f"cost profile {config.cost_profile} ({profile.backend}, fingerprint {profile.fingerprint()})"
        )
    return Pipeline(
        [get_pass(name) for name in config.pass_names()],
        config,
        topology=topology,
        group_roles=roles,
        role_sources=sources,
        session=current_session(),
        topology_source=source,
        cost_model=cost_model,
        cost_label=cost_label,
        partitions=dtensor_partitions,
        rank=dist.get_rank() if dist.is_available() and dist.is_initialized() else None,
    )


def optimize(
    gm: fx.GraphModule,
    config: Optional[Config] = None,
    *,
    graph_kind: str = "graph",
    example_inputs: Optional[Sequence[Any]] = None,
) -> fx.GraphModule:
    """Run the configured pipeline (joint-stage passes, then schedule-stage passes) on `gm` in place.

    Accepts any FX GraphModule, e.g. a whole training step traced with `make_fx` in any
    tracing mode ("real", "fake", "symbolic") or a graph AOTAutograd made. The passes read and
    splice fake values (``node.meta["val"]``) of one fake mode; where the graph's are real
    tensors, belong to several fake modes (a real-mode `make_fx` trace) or are missing, they
    are propagated again through the graph in one mode first (the report's notes say so). The
    placeholders' values start that: their ``meta["val"]`` (or ``tensor_meta``), else
    ``example_inputs`` (one per placeholder; only sizes, strides and dtypes are read). A graph
    whose values cannot be propagated is optimised as it is, with a warning (with
    ``Config.strict``: `ValueError`).

    Returns `gm`; the pipeline report is appended to `gm.meta["commfuse_reports"]`
    (see `last_report`).
    """
    config = config or default_config()
    notes: list[str] = []
    try:
        why = ensure_fake_values(gm, example_inputs)
    except FakeValuesError as e:
        if config.strict:
            raise
        warn_rank0(
            f"commfuse: optimize(): {e}; the passes see the graph's values as they are, and a rewrite that "
            "needs them may fail and be undone",
            RuntimeWarning,
            stacklevel=2,
        )
        notes.append(f"fake values not propagated: {e}")
    else:
        if why is not None:
            log.debug("commfuse: optimize(): fake values propagated in one mode (%s)", why)
            notes.append(
                f"fake values propagated through the graph in one fake mode (the input graph had {why})"
            )
    pipeline = pipeline_for(config)
    pipeline.run(gm, graph_kind=graph_kind, stages={Stage.JOINT, Stage.SCHEDULE}, notes=notes)
    return gm


def last_report(gm: fx.GraphModule) -> Optional[PipelineReport]:
    reports = gm.meta.get(REPORTS_META) or []
    return reports[-1] if reports else None


def analyze(gm: fx.GraphModule, config: Optional[Config] = None, *, graph: str = "graph") -> AnalysisReport:
    """Every collective of `gm` with kind, group, bytes, logical dim and role; totals per kind and group."""
    roles, sources = resolved_roles(config or default_config())
    ir = CollectiveIR(gm, IRBuildOptions(group_roles=roles, role_sources=sources))
    return build_analysis_report(ir, graph=graph)
