"""What one GPU can check of commfuse's execution: the runtime on NCCL world size 1, Inductor regions, DHelix.

Each check builds a small TP+SP-style model whose collectives are explicit functional
collectives on the world group (DTensor emits none on a one-rank mesh), runs it compiled and
eagerly, and returns a JSON-able dict: what ran (plans, recorded collectives, stream
operations, compiled regions) and the largest difference to eager. On one rank every
collective is an identity, so compiled and eager must agree to rounding.

* :func:`check_runtime`: ``torch.compile(backend=commfuse.backend(...))`` with the eager inner
  compiler under ``commfuse.record``; then the stream program on its own: a traced graph with one
  branch put on compute stream 1, lowered by ``lower_graph`` (events, ``record_stream``) and run;
* :func:`check_inductor_regions`: ``inner_compiler="inductor", lowering="commfuse"``: which compute
  regions Inductor compiled, which fell back, and the values;
* :func:`check_dhelix`: ``compile_train_step(..., dhelix=True)`` with two micro-batches: the fused
  partition, the forward strand's second compute stream, loss and gradients vs the plain loop.

``device`` and the process group are the caller's (``cuda`` + NCCL on the GPU machine; the CPU
tests run the same code on gloo, where the plan's streams are not applied).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

# The GPU image has no ortools: the CP-SAT refinement of the overlap scheduler stays off.
CONFIG_DEFAULTS: dict[str, Any] = {"schedule_cpsat_max_nodes": 0, "check_agreement": False}


class SPBlock(nn.Module):
    """Megatron TP+SP MLP block: gather the sequence, column- then row-parallel, reduce-scatter back,
    with an all-reduced RMS statistic so all three collective kinds appear (world size 1: identities)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(hidden, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(dim, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        from commfuse.core.torch_private import funcol_autograd

        group = dist.group.WORLD
        # The statistic is detached: the backward of a functional all_reduce differs across torch releases.
        ms = funcol.all_reduce(x.detach().pow(2).mean(-1, keepdim=True), "sum", group) / dist.get_world_size()
        full = funcol_autograd("all_gather")(x * torch.rsqrt(ms + 1e-6), 0, group)
        h = F.silu(full @ self.w1.t()) @ self.w2.t()
        return x + funcol_autograd("reduce_scatter")(h, "sum", 0, group)


class SPModel(nn.Module):
    def __init__(self, n_layers: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SPBlock(dim, hidden) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build(
    device: str, *, n_layers: int = 2, dim: int = 256, hidden: int = 512, tokens: int = 128, seed: int = 0
) -> tuple[SPModel, torch.Tensor, torch.Tensor]:
    """The model (fp32, deterministic weights) with one input and target of ``tokens`` rows."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = SPModel(n_layers, dim, hidden).to(device)
    x = torch.randn(tokens, dim, generator=gen).to(device)
    y = torch.randn(tokens, dim, generator=gen).to(device)
    return model, x, y


def max_abs_diff(a: Any, b: Any) -> float:
    """Largest absolute difference over the tensors of two equally structured values."""
    from torch.utils._pytree import tree_leaves

    diffs = [
        (p.detach().float() - q.detach().float()).abs().max().item()
        for p, q in zip(tree_leaves(a), tree_leaves(b), strict=True)
        if isinstance(p, torch.Tensor)
    ]
    return max(diffs, default=0.0)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _plans(plans: list) -> list[dict[str, Any]]:
    return [
        {
            "graph": p.graph_kind,
            "collectives": len(p.collectives),
            "streams": p.num_streams,
            "events": len(p.events),
            "side_stream_nodes": len(p.node_streams),
        }
        for p in plans
    ]


def _stream_ops(module: torch.fx.GraphModule) -> dict[str, int]:
    """Count of the stream operations (fork, switch, record, wait, keep, join) inserted into a module."""
    counts: dict[str, int] = {}
    for n in module.graph.nodes:
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        if name.startswith("commfuse_stream_"):
            op = name[len("commfuse_stream_") :]
            counts[op] = counts.get(op, 0) + 1
    return counts


def _recorded(rec: Any) -> dict[str, Any]:
    s = rec.summary()
    done = sum(c.done_ns is not None for c in rec.collectives)
    return {
        "collectives": s["collectives"],
        "completed_by_work_callback": done,
        "by_kind": s["by_kind"],
        "overlap_ratio": s["overlap_ratio"],
    }


def _config(**overrides: Any) -> Any:
    import commfuse

    return commfuse.Config(**{**CONFIG_DEFAULTS, **overrides})


def _warnings_of(caught: list) -> list[str]:
    return [str(w.message) for w in caught if "commfuse" in str(w.message)]


def check_runtime(device: str, *, tol: float = 1e-4) -> dict[str, Any]:
    """The compiled model through commfuse's runtime (recorded), then the stream program alone."""
    import commfuse

    model, x, _ = build(device)
    backend = commfuse.backend(_config(inner_compiler="eager"))
    compiled = torch.compile(model, backend=backend)
    with warnings.catch_warnings(record=True) as caught, commfuse.record() as rec:
        warnings.simplefilter("always")
        got = compiled(x)
        _sync(device)
    want = model(x)
    out: dict[str, Any] = {
        "plans": _plans(backend.plans),
        "recorded": _recorded(rec),
        "max_abs_diff": max_abs_diff(got, want),
        "warnings": _warnings_of(caught),
    }
    out["streams"] = check_stream_program(device, tol=tol)
    out["ok"] = (
        out["max_abs_diff"] <= tol
        and any(p["collectives"] for p in out["plans"])
        and out["recorded"]["collectives"] > 0
        and out["streams"]["ok"]
    )
    return out


def _stream_fn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    from commfuse.core.torch_private import funcol_autograd

    group = dist.group.WORLD
    gathered = funcol_autograd("all_gather")(x, 0, group)
    side = torch.relu(x @ w2) * 2.0  # independent of the collective: put on stream 1
    h = gathered @ w1
    return funcol_autograd("reduce_scatter")(h, "sum", 0, group) + side.sum(0, keepdim=True)


def side_stream_nodes(gm: torch.fx.GraphModule) -> list[str]:
    """Compute nodes that depend on no collective: the branch that can run beside it."""
    from commfuse.ir.kinds import collective_spec, is_wait

    tainted: set[str] = set()
    chosen = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        comm = collective_spec(n.target) is not None or is_wait(n.target)
        if comm or any(p.name in tainted for p in n.all_input_nodes):
            tainted.add(n.name)
        else:
            chosen.append(n.name)
    return chosen


def check_stream_program(device: str, *, tol: float = 1e-4) -> dict[str, Any]:
    """A traced graph with its collective-independent branch on stream 1, lowered and run."""
    import commfuse
    from commfuse.core.meta import STREAM_META
    from commfuse.lowering import lower_graph, plan_for
    from torch.fx.experimental.proxy_tensor import make_fx

    gen = torch.Generator().manual_seed(1)
    args = [torch.randn(*s, generator=gen).to(device) for s in ((64, 128), (128, 256), (128, 256))]
    gm = make_fx(_stream_fn, tracing_mode="fake")(*args)
    side = side_stream_nodes(gm)
    for n in gm.graph.nodes:
        if n.name in side:
            n.meta[STREAM_META] = 1
    plan = plan_for(gm, "forward")
    lowered = lower_graph(gm, plan)
    with commfuse.record() as rec:
        got = lowered(*args)
        _sync(device)
    want = gm(*args)
    ops = _stream_ops(lowered.module)
    applied = torch.device(device).type == "cuda"
    out = {
        "side_stream_nodes": side,
        "plan": _plans([plan])[0],
        "stream_ops": ops,
        "streams_applied": applied,
        "recorded": _recorded(rec),
        "max_abs_diff": max_abs_diff(got, want),
    }
    out["ok"] = (
        out["max_abs_diff"] <= tol
        and plan.num_streams == 2
        and bool(plan.events)
        and (not applied or (ops.get("record", 0) > 0 and ops.get("wait", 0) > 0))
    )
    return out


class _RegionLog:
    """Wraps the Inductor region compiler commfuse calls: one entry per region it was handed."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.regions: list[dict[str, Any]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        ops = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        entry = {"nodes": len(gm.graph.nodes), "ops": ops[:12], "compiled": False, "error": None}
        self.regions.append(entry)
        try:
            result = self.inner(gm, example_inputs, **kwargs)
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {e}"[:300]
            raise
        entry["compiled"] = True
        return result


def check_inductor_regions(device: str, *, tol: float = 1e-4) -> dict[str, Any]:
    """Forward and backward through Inductor-compiled regions: regions, fallbacks, values, gradients."""
    import commfuse
    from commfuse.core import torch_private as priv

    model, x, y = build(device, seed=2)
    ref = copy.deepcopy(model)
    backend = commfuse.backend(_config(inner_compiler="inductor", lowering="commfuse"))
    log = _RegionLog(priv.inductor_compile_fx_inner)
    priv.inductor_compile_fx_inner = log
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = torch.compile(model, backend=backend)
            loss = F.mse_loss(compiled(x), y)
            loss.backward()
            _sync(device)
    finally:
        priv.inductor_compile_fx_inner = log.inner
    want = F.mse_loss(ref(x), y)
    want.backward()
    grads = max_abs_diff([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])
    fallbacks = [w for w in _warnings_of(caught) if "eagerly" in w or "could not be lowered" in w]
    out = {
        "plans": _plans(backend.plans),
        "regions": log.regions,
        "regions_compiled": sum(r["compiled"] for r in log.regions),
        "fallbacks": fallbacks,
        "loss_abs_diff": abs(loss.item() - want.item()),
        "grad_max_abs_diff": grads,
        "warnings": _warnings_of(caught),
    }
    out["ok"] = (
        out["regions_compiled"] > 0
        and not fallbacks
        and any(p["collectives"] for p in out["plans"])
        and out["loss_abs_diff"] <= tol
        and grads <= tol
    )
    return out


def plain_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int) -> torch.Tensor:
    """The reference: ``m`` micro-batches, each loss divided by ``m`` and back-propagated into ``.grad``."""
    total = torch.zeros((), device=x.device)
    for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
        loss = F.mse_loss(model(xi), yi) / m
        loss.backward()
        total = total + loss.detach()
    return total


def check_dhelix(device: str, *, microbatches: int = 2, tol: float = 1e-4) -> dict[str, Any]:
    """The DHelix-interleaved fused train step: partition, strands' streams, loss and gradients."""
    import commfuse

    model, x, y = build(device, n_layers=2, seed=3, tokens=256)
    ref = copy.deepcopy(model)
    want = plain_loop(ref, x, y, microbatches)
    step = commfuse.compile_train_step(
        model, F.mse_loss, microbatches=microbatches, config=_config(inner_compiler="eager", dhelix=True)
    )
    with warnings.catch_warnings(record=True) as caught, commfuse.record() as rec:
        warnings.simplefilter("always")
        got = step(x, targets=y)
        _sync(device)
    decisions = [
        d
        for r in step.reports
        if r.graph == "forward"
        for p in r.passes
        if p.name == "dhelix_interleave"
        for d in p.decisions
    ]
    kept = decisions[0].get("kept") if decisions else None
    grads = max_abs_diff([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])
    plans = _plans(step.backend.plans)
    out = {
        "partitions": list(step.backend.partitions),
        "kept": kept,
        "plans": plans,
        "recorded": _recorded(rec),
        "loss_abs_diff": max_abs_diff(got, want),
        "grad_max_abs_diff": grads,
        "warnings": _warnings_of(caught),
    }
    two_streams = any(p["streams"] == 2 and p["events"] and p["collectives"] for p in plans)
    out["ok"] = (
        out["partitions"] == ["fused"]
        and kept == "interleaved"
        and two_streams
        and out["loss_abs_diff"] <= tol
        and grads <= tol
    )
    return out


CHECKS: dict[str, Callable[[str], dict[str, Any]]] = {
    "runtime": check_runtime,
    "inductor_regions": check_inductor_regions,
    "dhelix": check_dhelix,
}

__all__ = [
    "CHECKS",
    "SPModel",
    "build",
    "check_dhelix",
    "check_inductor_regions",
    "check_runtime",
    "check_stream_program",
    "max_abs_diff",
    "plain_loop",
    "side_stream_nodes",
]
