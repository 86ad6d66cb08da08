"""Benchmark baselines: how a workload's model is run, and where its graphs come from.

Every baseline runs the same model on the same inputs; they differ in the
compiler. For the collective metrics each baseline also says which graphs it
actually executed:

* ``eager``: no compilation. Eager DTensor issues the collectives of the
  AOTAutograd forward/backward graphs, so those are captured afterwards with a
  recording AOT backend (``commfuse.testing.graphs.capture_aot_graphs``).
* ``inductor`` / ``inductor+comm``: ``torch.compile`` with Inductor; the
  graphs are recorded right after Inductor's post-grad passes (where its own
  comm bucketing runs), i.e. what Inductor lowered.
* ``commfuse...``: ``backend=commfuse.backend(...)``; the collective columns
  come from the pipeline's own reports (``backend.reports[i].analysis``) of the
  forward / backward graphs it handed to the inner compiler. The graphs
  themselves are kept too (``Session.executed_graphs``), for the simulated
  step time: with commfuse's lowering (default) the graphs the runtime lowering
  received (the pipeline's final forward/backward; Inductor only compiles the
  compute between their collectives), with ``lowering="inductor"``
  (``commfuse:whole-graph``) the graphs right after Inductor's post-grad passes
  (commfuse's SCHEDULE passes run there), i.e. what each executes.

Adding a baseline: subclass :class:`Baseline` (or instantiate one of the
classes below) and call :func:`register_baseline`. Baselines are looked up
by name inside the rank processes, so registration must happen at import
time of this module (or of a module it imports).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from benchmarks.workloads import Built

__all__ = [
    "Baseline",
    "CommfuseBaseline",
    "CompiledGraph",
    "EagerBaseline",
    "GradAccumBaseline",
    "InductorBaseline",
    "Session",
    "baseline_names",
    "get_baseline",
    "register_baseline",
]

# Inductor's own communication optimisations as torch 2.13 names them
# (torch/_inductor/config.py): comm/compute reordering in the scheduler and
# FX bucketing of every all_gather / reduce_scatter / all_reduce.
INDUCTOR_COMM_PATCHES: dict[str, Any] = {
    "reorder_for_compute_comm_overlap": True,
    "bucket_all_gathers_fx": "all",
    "bucket_reduce_scatters_fx": "all",
    "bucket_all_reduces_fx": "all",
}


@dataclass
class CompiledGraph:
    """A graph a baseline executed: its kind (forward/backward/inference) and the module."""

    kind: str
    gm: fx.GraphModule


@dataclass
class Session:
    """One baseline applied to one model on one rank.

    ``run`` is what the training step calls; ``graphs()`` (called after the
    measured steps) returns the graphs that were executed, for the collective
    columns; ``pipeline_reports`` holds commfuse's per-graph ``PipelineReport``
    dumps (empty for non-commfuse), which stand in for ``graphs()`` there;
    ``executed_graphs()`` returns the executed graphs for the simulated step time
    (``None``: the same as ``graphs()``). ``step``, when set, IS the whole training
    step (forward + loss + backward of every micro-batch, then ``zero_grad``) and is
    called instead of the default step built from ``run`` (``benchmarks.measure.step_of``);
    ``None``: the default step, one ``run(*inputs)`` + loss + backward.
    """

    run: Callable[..., Any]
    graphs: Callable[[], list[CompiledGraph]]
    pipeline_reports: Callable[[], list[dict[str, Any]]] = lambda: []
    executed_graphs: Callable[[], list[CompiledGraph]] | None = None
    step: Callable[[], None] | None = None


@dataclass(frozen=True)
class Baseline:
    """Base class. ``inner`` is what executes the graphs ("eager" / "inductor" / "-")."""

    name: str
    description: str
    inner: str
    uses_inductor: bool = False

    @contextlib.contextmanager
    def session(self, built: Built) -> Iterator[Session]:
        """Context for the whole measurement of ``built`` on this rank: compile
        (lazily, on the first step), the steps, and collecting the graphs."""
        raise NotImplementedError
        yield  # pragma: no cover


@contextlib.contextmanager
def _fresh_inductor_cache() -> Iterator[None]:
    """Compile from scratch: a fresh on-disk cache (FX graph, AOT and C++ kernel
    caches) so that an earlier baseline's kernels do not make a later one look
    fast. Private: ``torch._inductor.utils.fresh_cache``."""
    from torch._inductor.utils import fresh_cache

    with fresh_cache():
        yield


def _kind_of(gm: fx.GraphModule) -> str:
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if any(n.startswith("tangents") for n in names):
        return "backward"
    return "forward" if any(n.startswith("primals") for n in names) else "inference"


@contextlib.contextmanager
def _record_inductor_post_grad(sink: list[CompiledGraph]) -> Iterator[None]:
    """Record every top-level graph right after Inductor's post-grad passes
    (bucketing included), i.e. the graph Inductor then lowers.

    Private: ``torch._inductor.compile_fx._recursive_post_grad_passes``; it
    calls itself for subgraphs through the module global, hence the depth
    counter (only top-level graphs are recorded).
    """
    import torch._inductor.compile_fx as cfx

    original = cfx._recursive_post_grad_passes
    depth = [0]

    def recording(gm: fx.GraphModule, is_inference: bool = False) -> None:
        depth[0] += 1
        try:
            original(gm, is_inference)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            # Keep a reference; analysed after the measured steps, so the
            # analysis is not part of the compile time.
            sink.append(CompiledGraph("inference" if is_inference else _kind_of(gm), gm))

    cfx._recursive_post_grad_passes = recording
    try:
        yield
    finally:
        cfx._recursive_post_grad_passes = original


@contextlib.contextmanager
def _record_commfuse_lowering(sink: list[CompiledGraph]) -> Iterator[None]:
    """Record every graph commfuse lowers: ``commfuse.backend`` hands the pipeline's final
    forward/backward/inference graph to ``lower_runtime`` (``lowering="commfuse"``, either
    inner compiler) or to ``lower_eager``; that graph is what runs (Inductor may only
    compile the compute between its collectives)."""
    import importlib

    # `commfuse.backend` the attribute is the backend() factory; the module is this one.
    cb = importlib.import_module("commfuse.backend")
    originals = {name: getattr(cb, name) for name in ("lower_eager", "lower_runtime")}

    def recording(name: str):
        def lower(gm: fx.GraphModule, *args: Any, **kwargs: Any):
            sink.append(CompiledGraph(_kind_of(gm), gm))
            return originals[name](gm, *args, **kwargs)

        return lower

    for name in originals:
        setattr(cb, name, recording(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(cb, name, fn)


@dataclass(frozen=True)
class EagerBaseline(Baseline):
    """No compilation; graphs captured afterwards with a recording AOT backend."""

    @contextlib.contextmanager
    def session(self, built):
        def graphs() -> list[CompiledGraph]:
            from commfuse.testing.graphs import capture_aot_graphs

            # One extra forward+backward, traced and run by a recording
            # AOTAutograd backend: the collectives eager DTensor issues are
            # those of these graphs.
            got = capture_aot_graphs(built.model, *built.inputs, loss=built.loss)
            return [
                CompiledGraph(k, getattr(got, k))
                for k in ("forward", "backward", "inference")
                if getattr(got, k) is not None
            ]

        yield Session(run=built.model, graphs=graphs)


@dataclass(frozen=True)
class InductorBaseline(Baseline):
    """``torch.compile(model)`` (Inductor) under ``config_patches``; fresh caches."""

    config_patches: Mapping[str, Any] = field(default_factory=dict)

    @contextlib.contextmanager
    def session(self, built):
        import torch._inductor.config as inductor_config

        recorded: list[CompiledGraph] = []
        with (
            _fresh_inductor_cache(),
            inductor_config.patch(dict(self.config_patches)),
            _record_inductor_post_grad(recorded),
        ):
            compiled = torch.compile(built.model, backend="inductor")
            yield Session(run=compiled, graphs=lambda: list(recorded))


@dataclass(frozen=True)
class CommfuseBaseline(Baseline):
    """``backend=commfuse.backend(inner_compiler=inner, passes=passes)``;
    ``passes=None`` is the default pipeline."""

    passes: tuple[str, ...] | None = None
    lowering: str = "commfuse"
    options: tuple[tuple[str, Any], ...] = ()  # further Config fields

    @contextlib.contextmanager
    def session(self, built):
        import commfuse

        kwargs: dict[str, Any] = {
            "inner_compiler": self.inner,
            "group_roles": dict(built.roles),
            "lowering": self.lowering,
        }
        if self.passes is not None:
            kwargs["passes"] = list(self.passes)
        kwargs.update(self.options)
        be = commfuse.backend(**kwargs)

        def graphs() -> list[CompiledGraph]:
            # The pipeline's reports carry the analysis already; the joint
            # graph is not executed (it is partitioned into forward/backward).
            return []

        def reports() -> list[dict[str, Any]]:
            return [r.model_dump(mode="json") for r in be.reports]

        executed: list[CompiledGraph] = []
        with contextlib.ExitStack() as stack:
            if self.uses_inductor:
                stack.enter_context(_fresh_inductor_cache())
            if self.lowering == "inductor":
                stack.enter_context(_record_inductor_post_grad(executed))
            else:
                stack.enter_context(_record_commfuse_lowering(executed))
            yield Session(
                run=torch.compile(built.model, backend=be),
                graphs=graphs,
                pipeline_reports=reports,
                executed_graphs=lambda: list(executed),
            )


# ----------------------------------------------------------------- registry

_BASELINES: dict[str, Baseline] = {}


def register_baseline(baseline: Baseline) -> Baseline:
    if baseline.name in _BASELINES and _BASELINES[baseline.name] != baseline:
        raise ValueError(f"baseline {baseline.name!r} is already registered")
    _BASELINES[baseline.name] = baseline
    return baseline


def _register_builtin() -> None:
    from commfuse.passes import available_passes

    register_baseline(EagerBaseline("eager", "no compilation (eager DTensor)", inner="-"))
    register_baseline(
        InductorBaseline("inductor", "torch.compile default (Inductor)", inner="inductor", uses_inductor=True)
    )
    register_baseline(
        InductorBaseline(
            "inductor+comm",
            "Inductor with its comm passes: reorder_for_compute_comm_overlap, "
            "bucket_{all_gathers,reduce_scatters,all_reduces}_fx='all'",
            inner="inductor",
            uses_inductor=True,
            config_patches=INDUCTOR_COMM_PATCHES,
        )
    )
    register_baseline(
        CommfuseBaseline(
            "commfuse:whole-graph",
            "commfuse default pipeline; Inductor compiles the whole graph and issues "
            "its collectives (lowering='inductor')",
            inner="inductor",
            uses_inductor=True,
            lowering="inductor",
        )
    )
    # torchtitan graph_trainer's expert-parallel split (ep_chunk_pass + ep_overlap_pass: two even
    # chunks, chunk 0's exchange under chunk 1's compute), whatever the cost model says: the
    # exchange partition forced to two chunks, the step-time gate off
    register_baseline(
        CommfuseBaseline(
            "commfuse-eager:ep-two-chunks",
            "expert_exchange_partition forced to two chunks (graph_trainer's split: "
            "Config.workload_chunks=2, step-time gate off), eager inner compiler",
            inner="eager",
            passes=("expert_exchange_partition",),
            options=(("workload_chunks", 2), ("step_time_gate", False)),
        )
    )
    # torchtitan's dropless exchange cut into two column blocks of the hidden dim wherever the
    # pass can, whatever the cost model says (on gloo it predicts no cut faster)
    register_baseline(
        CommfuseBaseline(
            "commfuse-eager:hidden-two-blocks",
            "hidden_exchange_partition forced to two column blocks "
            "(Config.workload_chunks=2), eager inner compiler",
            inner="eager",
            passes=("hidden_exchange_partition",),
            options=(("workload_chunks", 2),),
        )
    )
    for inner in ("inductor", "eager"):
        prefix = "commfuse" if inner == "inductor" else "commfuse-eager"
        register_baseline(
            CommfuseBaseline(
                prefix,
                f"commfuse default pipeline, {inner} inner compiler",
                inner=inner,
                uses_inductor=inner == "inductor",
            )
        )
        register_baseline(
            CommfuseBaseline(
                f"{prefix}:none",
                f"commfuse with no passes, {inner} inner compiler "
                "(the reference single passes are attributed against)",
                inner=inner,
                uses_inductor=inner == "inductor",
                passes=(),
            )
        )
        # One baseline per registered pass, so gains can be attributed; new
        # passes appear here without touching the runner.
        for name in sorted(available_passes()):
            register_baseline(
                CommfuseBaseline(
                    f"{prefix}:{name}",
                    f"commfuse with only pass {name!r}, {inner} inner compiler",
                    inner=inner,
                    uses_inductor=inner == "inductor",
                    passes=(name,),
                )
            )


def get_baseline(name: str) -> Baseline:
    if name not in _BASELINES:
        raise KeyError(f"unknown baseline {name!r}; known: {baseline_names()}")
    return _BASELINES[name]


def baseline_names() -> list[str]:
    return list(_BASELINES)


_register_builtin()


# ----------------------------------------------------------------- gradient accumulation
# Baselines of a training step of ``Built.microbatches`` micro-batches (the ``simple_fsdp_ga`` family).
# They are baselines of their own rather than a mode of the ones above: the others keep their
# one-forward-one-backward step on every workload, and these set ``Session.step`` to the whole
# accumulation step (every micro-batch's forward, loss and backward, then zero_grad). Each
# micro-batch's loss is the module's output (the GA family's model returns it, already normalised
# for summing), so the step is ``sum_i model(*inputs_i)`` back-propagated, whichever compiler runs it.


def _microbatch_inputs(built: Built) -> list[tuple[Any, ...]]:
    from commfuse.train_step_split import split_microbatches

    return split_microbatches(built.inputs, built.microbatches)


def _loop_step(run: Callable[..., Any], built: Built, parts: list[tuple[Any, ...]]) -> Callable[[], None]:
    """The plain accumulation loop a user writes: forward + backward per micro-batch, gradients add up."""

    def step() -> None:
        for xs in parts:
            built.loss(run(*xs)).backward()
        built.model.zero_grad(set_to_none=True)

    return step


@contextlib.contextmanager
def _sync_on_last_microbatch(
    model: torch.nn.Module, last: bool, acc: dict[Any, torch.Tensor]
) -> Iterator[None]:
    """Gradient sync on the last micro-batch only, by hand, for a ``commfuse.models.simple_fsdp`` model.

    SimpleFSDP reduces a gradient in the backward of its parametrization (``ReplicateComputation``:
    the all-gathered weight is handed out as ``to_local(grad_placements=[Partial])``, whose backward
    reduce-scatters). A user who wants DDP's ``no_sync`` / FSDP2's ``set_requires_gradient_sync(False)``
    swaps that forward, per micro-batch:

    * not the last micro-batch (``last=False``): the gathered weight is detached into a leaf that
      requires grad, so the backward reduces nothing; its unsharded gradient is added into ``acc``
      (one buffer per parameter, held from the first micro-batch to the last);
    * the last: the ordinary forward, with a hook adding ``acc`` to the weight's gradient before the
      reduce-scatter, so ONE reduce-scatter per parameter reduces the whole step's gradient.

    Every micro-batch still gathers the weights (as the plain loop does); only the gradient sync moves.
    """
    from torch.distributed.tensor import Replicate

    from commfuse.models.simple_fsdp import ReplicateComputation

    leaves: list[tuple[Any, torch.Tensor]] = []
    patched = [m for m in model.modules() if isinstance(m, ReplicateComputation)]

    def make(rc: ReplicateComputation):
        original = type(rc).forward

        def no_sync(param):
            full = param.redistribute(rc.mesh, [Replicate()]).to_local().detach().requires_grad_()
            leaves.append((rc, full))
            return full

        def sync_with_acc(param):
            full = original(rc, param)
            pending = acc.pop(rc, None)  # added once, at the parameter's first use in the micro-batch
            if pending is not None and full.requires_grad:
                full.register_hook(lambda g, a=pending: g + a)
            return full

        return sync_with_acc if last else no_sync

    for rc in patched:
        rc.forward = make(rc)
    try:
        yield
    finally:
        for rc in patched:
            del rc.forward
        for rc, full in leaves:
            if full.grad is not None:
                acc[rc] = full.grad if rc not in acc else acc[rc] + full.grad


def by_hand_accumulate(built: Built) -> torch.Tensor:
    """Forward + backward of every micro-batch of ``built`` with the gradient sync on the last one
    only (:func:`_sync_on_last_microbatch`); returns the step's loss. Gradients are added into
    ``param.grad`` as the plain loop adds them."""
    acc: dict[Any, torch.Tensor] = {}
    parts = _microbatch_inputs(built)
    total = None
    for i, xs in enumerate(parts):
        with _sync_on_last_microbatch(built.model, i == len(parts) - 1, acc):
            loss = built.loss(built.model(*xs))
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def _by_hand_step(built: Built) -> Callable[[], None]:
    def step() -> None:
        by_hand_accumulate(built)
        built.model.zero_grad(set_to_none=True)

    return step


@dataclass(frozen=True)
class GradAccumBaseline(Baseline):
    """A gradient-accumulation step of ``Built.microbatches`` micro-batches; ``mode``:

    * ``loop``: the plain accumulation loop, the model run eagerly (``inner="-"``) or compiled by
      Inductor (``inner="inductor"``, under ``config_patches``): one forward + backward graph,
      executed once per micro-batch;
    * ``by-hand``: the eager loop with the gradient sync on the last micro-batch only
      (:func:`_sync_on_last_microbatch`);
    * ``commfuse``: ``commfuse.compile_train_step`` (default pipeline): one joint graph for the step.
    """

    mode: str = "loop"
    config_patches: Mapping[str, Any] = field(default_factory=dict)

    @contextlib.contextmanager
    def session(self, built):
        import torch._inductor.config as inductor_config

        import commfuse
        from commfuse.testing.graphs import capture_aot_graphs

        m = built.microbatches
        parts = _microbatch_inputs(built)
        recorded: list[CompiledGraph] = []

        def eager_graphs(syncs: int):
            def graphs() -> list[CompiledGraph]:
                got = capture_aot_graphs(built.model, *parts[0], loss=built.loss)
                fw = [CompiledGraph("forward", got.forward)] if got.forward is not None else []
                bw = [CompiledGraph("backward", got.backward)] if got.backward is not None else []
                # per step: every micro-batch's forward; the backward (and its gradient sync) `syncs` times
                return fw * m + bw * syncs

            return graphs

        with contextlib.ExitStack() as stack:
            if self.uses_inductor:
                stack.enter_context(_fresh_inductor_cache())
                stack.enter_context(inductor_config.patch(dict(self.config_patches)))
            if self.mode == "commfuse":
                stack.enter_context(_record_commfuse_lowering(recorded))
                train = commfuse.compile_train_step(
                    built.model,
                    lambda loss: loss,
                    microbatches=m,
                    reduction="sum",
                    config=commfuse.Config(inner_compiler=self.inner, group_roles=dict(built.roles)),
                )

                def step() -> None:
                    # The step's loss passes through built.loss (the identity for the models of this
                    # family, which return their loss) as each micro-batch's does in the loops, so
                    # that whoever wraps built.loss (the A/B job) sees it.
                    built.loss(train(*built.inputs))
                    built.model.zero_grad(set_to_none=True)

                yield Session(
                    run=built.model,
                    graphs=lambda: [],
                    pipeline_reports=lambda: [r.model_dump(mode="json") for r in train.reports],
                    executed_graphs=lambda: list(recorded),
                    step=step,
                )
            elif self.mode == "by-hand":
                # The collective columns count M forwards and one synced backward; the simulated step
                # would miss the M - 1 backwards without a sync, so it is left out.
                yield Session(
                    run=built.model,
                    graphs=eager_graphs(1),
                    executed_graphs=lambda: [],
                    step=_by_hand_step(built),
                )
            elif self.inner == "inductor":
                stack.enter_context(_record_inductor_post_grad(recorded))
                compiled = torch.compile(built.model, backend="inductor")
                # one forward and one backward graph, each executed once per micro-batch
                yield Session(
                    run=compiled,
                    graphs=lambda: [g for g in recorded for _ in range(m)],
                    step=_loop_step(compiled, built, parts),
                )
            else:
                yield Session(
                    run=built.model, graphs=eager_graphs(m), step=_loop_step(built.model, built, parts)
                )


def _register_grad_accum() -> None:
    register_baseline(
        GradAccumBaseline("ga:eager", "gradient accumulation: the plain loop, eager", inner="-")
    )
    register_baseline(
        GradAccumBaseline(
            "ga:inductor",
            "gradient accumulation: the plain loop over the Inductor-compiled model",
            inner="inductor",
            uses_inductor=True,
        )
    )
    register_baseline(
        GradAccumBaseline(
            "ga:inductor+comm",
            "gradient accumulation: the plain loop over the Inductor-compiled model with its comm passes",
            inner="inductor",
            uses_inductor=True,
            config_patches=INDUCTOR_COMM_PATCHES,
        )
    )
    register_baseline(
        GradAccumBaseline(
            "ga:by-hand",
            "gradient accumulation, eager, gradient sync on the last "
            "micro-batch only (by hand: DDP no_sync style)",
            inner="-",
            mode="by-hand",
        )
    )
    register_baseline(
        GradAccumBaseline(
            "ga:commfuse",
            "gradient accumulation: commfuse.compile_train_step, default pipeline, Inductor inner compiler",
            inner="inductor",
            uses_inductor=True,
            mode="commfuse",
        )
    )
    register_baseline(
        GradAccumBaseline(
            "ga:commfuse-eager",
            "gradient accumulation: commfuse.compile_train_step, default pipeline, eager inner compiler",
            inner="eager",
            mode="commfuse",
        )
    )


_register_grad_accum()
