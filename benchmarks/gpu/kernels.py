"""Kernel-time calibration: the compute model's prediction per ATen node against its measured GPU time.

The workload is one 8B-class transformer layer in bf16 (Llama 3 8B sizes: dim 4096, 32 heads,
SwiGLU hidden 14336; the example Llama has no grouped-query attention, so K and V have 32 heads
too), batch 1 x ``seq`` tokens. Its forward and backward ATen graphs are captured through
AOTAutograd on the GPU (each node keeps its fake value: shape, dtype, strides). Every compute
node is then run alone on fresh random inputs of those shapes and timed with CUDA events
(median over repeats, each repeat ``reps`` back-to-back launches), and priced by
``AnalyticCostModel(topology).compute_estimate(node)`` for the topology preset of this device.

The measured times are then fitted (:func:`fit_compute_params`: per family ``a + b x FLOPs`` or
``x bytes``, the form ``commfuse calibrate`` fits on CPU) and the fit is checked on a held-out
size (another sequence length, captured and timed anew): predicted by the nominal model and by
the fitted one against what the GPU took. The fit is what a GPU cost profile's ``compute`` holds.

Pure parts (tested on CPU): :func:`aggregate` (per op family: count, predicted and measured sums,
ratio measured / predicted, median per-op ratio; totals per graph and overall),
:func:`fit_compute_params` and :func:`materialize` (a random tensor for a fake value). Views and free ops are not timed (the
model prices them at 0; on a GPU they launch no kernel).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch

LAYER_8B = {"dim": 4096, "n_heads": 32, "ffn_dim": 14336}


@dataclass
class NodeTiming:
    """One compute node: what the model predicts and what the GPU took (None: not measured)."""

    graph: str
    node: str
    op: str
    family: str
    bound: str
    flops: int
    bytes: int
    predicted_us: float
    measured_us: Optional[float] = None
    error: Optional[str] = None


def _ratio(measured: float, predicted: float) -> Optional[float]:
    return measured / predicted if predicted > 0 else None


def _summary(rows: list[NodeTiming]) -> dict[str, Any]:
    timed = [r for r in rows if r.measured_us is not None]
    pred = sum(r.predicted_us for r in timed)
    meas = sum(r.measured_us for r in timed)  # type: ignore[misc]
    per_op = [r.measured_us / r.predicted_us for r in timed if r.predicted_us > 0]  # type: ignore[operator]
    return {
        "count": len(rows),
        "timed": len(timed),
        "predicted_us": pred,
        "measured_us": meas,
        "ratio": _ratio(meas, pred),
        "median_op_ratio": statistics.median(per_op) if per_op else None,
    }


def aggregate(rows: list[NodeTiming]) -> dict[str, Any]:
    """Predicted vs measured per op family, per graph and overall (ratio = measured / predicted)."""
    families: dict[str, list[NodeTiming]] = {}
    graphs: dict[str, list[NodeTiming]] = {}
    for r in rows:
        families.setdefault(r.family, []).append(r)
        graphs.setdefault(r.graph, []).append(r)
    return {
        "families": {f: _summary(rs) for f, rs in sorted(families.items())},
        "graphs": {g: _summary(rs) for g, rs in graphs.items()},
        "overall": _summary(rows),
        "errors": [f"{r.graph}/{r.node} ({r.op}): {r.error}" for r in rows if r.error],
    }


def fit_compute_params(rows: list[NodeTiming]):
    """The compute model's calibration (``ComputeParams``) fitted to the timed ``rows``: per family
    ``a_us + b x unit`` (FLOPs for matmul and attention, bytes otherwise) on relative error."""
    from commfuse.tools.calibrate import FLOP_FAMILIES, Sample, fit_compute

    samples = [
        Sample(r.family, float(r.flops if r.family in FLOP_FAMILIES else r.bytes), [r.measured_us])
        for r in rows
        if r.measured_us is not None and r.measured_us > 0
    ]
    return fit_compute(samples)


def materialize(val: Any, device: Any, gen: torch.Generator) -> Any:
    """A real value shaped like the fake ``val`` on ``device`` (host values stay on the host): random
    floats (std 0.1, which keeps exp/rsqrt finite; ``gen`` where it is on the same device type),
    zeros for integers and booleans, with the fake tensor's strides. Non-tensors pass through."""
    if not isinstance(val, torch.Tensor):
        return val
    size, stride = tuple(int(s) for s in val.shape), tuple(int(s) for s in val.stride())
    dev = device if val.device.type != "cpu" else "cpu"
    out = torch.empty_strided(size, stride, dtype=val.dtype, device=dev)
    if val.dtype.is_floating_point:
        # Fill the whole storage the strides span (it may be larger than numel), on the device
        # itself: generating GiBs of inputs on the host would take longer than timing the ops.
        flat = out.as_strided((out.untyped_storage().nbytes() // out.element_size(),), (1,))
        flat.normal_(0.0, 0.1, generator=gen if gen.device.type == out.device.type else None)
    else:
        out.zero_()
    return out


def _real_args(node: torch.fx.Node, device: Any, gen: torch.Generator) -> tuple[list, dict]:
    from torch.utils._pytree import tree_map

    def real(a: Any) -> Any:
        return materialize(a.meta.get("val"), device, gen) if isinstance(a, torch.fx.Node) else a

    return tree_map(real, list(node.args)), tree_map(real, dict(node.kwargs))


def time_call(fn: Callable[[], Any], *, reps: int, repeats: int) -> float:
    """Median over ``repeats`` of the CUDA-event time of ``reps`` back-to-back calls, per call (us)."""
    fn()  # warm-up: lazy initialisation, cuBLAS handles, autotuning of the library
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def capture_layer(
    seq: int,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    sizes: Optional[dict[str, int]] = None,
) -> list[tuple[str, torch.fx.GraphModule]]:
    """Forward and backward ATen graphs of one Llama layer (AOTAutograd, default partition)."""
    from commfuse.core import torch_private as priv
    from commfuse.models.llama import TransformerBlock

    sizes = sizes or LAYER_8B
    graphs: list[tuple[str, torch.fx.GraphModule]] = []

    def keep(kind: str):
        def compiler(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
            graphs.append((kind, gm))
            return priv.make_boxed_func(gm.forward)

        return compiler

    layer = TransformerBlock(sizes["dim"], sizes["n_heads"], sizes["ffn_dim"]).to(device=device, dtype=dtype)
    backend = priv.aot_autograd(
        fw_compiler=keep("forward"), bw_compiler=keep("backward"), partition_fn=priv.default_partition
    )
    x = torch.randn(1, seq, sizes["dim"], device=device, dtype=dtype, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    compiled(x).float().pow(2).mean().backward()
    return graphs


def wall_time_call(fn: Callable[[], Any], *, reps: int, repeats: int) -> float:
    """:func:`time_call` by the host clock, for a CPU run of the same code (no CUDA events there)."""
    import time

    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t) * 1e6 / reps)
    return statistics.median(times)


Timer = Callable[..., float]


def time_graph_nodes(
    graphs: list[tuple[str, torch.fx.GraphModule]],
    estimator: Any,
    device: Any,
    *,
    reps: int = 5,
    repeats: int = 5,
    seed: int = 0,
    timer: Timer = time_call,
) -> list[NodeTiming]:
    """Every non-free compute node of ``graphs``, predicted and measured alone (see the module docstring);
    ``timer(fn, reps=, repeats=)`` measures (CUDA events by default)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = []
    for kind, gm in graphs:
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            est = estimator.compute_estimate(n)
            if est.family in ("free", "view"):
                continue
            row = NodeTiming(
                kind, n.name, str(n.target), est.family, est.bound, est.flops, est.bytes, est.time_us
            )
            try:
                args, kwargs = _real_args(n, device, gen)
                row.measured_us = timer(lambda: n.target(*args, **kwargs), reps=reps, repeats=repeats)  # noqa: B023 - timed now
            except Exception as e:  # noqa: BLE001 - one op that cannot run alone must not lose the others
                row.error = f"{type(e).__name__}: {e}"[:200]
            finally:
                args = kwargs = None  # free this node's inputs before the next
            rows.append(row)
    return rows


def time_graphs(
    graphs: list[tuple[str, torch.fx.GraphModule]],
    device: Any,
    *,
    reps: int = 3,
    repeats: int = 3,
    seed: int = 1,
    timer: Timer = time_call,
) -> dict[str, Any]:
    """Each whole graph run on random inputs (us): the sum of the nodes alone omits nothing it does."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, Any] = {}
    for kind, gm in graphs:
        try:
            args = [
                materialize(n.meta.get("val"), device, gen) for n in gm.graph.nodes if n.op == "placeholder"
            ]
            out[kind] = timer(lambda: gm(*args), reps=reps, repeats=repeats)  # noqa: B023 - timed now
        except Exception as e:  # noqa: BLE001 - reported next to the per-node numbers
            out[kind] = f"{type(e).__name__}: {e}"[:200]
    return out


def predict_graph_nodes(graphs: list[tuple[str, torch.fx.GraphModule]], estimator: Any) -> list[float]:
    """``estimator``'s time (us) of every node :func:`time_graph_nodes` times, in the same order."""
    out = []
    for _kind, gm in graphs:
        for n in gm.graph.nodes:
            if n.op == "call_function":
                est = estimator.compute_estimate(n)
                if est.family not in ("free", "view"):
                    out.append(est.time_us)
    return out


def holdout_check(
    graphs: list[tuple[str, torch.fx.GraphModule]],
    nominal: Any,
    fitted: Any,
    device: Any,
    *,
    timer: Timer = time_call,
) -> dict[str, Any]:
    """Nodes of ``graphs`` (not those the fit saw) timed once and predicted by both models."""
    rows = time_graph_nodes(graphs, fitted, device, timer=timer)
    nominal_rows = [
        NodeTiming(**{**asdict(r), "predicted_us": p})
        for r, p in zip(rows, predict_graph_nodes(graphs, nominal), strict=True)
    ]
    return {"nominal": aggregate(nominal_rows), "fitted": aggregate(rows)}


def calibrate_layer(
    device_name: str,
    *,
    seq: int = 4096,
    device: str = "cuda",
    sizes: Optional[dict[str, int]] = None,
    holdout_seq: Optional[int] = None,
) -> dict[str, Any]:
    """The whole calibration on this GPU: capture, predict, measure, aggregate, fit, and check the fit
    on ``holdout_seq`` tokens (``seq // 2`` by default). On another ``device`` (a CPU smoke run of the
    same code) the host clock measures and the dtype is fp32."""
    from commfuse.costmodel.analytic import AnalyticCostModel
    from commfuse.costmodel.topology import PRESETS, Topology

    preset = Topology.preset_for_device(device_name)
    note = None
    if preset is None or preset == "cpu-gloo":
        note = f"device {device_name!r} matches no GPU preset: predictions use dgx-h100"
        preset = "dgx-h100"
    elif preset == "dgx-h100" and "h200" in device_name.lower():
        note = "an H200 is predicted with the dgx-h100 preset's H100 figures (its HBM3e is faster)"
    topology = Topology(**{**PRESETS[preset], "name": preset, "ranks_per_node": 1, "num_nodes": 1})
    estimator = AnalyticCostModel(topology)
    cuda = torch.device(device).type == "cuda"
    dtype, timer = (torch.bfloat16, time_call) if cuda else (torch.float32, wall_time_call)
    sizes = sizes or LAYER_8B
    graphs = capture_layer(seq, device, dtype, sizes)
    rows = time_graph_nodes(graphs, estimator, device, timer=timer)
    agg = aggregate(rows)
    whole = time_graphs(graphs, device, timer=timer)
    top = sorted((r for r in rows if r.measured_us is not None), key=lambda r: -r.measured_us)[:15]
    fitted = fit_compute_params(rows)
    holdout_seq = holdout_seq or max(1, seq // 2)
    holdout = holdout_check(
        capture_layer(holdout_seq, device, dtype, sizes),
        estimator,
        AnalyticCostModel(topology, compute_params=fitted),
        device,
        timer=timer,
    )
    return {
        "layer": {
            **sizes,
            "seq": seq,
            "batch": 1,
            "dtype": str(dtype).removeprefix("torch."),
            "kv_heads": sizes["n_heads"],
        },
        "preset": preset,
        "device_model": {
            k: PRESETS[preset][k] for k in ("device", "peak_tflops_bf16", "memory_bandwidth_GBps")
        },
        "note": note,
        "timer": "CUDA events" if cuda else "host clock",
        **agg,
        "whole_graph_measured_us": whole,
        "top_ops": [asdict(r) for r in top],
        "nodes": [asdict(r) for r in rows],
        "fitted_compute": fitted.model_dump(mode="json"),
        "holdout": {"seq": holdout_seq, **holdout},
    }


__all__ = [
    "LAYER_8B",
    "NodeTiming",
    "aggregate",
    "calibrate_layer",
    "capture_layer",
    "fit_compute_params",
    "holdout_check",
    "materialize",
    "predict_graph_nodes",
    "time_call",
    "time_graph_nodes",
    "time_graphs",
    "wall_time_call",
]
