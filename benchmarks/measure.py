"""The job every gloo rank runs for one workload x baseline, and what it returns.

:func:`measure` (module level: the rank pool pickles it by reference) builds
the workload on this rank, applies the baseline and then, in this order:

1. one *first* step (forward + loss + backward), which includes compilation;
2. ``warmup`` untimed-for-the-median steps, then ``steps`` timed steps. Every
   step starts after a ``dist.barrier()`` so the ranks start together; the
   parent takes, per step, the slowest rank (that is when the step is over);
3. one more step under ``torch.profiler`` with ``profile_memory=True``: the
   peak of the running sum of the CPU allocator's allocation/free events,
   relative to the start of the step (the CPU analogue of
   ``torch.cuda.max_memory_allocated`` after a reset; gradients created by
   the step count, memory held before the step does not);
4. the collectives of the graphs the baseline executed, from
   ``commfuse.analyze`` (or the commfuse pipeline's own reports);
5. on rank 0 only (SPMD: every rank has the same graphs), the simulated step
   time of those graphs on two DGX-H100 nodes (``benchmarks.simulated``).

A step is forward + backward with gradients dropped afterwards (no
optimizer): the optimizer is not compiled by any baseline and would only
dilute the differences.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.baselines import CompiledGraph, Session, get_baseline
from benchmarks.workloads import Built, get_workload

__all__ = ["GraphCollectives", "KindTotals", "RankMeasurement", "measure", "step_of", "warm_up"]

# Graph kinds that are executed; the joint graph is only an intermediate.
EXECUTED_GRAPHS = ("forward", "backward", "inference")


@dataclass
class KindTotals:
    """Collectives of one kind in one graph: count and bytes per rank.

    ``logged_bytes`` follows NCCL's count semantics, ``wire_bytes`` what one
    rank sends under ring conventions (``commfuse.ir.volume``). A string is
    a symbolic size (dynamic shapes)."""

    count: int = 0
    logged_bytes: int | str | None = 0
    wire_bytes: int | str | None = 0


@dataclass
class GraphCollectives:
    """What ``commfuse.analyze`` saw in one executed graph."""

    graph: str
    num_nodes: int
    by_kind: dict[str, KindTotals]
    total: KindTotals
    # c10d op -> count for ops the IR does not recognise (their bytes are not
    # in the totals); None when the graph was not available to check.
    unrecognised: dict[str, int] | None = None


@dataclass
class RankMeasurement:
    """Raw numbers from one rank; the parent turns the ranks' lists into metrics."""

    rank: int
    world_size: int
    first_step_s: float
    step_s: list[float]
    peak_alloc_bytes: int | None
    graphs: list[GraphCollectives] = field(default_factory=list)
    pipeline_reports: list[dict[str, Any]] = field(default_factory=list)
    torch_threads: int = 1
    # benchmarks.simulated: the executed graphs simulated on DGX-H100 x2 (rank 0 only;
    # None elsewhere or when not available, with the reason in sim_note)
    sim_step_us: float | None = None
    sim_note: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _timed(step: Callable[[], None]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Point file descriptor 2 at /dev/null (C++ writes bypass sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _peak_alloc_bytes(step: Callable[[], None]) -> int | None:
    """Peak bytes held by the CPU allocator during ``step``, above its start level."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    # Kineto prints a start/stop line to stderr per session; silence just
    # those two calls, not the step.
    with _quiet_stderr():
        prof.__enter__()
    try:
        step()
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    if not events:
        return None
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()  # negative for frees
        peak = max(peak, current)
    return int(peak)


def _totals(t: Any) -> KindTotals:
    return KindTotals(count=t.count, logged_bytes=t.logged_bytes, wire_bytes=t.wire_bytes)


def _collectives_from_analysis(analysis: Any) -> GraphCollectives:
    return GraphCollectives(
        graph=analysis.graph,
        num_nodes=analysis.num_nodes,
        by_kind={k: _totals(v) for k, v in analysis.by_kind.items()},
        total=_totals(analysis.total),
    )


def _unrecognised(gm: Any) -> dict[str, int]:
    """c10d ops in ``gm`` the IR has no spec for (e.g. an op a bucketing pass emits)."""
    from commfuse.ir import collective_spec, is_wait

    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        name = str(n.target)
        if (
            n.op == "call_function"
            and name.startswith(_C10D_NAMESPACES)
            and collective_spec(n.target) is None
            and not is_wait(n.target)
        ):
            out[name] = out.get(name, 0) + 1
    return out


_C10D_NAMESPACES = ("_c10d_functional.", "_c10d_functional_autograd.", "c10d.", "_dtensor.")


def _analyse(graphs: list[CompiledGraph]) -> list[GraphCollectives]:
    import commfuse

    out = []
    for g in graphs:
        summary = _collectives_from_analysis(commfuse.analyze(g.gm, graph=g.kind))
        summary.unrecognised = _unrecognised(g.gm)
        out.append(summary)
    return out


def _step_fn(run: Callable[..., Any], built: Built) -> Callable[[], None]:
    def step() -> None:
        out = run(*built.inputs)
        built.loss(out).backward()
        built.model.zero_grad(set_to_none=True)

    return step


def step_of(session: Session, built: Built) -> Callable[[], None]:
    """The training step of ``session`` on ``built``: the baseline's own ``session.step``
    where it has one (e.g. several micro-batches per step), else one ``run`` + loss + backward."""
    return session.step if session.step is not None else _step_fn(session.run, built)


def measure(workload: str, baseline: str, warmup: int, steps: int) -> RankMeasurement:
    """Measure ``baseline`` on ``workload`` on this rank (see the module docstring)."""
    # Deep-copying graphs for capture trips a pytree deprecation warning in
    # torch 2.13 (per graph, per rank); it says nothing about the benchmark.
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    built = get_workload(workload).build(world, rank)
    with get_baseline(baseline).session(built) as session:
        step = step_of(session, built)
        first = _timed(step)
        for _ in range(warmup):
            _timed(step)
        times = [_timed(step) for _ in range(steps)]
        peak = _peak_alloc_bytes(step)
        reports = session.pipeline_reports()
        executed = session.graphs()
        graphs = _analyse(executed)
        sim_us, sim_note = None, "computed on rank 0"
        if rank == 0:
            if session.executed_graphs is not None:
                executed = session.executed_graphs()
            sim_us, sim_note = _simulated(executed)
    # commfuse baselines: the pipeline already analysed the graphs it handed
    # to the inner compiler.
    for r in reports:
        if r.get("graph") in EXECUTED_GRAPHS and r.get("analysis"):
            a = r["analysis"]
            graphs.append(
                GraphCollectives(
                    graph=r["graph"],
                    num_nodes=a["num_nodes"],
                    by_kind={k: KindTotals(**v) for k, v in a["by_kind"].items()},
                    total=KindTotals(**a["total"]),
                )
            )
    # The full per-collective listing is large; the reports keep what the
    # passes did (per-pass seconds, counts, refusals, errors) and the totals.
    slim = [
        {
            "graph": r.get("graph"),
            "passes": r.get("passes", []),
            "skipped_reason": r.get("skipped_reason"),
            "input_problems": r.get("input_problems", []),
        }
        for r in reports
    ]
    return RankMeasurement(
        rank=rank,
        world_size=world,
        first_step_s=first,
        step_s=times,
        peak_alloc_bytes=peak,
        graphs=graphs,
        pipeline_reports=slim,
        torch_threads=torch.get_num_threads(),
        sim_step_us=sim_us,
        sim_note=sim_note,
    )


def _simulated(graphs: list[CompiledGraph]) -> tuple[float | None, str]:
    """The DGX-H100 x2 simulated step of ``graphs``; a failure is reported, never fatal."""
    from benchmarks.simulated import simulate_dgx_step

    try:
        return simulate_dgx_step(graphs)
    except Exception as exc:  # noqa: BLE001 - the measurement must not be lost to the simulation
        return None, f"simulation failed: {type(exc).__name__}: {exc}"


def warm_up(with_inductor: bool) -> None:
    """Pay one-time costs (imports of Dynamo/AOTAutograd/DTensor tracing, Inductor's
    C++ toolchain start-up) before anything is measured, so that they do not
    land on whichever baseline happens to run first."""
    from benchmarks.workloads import _build_llama_tp_sp

    names = ["commfuse-eager:none"] + (["inductor"] if with_inductor else [])
    for name in names:
        torch._dynamo.reset()
        built = _build_llama_tp_sp(
            dist.get_world_size(), dist.get_rank(), n_layers=1, dim=16, n_heads=4, ffn_dim=32, batch=1, seq=4
        )
        with get_baseline(name).session(built) as session:
            _step_fn(session.run, built)()
