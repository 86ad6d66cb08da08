"""Compile-time scaling: the commfuse pipeline on Llama TP+SP graphs of growing depth.

One *point* is one (layers, mode) pair, measured in a fresh Python process
with a fresh, empty Inductor cache directory (so every compile is cold and
nothing one point compiled helps the next), one intra-op thread and
``TORCHINDUCTOR_COMPILE_THREADS=1`` (as in the gloo ranks). A tiny 1-layer
model is compiled first (in a throw-away cache) so that one-time imports do
not count as compile time. The process
group is ``commfuse.testing.fake_pg.fake_process_group(world)``: graphs of a
``world``-rank TP+SP run, no communication.

Modes (``MODES``):

* ``commfuse-eager``: ``commfuse.backend(inner_compiler="eager")``; the stage
  split is exact: capture, commfuse pipeline (per pass), rest.
* ``commfuse``: ``commfuse.backend()`` -- the default pipeline inside Inductor
  (joint graph + post-grad graphs); "rest" is then Inductor's lowering and
  codegen.
* ``inductor``: ``torch.compile(backend="inductor")``, Inductor's own compile
  time for the same model.

Stages of a commfuse point, from time stamps taken around every
``Pipeline.run`` the backend makes:

* ``capture_s``: Dynamo + AOTAutograd up to the joint graph (start of the
  first call to the start of the first pipeline run);
* ``pipeline_s``: the sum of the pipeline runs (joint, forward, backward),
  i.e. everything commfuse adds: IR builds, verifier, passes, analysis report;
* ``passes_s``: per pass, its ``PassRecord.seconds`` summed over the graphs;
* ``ir_build_s``: one ``CollectiveIR`` build of each of those graphs, timed
  separately after the compile (the pipeline builds it at least once per graph);
* ``rest_s``: first call minus capture, pipeline and one steady step:
  partitioning and lowering (Inductor codegen + C++ compile for ``commfuse``).

``compile_s`` of every mode is the first call (forward + backward) minus the
median of three steady steps.

Run one point by hand: ``python -m benchmarks.scaling --layers 8 --mode commfuse-eager``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["MODES", "ScalingPoint", "growth_exponent", "measure_point", "run_scaling"]

MODES = ("commfuse-eager", "commfuse", "inductor")
# TP+SP Llama blocks at LlamaConfig's default widths; batch x seq divisible by 8 ranks.
BATCH, SEQ = 2, 64
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ScalingPoint:
    layers: int
    mode: str
    world_size: int
    first_call_s: float | None = None
    steady_step_s: float | None = None
    compile_s: float | None = None
    capture_s: float | None = None
    pipeline_s: float | None = None
    passes_s: dict[str, float] = field(default_factory=dict)
    ir_build_s: float | None = None
    rest_s: float | None = None
    graph_nodes: dict[str, int] = field(default_factory=dict)
    collectives: int | None = None
    warmup_s: float | None = None  # the tiny warm-up compile (not part of any number above)
    load_avg_1m: float | None = None  # machine load after the point (shared machines inflate times)
    wall_s: float | None = None  # the whole subprocess, start-up included
    error: str | None = None


def _timed_backend(inner: str):
    """A commfuse backend that time-stamps every pipeline run (and keeps the graphs)."""
    import commfuse
    from commfuse.backend import CommfuseBackend

    class TimedBackend(CommfuseBackend):
        def __init__(self) -> None:
            super().__init__(commfuse.Config(inner_compiler=inner))
            self.runs: list[tuple[str, float, float, Any]] = []

        def _pipeline(self):
            pipeline = super()._pipeline()
            run = pipeline.run

            def timed(gm, *, graph_kind, stages):
                t0 = time.perf_counter()
                report = run(gm, graph_kind=graph_kind, stages=stages)
                self.runs.append((graph_kind, t0, time.perf_counter(), gm))
                return report

            pipeline.run = timed  # type: ignore[method-assign]
            return pipeline

    return TimedBackend()


def _warm_up(mesh: Any, backend: str) -> None:
    """Pay this fresh process's one-time costs (imports, DTensor tracing paths,
    Inductor's C++ toolchain start-up) on a tiny 1-layer model, in a separate
    throw-away Inductor cache, so the measured compile is cold but not a
    process start-up. Private: ``torch._inductor.utils.fresh_cache``."""
    import torch
    from torch._inductor.utils import fresh_cache

    from commfuse.models import llama

    cfg = llama.LlamaConfig(n_layers=1, dim=16, n_heads=8, ffn_dim=16)
    model = llama.parallelize_llama(llama.build_llama(cfg, seed=0), mesh, sequence_parallel=True)
    data = llama.make_inputs(cfg, 1, 8, rank=0, world_size=mesh.size(), seed=1)
    with fresh_cache():
        llama.loss_fn(torch.compile(model, backend=backend)(data.inputs), data).backward()
    torch._dynamo.reset()


def measure_point(layers: int, mode: str, world: int) -> ScalingPoint:
    """Measure one point in this process (normally a fresh one: see :func:`run_scaling`)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from commfuse.ir import CollectiveIR
    from commfuse.models import llama
    from commfuse.testing.fake_pg import fake_process_group

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {MODES}")
    torch.set_num_threads(1)
    point = ScalingPoint(layers, mode, world)
    with fake_process_group(world):
        mesh = init_device_mesh("cpu", (world,))
        t = time.perf_counter()
        _warm_up(mesh, "aot_eager" if mode == "commfuse-eager" else "inductor")
        point.warmup_s = time.perf_counter() - t
        cfg = llama.LlamaConfig(n_layers=layers)
        model = llama.parallelize_llama(llama.build_llama(cfg, seed=0), mesh, sequence_parallel=True)
        data = llama.make_inputs(cfg, BATCH, SEQ, rank=0, world_size=world, seed=1)
        backend: Any = (
            "inductor"
            if mode == "inductor"
            else _timed_backend("eager" if mode == "commfuse-eager" else "inductor")
        )
        compiled = torch.compile(model, backend=backend)

        def step() -> None:
            llama.loss_fn(compiled(data.inputs), data).backward()
            model.zero_grad(set_to_none=True)

        t0 = time.perf_counter()
        step()
        point.first_call_s = time.perf_counter() - t0
        steady = []
        for _ in range(3):
            t = time.perf_counter()
            step()
            steady.append(time.perf_counter() - t)
        point.steady_step_s = statistics.median(steady)
        point.compile_s = point.first_call_s - point.steady_step_s
        if mode == "inductor":
            return point
        runs = backend.runs
        point.capture_s = runs[0][1] - t0 if runs else None
        point.pipeline_s = sum(end - start for _, start, end, _ in runs)
        for report in backend.reports:
            for record in report.passes:
                point.passes_s[record.name] = point.passes_s.get(record.name, 0.0) + record.seconds
        ir_s = 0.0
        for kind, _, _, gm in runs:
            point.graph_nodes[kind] = len(gm.graph.nodes)
            t = time.perf_counter()
            CollectiveIR(gm)
            ir_s += time.perf_counter() - t
        point.ir_build_s = ir_s
        point.collectives = sum(
            r.analysis.total.count
            for r in backend.reports
            if r.analysis is not None and r.graph in ("forward", "backward")
        )
        if point.capture_s is not None:
            point.rest_s = point.compile_s - point.capture_s - point.pipeline_s
    return point


