"""The torch.compile backend: `torch.compile(model, backend="commfuse")`.

Where passes run (see docs/architecture.md):
* PRE_AUTOGRAD-stage passes rewrite the graph Dynamo hands the backend, before
  AOTAutograd traces it (MoE recognition);
* JOINT-stage passes rewrite the joint forward+backward graph before AOTAutograd
  partitions it (and the inference graph when no gradient is needed);
* SCHEDULE-stage passes reorder the partitioned forward and backward graphs.

Who executes:
* inner_compiler="inductor": `compile_fx` with commfuse's passes installed as
  Inductor's `joint_custom_pre_pass` and `post_grad_custom_post_pass`
  (`CustomGraphPass`es whose `uuid()` covers commfuse's version, config and
  topology, so compile caches key on them). A pass the user already installed
  there is chained after commfuse's, not replaced. When the pipeline schedules,
  Inductor's own comm reordering/bucketing is switched off for that compile.
* inner_compiler="eager": AOTAutograd with commfuse's partition hook and
  eager lowering, numerically identical to `backend="aot_eager"` with no passes.

What `torch.compile` hands a backend (`torch._TorchCompileWrapper`): `mode=` when it is not
"default" and `options=` when it is not empty (never both: torch.compile refuses that).
* `options={...}` are `Config` fields, laid over the backend's config for that compile
  (`config_with_options`), as Inductor reads its options; an unknown name or a bad value is
  a `ConfigError` naming it.
* `mode=` names one of Inductor's presets of its own config (`torch._inductor.list_mode_options`):
  those that only tune kernels apply to the compute Inductor compiles under commfuse; those that
  capture CUDA graphs or switch off Inductor's graph passes (where commfuse's passes run) are
  refused by name (`inductor_mode_patches`).
* `dynamic=` is not handed on: Dynamo applies it when it traces, and commfuse compiles the
  graphs with symbolic shapes it is given (passes that need static sizes refuse those
  collectives and report why).
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import time
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from commfuse.agreement import Exchange, FirstRunChoice, FrameRecord, Verdict, group_entries, report_verdict
from commfuse.api import pipeline_for
from commfuse.config import Config, config_with_options, default_config
from commfuse.core import torch_private as priv
from commfuse.core.errors import ConfigError
from commfuse.core.ranks import warn_rank0
from commfuse.dhelix.fused_partition import fused_partition
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.lowering import LoweringPlan, lower_eager, lower_runtime
from commfuse.passmgr.base import Stage
from commfuse.passmgr.pipeline import Instrumentation, Pipeline, ReportTo
from commfuse.passmgr.report import PipelineReport
from commfuse.session import current_session, mesh_partitions, roles_from_meshes

log = logging.getLogger(__name__)

# The reports of the graphs compiled in this process by any commfuse backend, including the
# ones torch.compile builds from the name "commfuse" (which nobody else holds), newest last.
_RECENT_REPORTS: "collections.deque[PipelineReport]" = collections.deque(maxlen=1024)


def recent_reports() -> list[PipelineReport]:
    """The pipeline reports of the graphs compiled in this process (at most the last 1024): what
    each commfuse compile did, also when the backend was named by string."""
    return list(_RECENT_REPORTS)


def _graph_kind_post_grad(gm: fx.GraphModule) -> str:
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if any(n.startswith("tangents") for n in names):
        return "backward"
    if any(n.startswith("primals") for n in names):
        return "forward"
    return "inference"


def _make_custom_pass(fn: Callable[[fx.Graph], None], key: str, chained: Any):
    base = priv.custom_graph_pass_base()

    class CommfuseGraphPass(base):  # type: ignore[misc, valid-type]
        """Inductor hook running a commfuse pipeline stage, then any user pass it replaced."""

        def __call__(self, graph: fx.Graph) -> None:
            fn(graph)
            if chained is not None:
                chained(graph)

        def uuid(self) -> Optional[Any]:
            if chained is None:
                return key
            other = chained.uuid() if hasattr(chained, "uuid") else None
            # A user pass without a uuid makes the graph uncacheable, as Inductor intends.
            return None if other is None else (key, other)

    return CommfuseGraphPass()


class CommfuseBackend:
    """A Dynamo backend; `commfuse.backend(config)` makes one."""

    def __init__(
        self, config: Optional[Config] = None, *, inductor_patches: Optional[dict[str, Any]] = None
    ) -> None:
        self.config = config or default_config()
        # Inductor config of torch.compile(mode=...), for the compute Inductor compiles
        self.inductor_patches: dict[str, Any] = dict(inductor_patches or {})
        # Built now so that a bad pass name fails at `backend(...)`, not mid-compile.
        self._pipeline_names = self.config.pass_names()
        # One report per graph this backend compiled (joint/forward/backward/inference), in order.
        self.reports: list[PipelineReport] = []
        # Reports of the pre-autograd stage on Dynamo's graphs (graph "dynamo"), where one of
        # its passes rewrote or refused something (e.g. MoE recognition).
        self.dynamo_reports: list[PipelineReport] = []
        # The lowering plan of every graph the commfuse runtime runs (lowering="commfuse"), in order.
        self.plans: list[LoweringPlan] = []
        # Config(dhelix=True): per joint graph, "fused" or why it was partitioned as usual.
        self.partitions: list[str] = []
        # The cross-rank agreement's verdict of every compiled frame at its first execution, in order.
        self.agreements: list[Verdict] = []

    def __call__(
        self,
        gm: fx.GraphModule,
        example_inputs: list[torch.Tensor],
        *,
        mode: Optional[str] = None,
        options: Optional[dict[str, Any]] = None,
    ):
        if options or mode not in (None, "default"):
            return self.with_compile_args(mode=mode, options=options)(gm, example_inputs)
        meshes = _dtensor_meshes(gm, example_inputs)
        # roles from the meshes the tensors live on; every rank's blocks also from the meshes
        # those were cut from (a slice such as mesh["tp"] lists only this rank's block)
        roots: list = []
        for m in meshes:
            root = priv.device_mesh_root(m)
            if all(root is not x for x in [*meshes, *roots]):
                roots.append(root)
        pipeline = pipeline_for(
            self.config,
            dtensor_roles=roles_from_meshes(meshes) if meshes else {},
            dtensor_partitions=[part for m in [*meshes, *roots] for part in mesh_partitions(m)],
        )
        net = self.config.check_agreement != "off" and _real_multi_rank()
        # the program as written, for the agreement's fallback: before any pass rewrites gm in place
        written = _copy_module(gm) if net else None
        frame = _frame_identity(gm) if net else ""
        record = FrameRecord()
        if any(p.stage is Stage.PRE_AUTOGRAD for p in pipeline.passes):
            # Recognition before AOTAutograd traces the graph, so the ops it introduces are
            # differentiated by their registered autograd. Reported (graph "dynamo") and dumped
            # only when a pass found something; the agreement check compares the AOT graphs.
            rep = pipeline.run(gm, graph_kind="dynamo", stages={Stage.PRE_AUTOGRAD}, dump_if_changed=True)
            if any(p.changed or p.refusals or p.error for p in rep.passes):
                self.dynamo_reports.append(rep)
        pipeline.instruments.append(ReportTo(self._collector()))
        pipeline.instruments.append(_CollectivesInto(record))
        started = time.perf_counter()
        # the net compares the backward graph too at the first execution: AOTAutograd compiles it
        # now instead of at the first backward (what it does anyway for graphs with symbolic sizes)
        with priv.eager_backward_compile(net):
            if self.config.inner_compiler == "eager":
                compiled = self._compile_eager(gm, example_inputs, pipeline)
            else:
                compiled = self._compile_inductor(gm, example_inputs, pipeline)
            if written is not None:
                compiled = self._with_agreement(
                    compiled,
                    written,
                    example_inputs,
                    record,
                    pipeline,
                    frame=frame,
                    compile_s=time.perf_counter() - started,
                )
        return compiled

    def _with_agreement(
        self,
        compiled: Callable,
        written: fx.GraphModule,
        example_inputs: list,
        record: FrameRecord,
        pipeline: Pipeline,
        *,
        frame: str,
        compile_s: float,
    ) -> Callable:
        """``compiled``, choosing at its first call between itself and the program as written
        (compiled now, so nothing is compiled once ranks wait on each other) by the cross-rank
        agreement exchange (commfuse/agreement.py)."""
        import torch.distributed as dist

        started = time.perf_counter()
        fallback, as_written = _compile_as_written(written, example_inputs)
        as_written_s = time.perf_counter() - started
        entries = group_entries(record, as_written)
        if not entries:  # no collective on a group whose ranks are known: nothing to agree on
            return compiled
        # Ranks compare this, so it leaves out the process groups' names (each rank names its own).
        session = current_session().fingerprint(rank_invariant=True)
        layout = _layout_digest(pipeline, rank_invariant=True)
        digest = hashlib.sha256(
            f"{self.config.cache_key(pipeline.topology)}:{session}:{layout}".encode()
        ).hexdigest()[:16]
        summary = {
            **self.config.model_dump(
                mode="json",
                exclude={
                    "dump_dir",
                    "strict",
                    "verify",
                    "debug",
                    "svg_max_nodes",
                    "check_agreement",
                    "agreement_timeout_s",
                },
            ),
            "topology (in use)": pipeline.topology.model_dump(mode="json") if pipeline.topology else None,
            "session": session,
            "mesh layout": layout,
        }
        rank, timeout_s = dist.get_rank(), self.config.agreement_timeout_s

        def decide() -> Verdict:
            verdict = Exchange(
                priv.default_store(),
                frame=frame,
                config_digest=digest,
                config_summary=summary,
                rank=rank,
                timeout_s=timeout_s,
            ).run(entries)
            verdict.frame, verdict.compile_s, verdict.compile_as_written_s = frame, compile_s, as_written_s
            return verdict

        def on_verdict(verdict: Verdict) -> None:
            self.agreements.append(verdict)
            report_verdict(verdict, frame)

        return FirstRunChoice(
            compiled, fallback, decide, mode=self.config.check_agreement, on_verdict=on_verdict
        )

    def _collector(self) -> Callable[[PipelineReport], None]:
        """Takes each graph's report when a stage of its pipeline ends, listed once (an inference
        graph's later stage hands the same report again, continued)."""

        def collect(report: PipelineReport) -> None:
            if not any(r is report for r in self.reports):
                self.reports.append(report)
                _RECENT_REPORTS.append(report)

        return collect

    def with_compile_args(
        self, *, mode: Optional[str] = None, options: Optional[dict[str, Any]] = None
    ) -> "CommfuseBackend":
        """This backend with torch.compile's ``mode=`` / ``options=`` applied; what it compiles is
        reported in this backend's lists (``reports``, ``plans``, ...)."""
        config = config_with_options(self.config, options)
        derived = CommfuseBackend(
            config, inductor_patches={**self.inductor_patches, **inductor_mode_patches(mode, config)}
        )
        derived.reports, derived.dynamo_reports = self.reports, self.dynamo_reports
        derived.plans, derived.partitions = self.plans, self.partitions
        derived.agreements = self.agreements
        return derived

    # -- eager --------------------------------------------------------------
    def _compile_eager(self, gm, example_inputs, pipeline: Pipeline):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        def partition(joint: fx.GraphModule, joint_inputs, **kwargs):
            pipeline.run(joint, graph_kind="joint", stages={Stage.JOINT})
            if self.config.dhelix:
                fused = fused_partition(joint, kwargs["num_fwd_outputs"])
                self.partitions.append("fused" if not isinstance(fused, str) else fused)
                if not isinstance(fused, str):
                    return fused
                log.info("commfuse: dhelix: joint graph partitioned as usual: %s", fused)
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        def compile_stage(kind: str, stages: set[Stage]):
            def compiler(g: fx.GraphModule, _inputs):
                rep = pipeline.run(g, graph_kind=kind, stages=stages)
                if self.config.lowering == "commfuse":
                    try:
                        return lower_runtime(
                            g,
                            kind,
                            dump_dir=rep.dump_dir,
                            on_plan=self.plans.append,
                            group_roles=pipeline.group_roles,
                        )
                    except Exception as e:  # noqa: BLE001 - same rule as the Inductor path below
                        _warn_lowering_failed(kind, e, "runs op by op with functional collectives")
                return lower_eager(g)

            return compiler

        return priv.aot_autograd(
            fw_compiler=compile_stage("forward", {Stage.SCHEDULE}),
            bw_compiler=compile_stage("backward", {Stage.SCHEDULE}),
            inference_compiler=compile_stage("inference", {Stage.JOINT, Stage.SCHEDULE}),
            partition_fn=partition,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    # -- inductor -----------------------------------------------------------
    def _compile_inductor(self, gm, example_inputs, pipeline: Pipeline):
        cfg = priv.inductor_config()
        # the session's sub-groups, roles and communicator pool change what the passes decide, and
        # so do the roles and mesh blocks read from the graph's DTensors
        key = f"{self.config.cache_key(pipeline.topology)}:{current_session().fingerprint()}:{_layout_digest(pipeline)}"

        # Inductor runs joint passes on the inference graph too (no partition there),
        # so the joint hook must also apply JOINT passes to it; post-grad passes then
        # see it as "inference".
        def joint_hook(graph: fx.Graph) -> None:
            gm_ = graph.owning_module
            has_tangents = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
            # an inference graph gets its SCHEDULE passes later, at its compile: one report for both
            pipeline.run(
                gm_,
                graph_kind="joint" if has_tangents else "inference",
                stages={Stage.JOINT},
                more_stages=not has_tangents,
            )

        def post_grad_hook(graph: fx.Graph) -> None:
            gm_ = graph.owning_module
            pipeline.run(gm_, graph_kind=_graph_kind_post_grad(gm_), stages={Stage.SCHEDULE})

        patches: dict[str, Any] = {
            **self.inductor_patches,
            "joint_custom_pre_pass": _make_custom_pass(joint_hook, "joint:" + key, cfg.joint_custom_pre_pass),
        }
        if self.config.lowering == "inductor":
            patches["post_grad_custom_post_pass"] = _make_custom_pass(
                post_grad_hook, "post:" + key, cfg.post_grad_custom_post_pass
            )
        if any(p.stage is Stage.SCHEDULE for p in pipeline.passes):
            # commfuse orders these graphs; Inductor's own comm reordering would undo it.
            patches.update(
                {
                    "reorder_for_compute_comm_overlap": False,
                    "bucket_all_gathers_fx": "none",
                    "bucket_reduce_scatters_fx": "none",
                    "bucket_all_reduces_fx": "none",
                    "aten_distributed_optimizations.enable_overlap_scheduling": False,
                }
            )
        if self.config.lowering == "inductor":
            return priv.inductor_compile_fx(gm, example_inputs, config_patches=patches)
        return priv.inductor_compile_fx(
            gm, example_inputs, config_patches=patches, inner_compile=self._inner_compile_regions(pipeline)
        )

    def _inner_compile_regions(self, pipeline: Pipeline):
        """Inductor's inner compiler for ``lowering="commfuse"``: schedule the partitioned graph,
        lower it to the runtime, compile the compute between collectives region by region."""

        def inner(g: fx.GraphModule, example_inputs, compile_region_name=None, **kw):
            kind = (
                "backward" if kw.get("is_backward") else "inference" if kw.get("is_inference") else "forward"
            )
            rep = pipeline.run(g, graph_kind=kind, stages={Stage.SCHEDULE})
            region_kw = {k: kw[k] for k in ("is_backward", "is_inference", "graph_id") if k in kw}

            def compile_region(sub: fx.GraphModule, inputs: list):
                try:
                    return priv.inductor_compile_fx_inner(sub, inputs, **region_kw)
                except Exception:  # noqa: BLE001 - retried once without the FX graph cache, then raised
                    # The cache's lookup evaluates the guards of entries compiled for other
                    # regions of the same structure, and has failed doing so (KeyError on a
                    # symbol name) where a cold compile succeeds.
                    with priv.inductor_config().patch(fx_graph_cache=False):
                        return priv.inductor_compile_fx_inner(sub, inputs, **region_kw)

            try:
                return lower_runtime(
                    g,
                    kind,
                    dump_dir=rep.dump_dir,
                    compile_regions=compile_region,
                    example_inputs=list(example_inputs),
                    on_plan=self.plans.append,
                    group_roles=pipeline.group_roles,
                )
            except Exception as e:  # noqa: BLE001 - lowering failed: Inductor's own whole-graph path
                # Decided at compile time from the graph alone (the same SPMD graph on every rank,
                # lowered by the same code), so every rank falls back alike; Inductor then issues
                # the collectives in the graph's order, as with Config(lowering="inductor").
                _warn_lowering_failed(kind, e, "is compiled by Inductor as a whole")
                return priv.inductor_compile_fx_inner(g, example_inputs, **kw)

        return inner


class _CollectivesInto(Instrumentation):
    """Records each finished graph's collectives (its IR after the pipeline) for the agreement
    exchange; a later stage of the same graph replaces what an earlier one recorded."""

    def __init__(self, record: FrameRecord) -> None:
        self.record = record

    def after_pipeline(self, gm: fx.GraphModule, ctx, report: PipelineReport) -> None:
        self.record.add(report.graph, ctx.ir)


def _copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with a graph of its own (passes and Inductor's pre-grad passes rewrite graphs in
    place); the modules and parameters it holds are shared."""
    copy = fx.GraphModule(gm, priv.copy_graph(gm.graph))
    copy.meta = dict(gm.meta)
    return copy


def _compile_as_written(gm: fx.GraphModule, example_inputs: list) -> tuple[Callable, FrameRecord]:
    """The program as written: no commfuse pass, AOTAutograd's partition, every graph run op by
    op with functional collectives in graph order (the eager inner compiler's own fallback), and
    the collectives of its graphs."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    record = FrameRecord()

    def compile_stage(kind: str):
        def compiler(g: fx.GraphModule, _inputs):
            record.add(kind, CollectiveIR(g))
            return lower_eager(g)

        return compiler

    fn = priv.aot_autograd(
        fw_compiler=compile_stage("forward"),
        bw_compiler=compile_stage("backward"),
        inference_compiler=compile_stage("inference"),
        partition_fn=min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)
    return fn, record


# The number of graphs the backend compiled so far in each Dynamo compile (a frame with a graph
# break inside an inlined call, or split by DDPOptimizer, hands the backend several).
_GRAPHS_IN_COMPILE: dict[str, int] = {}


def _frame_identity(gm: fx.GraphModule) -> str:
    """The same on every rank for the same graph of the same frame, whatever was compiled
    before (a recompile on some ranks only must meet its peers' entries): the Dynamo code object
    (file, line, name) and the graph's position in this compile; the graph's code outside Dynamo."""
    where = priv.dynamo_frame()
    if where is None:
        return "graph " + hashlib.sha256(gm.code.encode()).hexdigest()[:16]
    code, compile_id = where
    n = _GRAPHS_IN_COMPILE[compile_id] = _GRAPHS_IN_COMPILE.get(compile_id, -1) + 1
    return f"{code}#{n}"


def _warn_lowering_failed(kind: str, e: Exception, instead: str) -> None:
    # decided from the graph alone, which every rank shares: one copy of the warning
    warn_rank0(
        f"commfuse: the {kind} graph could not be lowered to commfuse's runtime and {instead} "
        f"(same collectives, in the graph's order): {type(e).__name__}: {e}",
        RuntimeWarning,
        stacklevel=3,
    )
    log.debug("commfuse: lowering of the %s graph failed", kind, exc_info=True)


def _layout_digest(pipeline: Pipeline, *, rank_invariant: bool = False) -> str:
    """The groups' roles and the mesh blocks the pipeline decides from, as a short digest.
    ``rank_invariant`` keeps only what every rank knows alike: the roles without the groups'
    names (each rank names its own groups) and the number of mesh partitions (a rank learns the
    blocks of a DTensor mesh from its own slices, so their listing differs between ranks)."""
    if rank_invariant:
        payload: dict = {
            "roles": sorted(pipeline.group_roles.values()),
            "partitions": len(pipeline.partitions),
        }
    else:
        payload = {"roles": sorted(pipeline.group_roles.items()), "partitions": pipeline.partitions}
    return hashlib.sha256(json.dumps(payload, default=str).encode()).hexdigest()[:16]


def _dtensor_meshes(gm: fx.GraphModule, example_inputs: list) -> list:
    """The DeviceMeshes the graph's DTensors (inputs, lifted parameters, or parameters the graph
    still holds) live on: their dim names give the groups' roles, their dims every rank's blocks."""
    from torch.distributed.tensor import DTensor

    meshes = {}
    for t in [*example_inputs, *gm.parameters(), *gm.buffers()]:
        if isinstance(t, DTensor):
            meshes.setdefault(id(t.device_mesh), t.device_mesh)
    return list(meshes.values())


def _real_multi_rank() -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return False
    return dist.get_backend() != "fake"  # one process pretends to be N ranks: nothing to compare


def inductor_mode_patches(mode: Optional[str], config: Config) -> dict[str, Any]:
    """The Inductor config that ``torch.compile(mode=mode)`` stands for, checked against
    commfuse: {} for no mode or "default"; a ``ConfigError`` naming the mode when commfuse
    cannot honour it."""
    if mode is None or mode == "default":
        return {}
    where = f"torch.compile(backend='commfuse', mode={mode!r})"
    modes = priv.inductor_mode_options()
    if mode not in modes:
        raise ConfigError(f"{where}: unknown mode; torch.compile's modes are {', '.join(sorted(modes))}")
    opts = dict(priv.inductor_mode_options(mode))
    if config.inner_compiler != "inductor":
        raise ConfigError(
            f"{where}: the mode sets Inductor's {sorted(opts)}, and with "
            f"inner_compiler={config.inner_compiler!r} Inductor compiles nothing; leave mode out"
        )
    if opts.get("triton.cudagraphs"):
        raise ConfigError(
            f"{where}: the mode captures each compiled graph in a CUDA graph, and commfuse's runtime "
            "issues the collectives from Python between the compiled regions (a CUDA graph cannot "
            "hold them; commfuse has not been run under CUDA graphs). Use "
            "mode='max-autotune-no-cudagraphs' for Inductor's kernel tuning without them"
        )
    off = sorted(k for k, v in opts.items() if k.startswith("use_") and k.endswith("_passes") and v is False)
    if off:
        raise ConfigError(
            f"{where}: the mode switches off Inductor's graph passes ({', '.join(off)}), and "
            "commfuse's joint-graph passes run inside them (joint_custom_pre_pass); leave mode out"
        )
    return opts


def backend(config: Optional[Config] = None, **overrides: Any) -> CommfuseBackend:
    """A commfuse Dynamo backend with a non-default config: `torch.compile(m, backend=commfuse.backend(cfg))`."""
    if overrides:
        config = Config(**{**(config or default_config()).model_dump(), **overrides})
    return CommfuseBackend(config)


def commfuse_backend(
    gm: fx.GraphModule,
    example_inputs: list[torch.Tensor],
    *,
    mode: Optional[str] = None,
    options: Optional[dict[str, Any]] = None,
):
    """The backend registered as "commfuse": the default config (``commfuse.default_config()``),
    with ``torch.compile(..., options={...})`` laid over it as Config fields, and ``mode=`` as
    ``inductor_mode_patches`` allows."""
    return CommfuseBackend()(gm, example_inputs, mode=mode, options=options)
