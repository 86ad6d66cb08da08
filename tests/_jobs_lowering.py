"""Rank-pool jobs for the lowering tests (module-level so the pool can pickle them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from commfuse.core.torch_private import register_process_group_alias
from commfuse.lowering import lower_runtime, record
from commfuse.lowering.plan import SETTING_META

POOL_ALIAS = "commfuse.test.pool-alias"


def _every_issuer(x: torch.Tensor, y: torch.Tensor):
    """Each collective the runtime issues natively, with compute between them."""
    g = dist.group.WORLD
    n = dist.get_world_size()
    a = funcol.all_reduce(x, "sum", g)
    b = funcol.all_reduce(torch.tanh(x), "avg", g)
    c = funcol.all_gather_tensor(x * 2, 0, g)
    d = funcol.reduce_scatter_tensor(y, "sum", 0, g)
    e = funcol.reduce_scatter_tensor(y + 1, "avg", 0, g)
    f = funcol.all_to_all_single(y, None, None, g)
    h = funcol.all_to_all_single(y[: 2 * n], [2] * n, [2] * n, g)  # explicit splits
    i = funcol.broadcast(x, n - 1, g)
    j = funcol.all_reduce_coalesced([x, y], "avg", g)
    k = funcol.all_gather_into_tensor_coalesced([x, y], g)
    m = funcol.reduce_scatter_tensor_coalesced([y, y * 3], "sum", [0, 0], g)
    return a, b, c, d, e, f, h, i, *j, *k, *m


def lowered_matches_functional() -> dict[str, Any]:
    """The runtime-lowered graph gives the functional graph's values; with a Lagom pool
    alias set on one collective, that collective is issued on the alias (recorded)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 6, generator=gen), torch.randn(4 * n, 6, generator=gen)
    gm = make_fx(_every_issuer, tracing_mode="fake")(x, y)
    register_process_group_alias(POOL_ALIAS, dist.group.WORLD)
    first = next(nd for nd in gm.graph.nodes if nd.op == "call_function" and "all_reduce" in str(nd.target))
    first.meta[SETTING_META] = {"min_ctas": 2, "max_ctas": 2, "pool_group_alias": POOL_ALIAS}
    plans = []
    fn = lower_runtime(gm, "test", on_plan=plans.append)
    ref = gm(x, y)
    with record() as rec:
        got = fn([x, y])
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        # Bitwise except the coalesced "avg" (functional collectives divide it in another order).
        tol = 1e-6 if i in (8, 9) else 0
        torch.testing.assert_close(g, r, rtol=tol, atol=tol, msg=f"output {i} on rank {rank}")
    return {
        "issue_groups": [c.issue_group for c in plans[0].collectives],
        "recorded": [(c.kind, c.issue_group) for c in rec.collectives],
        "completed": all(c.end_ns is not None and c.end_ns >= c.issued_ns for c in rec.collectives),
    }


def _gather_beside_compute(x: torch.Tensor, w: torch.Tensor):
    a = funcol.all_gather_tensor(x, 0, dist.group.WORLD)  # waited at its first use, after the loop
    h = w
    for _ in range(8):
        h = torch.tanh(h @ w)
    return a.sum() + h.sum()


def recorder_sees_overlap() -> dict[str, Any]:
    """A gather issued before independent compute: the recorder shows it in flight while that
    compute runs (measured on the rank's own clock), and the value is right."""
    x = torch.full((1 << 21,), float(dist.get_rank()))
    w = torch.randn(384, 384) / 20
    gm = make_fx(_gather_beside_compute, tracing_mode="fake")(x, w)
    fn = lower_runtime(gm, "overlap")
    fn([x, w])  # warm-up
    with record() as rec:
        out = fn([x, w])
    torch.testing.assert_close(out, _gather_beside_compute(x, w))
    s = rec.summary()
    c = rec.collectives[0]
    compute = [r for r in rec.regions if r.kind == "compute"]
    during = [r for r in compute if r.begin_ns < c.end_ns and r.end_ns > c.issued_ns]
    return {"summary": s, "compute_regions_during": len(during), "kind": c.kind}


def _boundary_ops(x: torch.Tensor) -> torch.Tensor:
    """A synchronous (autograd-variant) m2ms between an async all_reduce and its use."""
    from commfuse.ops import M2MS_AUTOGRAD

    g = dist.group.WORLD
    a = funcol.all_reduce(x, "sum", g)
    m = M2MS_AUTOGRAD(x * 3, 0, [1, 1, 1, 1], [0, 1], [0, 1], 2, g.group_name)  # all_to_all of rows
    return a + m


def synchronous_ops_leave_nothing_pending() -> dict[str, Any]:
    x = torch.arange(2.0) + 10 * dist.get_rank()
    gm = make_fx(_boundary_ops)(x)
    from commfuse.lowering.plan import build_plan
    from commfuse.lowering.runtime import lower_graph

    lowered = lower_graph(gm, build_plan(gm, "forward"))
    outs = [lowered(x) for _ in range(3)]
    return {
        "pending": len(lowered.state.pending),
        "out": outs[-1].tolist(),
        "eager": _boundary_ops(x).tolist(),
    }


def _compute_around_a_reduce(x: torch.Tensor, w: torch.Tensor):
    h = torch.tanh(x @ w)
    s = funcol.all_reduce(h * 2, "sum", dist.group.WORLD)
    return torch.relu(s @ w) + 1, h.sum()