def run_scaling(
    plan: tuple[tuple[str, tuple[int, ...]], ...],
    world: int,
    timeout_s: float = 1800.0,
    log: Callable[[str], None] = print,
) -> list[ScalingPoint]:
    """Every point of ``plan`` ((mode, layer counts) pairs) in its own fresh
    process with a fresh Inductor cache."""
    points = []
    for mode, layers in plan:
        for n in layers:
            with tempfile.TemporaryDirectory(prefix="commfuse-bench-scaling-") as tmp:
                out = Path(tmp) / "point.json"
                env = dict(
                    os.environ,
                    TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"),
                    TORCHINDUCTOR_COMPILE_THREADS="1",
                    PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
                )
                cmd = [
                    sys.executable,
                    "-m",
                    "benchmarks.scaling",
                    "--layers",
                    str(n),
                    "--mode",
                    mode,
                    "--world",
                    str(world),
                    "--out",
                    str(out),
                ]
                t = time.perf_counter()
                try:
                    proc = subprocess.run(
                        cmd, cwd=REPO_ROOT, env=env, timeout=timeout_s, capture_output=True, text=True
                    )
                    if out.exists():
                        point = ScalingPoint(**json.loads(out.read_text()))
                    else:
                        point = ScalingPoint(
                            n, mode, world, error=f"exit {proc.returncode}: {proc.stderr[-2000:]}"
                        )
                except subprocess.TimeoutExpired:
                    point = ScalingPoint(n, mode, world, error=f"timed out after {timeout_s:.0f} s")
                point.wall_s = time.perf_counter() - t
                point.load_avg_1m = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            log(
                f"scaling {mode:15s} {n:3d} layers: "
                + (
                    f"compile {point.compile_s:.1f} s, pipeline {point.pipeline_s or 0:.2f} s"
                    if point.error is None
                    else f"FAILED {point.error.splitlines()[-1] if point.error else ''}"
                )
            )
            points.append(point)
    return points


def growth_exponent(xs: list[int], ys: list[float]) -> float | None:
    """Least-squares slope of log(y) on log(x): 1.0 is linear growth, 2.0 quadratic."""
    pairs = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y and y > 0]
    if len(pairs) < 2:
        return None
    mx = sum(p[0] for p in pairs) / len(pairs)
    my = sum(p[1] for p in pairs) / len(pairs)
    den = sum((p[0] - mx) ** 2 for p in pairs)
    return None if den == 0 else sum((p[0] - mx) * (p[1] - my) for p in pairs) / den


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--out", type=Path, help="write the point as JSON here (default: print)")
    args = ap.parse_args(argv)
    try:
        point = measure_point(args.layers, args.mode, args.world)
    except Exception:  # noqa: BLE001 - the parent records the failure and goes on
        point = ScalingPoint(args.layers, args.mode, args.world, error=traceback.format_exc())
    text = json.dumps(dataclasses.asdict(point), indent=2)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0 if point.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