def regions_fall_back_to_eager() -> dict[str, Any]:
    """The runtime lowering with compute regions from a compiler that fails to compile one region
    and returns, for another, a callable that fails on its first run (as a region compiled for
    other strides does): the values equal the functional graph's, one warning per region."""
    import warnings

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    x, w = torch.randn(4, 6, generator=gen), torch.randn(6, 6, generator=gen)
    gm = make_fx(_compute_around_a_reduce, tracing_mode="fake")(x, w)
    seen: list[int] = []

    def flaky_compiler(sub, inputs):
        seen.append(len(seen))
        if len(seen) == 1:
            raise RuntimeError("planted: this region does not compile")

        def fails_on_its_first_run(args):
            raise AssertionError("planted: expected size 4==4, stride 1==6 at dim=0")

        return fails_on_its_first_run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = lower_runtime(gm, "forward", compile_regions=flaky_compiler, example_inputs=[x, w])
        first = fn([x, w])
        second = fn([x, w])
    ref = gm(x, w)
    for got in (first, second):
        for r, g in zip(ref, got, strict=True):
            torch.testing.assert_close(g, r, rtol=0, atol=0)
    return {
        "regions_compiled": len(seen),
        "warnings": [str(c.message) for c in caught if "commfuse:" in str(c.message)],
    }


def _tp_mlp_step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ w1)
    return funcol.all_reduce(h @ w2, "sum", dist.group.WORLD)


def a_graph_that_fails_to_lower_falls_back(inner_compiler: str) -> dict[str, Any]:
    """The commfuse backend with its runtime lowering made to fail: the graphs fall back (eager:
    op by op with functional collectives; inductor: Inductor's whole-graph compile), one warning
    each, the same forward values and gradients as eager."""
    import warnings
    from unittest import mock

    import importlib

    import commfuse

    backend_mod = importlib.import_module("commfuse.backend")  # the module: commfuse.backend is the function

    torch._dynamo.reset()
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 8, generator=gen)
    ws = [torch.randn(8, 8, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in (1, 2)]

    def run(fn):
        for w in ws:
            w.grad = None
        out = fn(x, *ws)
        out.sum().backward()
        return out.detach(), [w.grad.clone() for w in ws]

    ref = run(_tp_mlp_step)

    def fail(*args, **kwargs):
        raise RuntimeError("planted: lowering failed")

    be = commfuse.backend(inner_compiler=inner_compiler)
    with (
        mock.patch.object(backend_mod, "lower_runtime", fail),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        got = run(torch.compile(_tp_mlp_step, backend=be, fullgraph=True))
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    for g, r in zip(got[1], ref[1], strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    return {"warnings": [str(c.message) for c in caught if "commfuse:" in str(c.message)]}


def _coalesced_avg_reduce_scatter(x: torch.Tensor, y: torch.Tensor):
    """A coalesced ``avg`` reduce-scatter with compute between the issue and the waits of its
    two outputs (each output is waited by its own ``wait_tensor``, the first before the second)."""
    a, b = funcol.reduce_scatter_tensor_coalesced([x, torch.neg(y)], "avg", [0, 0], dist.group.WORLD)
    h = torch.tanh(x).sum()
    return a + 0, b * 1, h


def coalesced_avg_reduce_scatter_is_divided(compile_regions: bool) -> dict[str, Any]:
    """Every output of a coalesced ``avg`` reduce-scatter lowered on gloo (sum, then the runtime's
    finish divides after the wait) is the average. Regression (fuzz executor sample, seed 20261204
    program 2): the second output's wait waited every work of the collective again, and gloo's
    reduce-scatter work copies its sum into the output on each ``wait()``, so the first output
    came out as the sum (world size times the average)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(2 * n, 3, generator=gen), torch.randn(n, 5, generator=gen)
    gm = make_fx(_coalesced_avg_reduce_scatter, tracing_mode="fake")(x, y)
    waits = [nd.name for nd in gm.graph.nodes if nd.op == "call_function" and "wait_tensor" in str(nd.target)]
    compile_fn = None
    if compile_regions:
        from commfuse.core.torch_private import inductor_compile_fx_inner

        compile_fn = inductor_compile_fx_inner
    fn = lower_runtime(gm, "forward", compile_regions=compile_fn, example_inputs=[x, y])
    ref = gm(x, y)
    # the values by hand: the sum of every rank's input, this rank's rows, divided by n
    xs, ys = [torch.empty_like(x) for _ in range(n)], [torch.empty_like(y) for _ in range(n)]
    dist.all_gather(xs, x)
    dist.all_gather(ys, y)
    by_hand = [torch.stack(xs).sum(0).chunk(n)[rank] / n, -torch.stack(ys).sum(0).chunk(n)[rank] / n]
    ratios = []
    for _ in range(2):  # and a second step of the same lowered graph
        got = fn([x.clone(), y.clone()])
        for i in range(3):
            torch.testing.assert_close(got[i], ref[i], rtol=1e-5, atol=1e-6, msg=f"output {i} on rank {rank}")
        ratios.append([float(got[i].norm() / by_hand[i].norm()) for i in range(2)])  # the sum: n
    return {"waits": len(waits), "ratios": ratios}
