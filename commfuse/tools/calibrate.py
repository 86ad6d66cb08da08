"""`commfuse calibrate`: measure this machine, fit the cost model, write a profile.

What it measures (2 gloo ranks on CPU, one intra-op thread each, or NCCL when the
process group is NCCL; ranks run the same sweep at the same time, so what is measured
includes the contention the two ranks cause each other, as in a training step).
Every target is synthetic: nothing here runs the example models the validation
(``benchmarks/costmodel_validation.py``) predicts.

* every collective kind the gloo model distinguishes (all_reduce, all_gather,
  reduce_scatter, all_to_all, broadcast) over a size sweep (nccl-tests size
  conventions, see :mod:`commfuse.costmodel.collectives`), back to back as a functional op + wait;
* compute, per op family, on representative ATen ops called through the dispatcher
  exactly as an eager FX graph calls them: ``mm`` sweeps (matmul), ``bmm``
  (matmul too), add/mul/silu (pointwise), sum (reduction), softmax, layer norm,
  embedding, CPU flash attention forward (attention) and backward (attention_bw);
* views as a graph runs them (a graph of view/metadata ops only) and the per-op
  overhead of running ops from a graph (a synthetic transformer's forward+backward
  graph, its time minus the per-op fits);
* the contention factor κ: a matmul timed alone and while a gloo all_reduce runs;
* collectives *inside* a graph: synthetic graphs alternating a few compute ops with
  a collective and its wait (as DTensor's graphs do), against their compute-only
  twins; the excess over the back-to-back fit is ``collective_in_graph_us``;
* the runtime of a training step outside its graphs: a synthetic compiled module
  (N parameter vectors multiplied into the input, plain or DTensor, N = 2, 8, 24),
  step time minus the time inside its two graphs.

What it fits: per collective kind ``time = alpha + beta x size`` by least squares
on relative error (so small and large messages count alike); per compute family
``time = a + b x flops`` (matmul, attention, attention_bw) or ``a + b x bytes``
(the memory-bound families), with the unit and FLOP/byte counts of
:func:`commfuse.costmodel.compute.op_cost` so the fit and the model agree on what a unit is; the
step runtime ``fixed + param_us x plain + dtensor_param_us x DTensor`` by
non-negative least squares.

The profile it writes (:class:`commfuse.costmodel.profile.CostProfile`) is the one file every rank then
loads: same file, same decisions.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional, Sequence

import torch

from commfuse.core import torch_private as priv
from commfuse.core.errors import ConfigError
from commfuse.costmodel.collectives import AlphaBeta, CollectiveModel, CollectiveParams
from commfuse.costmodel.compute import ComputeModel, ComputeParams, FamilyFit, op_cost
from commfuse.costmodel.profile import CostProfile, Provenance
from commfuse.costmodel.step import RuntimeParams
from commfuse.costmodel.topology import Topology
from commfuse.ir.kinds import CollectiveKind
from commfuse.tools.rank_pool import get_pool

K = CollectiveKind
COLLECTIVE_KINDS = (K.ALL_REDUCE, K.ALL_GATHER, K.REDUCE_SCATTER, K.ALL_TO_ALL, K.BROADCAST)
DEFAULT_SIZES = tuple(4**i * 1024 for i in range(0, 8))  # 1 KiB .. 16 MiB


@dataclass
class Sample:
    key: str  # collective kind value or compute family
    x: float  # message bytes, or FLOPs/bytes for compute
    times_us: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.times_us)

    @property
    def iqr(self) -> float:
        q = statistics.quantiles(self.times_us, n=4) if len(self.times_us) > 1 else [self.times_us[0]] * 3
        return q[2] - q[0]


# ------------------------------------------------------------------ collectives (runs on every rank)
def _collective_call(kind: CollectiveKind, size: int, world: int) -> Callable[[], None]:
    """One functional collective + its wait, as a compiled graph runs it (the functional ops
    allocate their output, which ``dist.*`` calls do not: up to ~1.5x slower here)."""
    import torch.distributed as dist

    f = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    elt = 4
    numel = max(world, (size // elt) // world * world)
    if kind is K.ALL_REDUCE:
        x = torch.ones(numel)
        return lambda: f.wait_tensor(f.all_reduce(x, "sum", group))
    if kind is K.ALL_GATHER:  # size = total output
        x = torch.ones(numel // world)
        return lambda: f.wait_tensor(f.all_gather_into_tensor(x, world, group))
    if kind is K.REDUCE_SCATTER:  # size = total input
        x = torch.ones(numel)
        return lambda: f.wait_tensor(f.reduce_scatter_tensor(x, "sum", world, group))
    if kind is K.ALL_TO_ALL:
        x = torch.ones(numel)
        splits = [numel // world] * world
        return lambda: f.wait_tensor(f.all_to_all_single(x, splits, splits, group))
    if kind is K.BROADCAST:
        x = torch.ones(numel)
        return lambda: f.wait_tensor(f.broadcast(x, 0, group))
    raise ValueError(f"no calibration call for {kind}")


def measure_collectives_job(kinds: Sequence[str], sizes: Sequence[int], warmup: int, reps: int) -> list[list]:
    """Rank job: ``[[kind, size, [time_us per rep]], ...]`` as this rank saw them."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    world = dist.get_world_size()
    out = []
    for kind in kinds:
        for size in sizes:
            call = _collective_call(K(kind), size, world)
            for _ in range(warmup):
                call()
            # Back-to-back batches of calls, per-call time = batch / calls: one barrier's
            # release skew and scheduler hiccups are amortised, as in a training step where
            # collectives follow each other. Batches are sized to ~2 ms from a probe.
            t0 = time.perf_counter()
            call()
            probe = time.perf_counter() - t0
            inner = _agree(max(1, min(64, int(0.002 / max(probe, 1e-6)))))
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(inner):
                    call()
                times.append((time.perf_counter() - t0) * 1e6 / inner)
            out.append([kind, size, times])
    return out


def _agree(n: int) -> int:
    """The largest of every rank's value (all ranks must issue the same number of calls)."""
    import torch.distributed as dist

    t = torch.tensor([n])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def merge_ranks(per_rank: list[list[list]]) -> list[Sample]:
    """A collective ends when its slowest rank does: per repetition, the max over ranks."""
    samples = []
    for rows in zip(*per_rank, strict=True):
        kind, size = rows[0][0], rows[0][1]
        times = [max(ts) for ts in zip(*(r[2] for r in rows), strict=True)]
        samples.append(Sample(kind, float(size), times))
    return samples


# ------------------------------------------------------------------ compute (runs on every rank)
def _compute_cases() -> list[tuple[str, Callable[[], Callable[[], object]]]]:
    """(family, builder) pairs; a builder returns the zero-argument call to time."""
    aten = torch.ops.aten
    cases: list[tuple[str, Callable[[], Callable[[], object]]]] = []
    # A builder makes the inputs (outside the timed region) and returns the call on them.
    for m, k, n in [
        (16, 32, 32),
        (64, 64, 64),
        (64, 128, 256),
        (256, 128, 128),
        (128, 256, 512),
        (256, 512, 512),
        (512, 512, 512),
        (512, 1024, 512),
    ]:
        cases.append(
            ("matmul", lambda m=m, k=k, n=n: partial(aten.mm.default, torch.randn(m, k), torch.randn(k, n)))
        )
    for b, m, k, n in [(4, 16, 16, 16), (8, 64, 32, 64), (8, 128, 64, 128)]:
        cases.append(
            (
                "matmul",
                lambda b=b, m=m, k=k, n=n: partial(
                    aten.bmm.default, torch.randn(b, m, k), torch.randn(b, k, n)
                ),
            )
        )
    for numel in [256, 4096, 65536, 262144, 1048576]:
        cases.append(
            (
                "pointwise",
                lambda numel=numel: partial(aten.add.Tensor, torch.randn(numel), torch.randn(numel)),
            )
        )
        cases.append(("pointwise", lambda numel=numel: partial(aten.silu.default, torch.randn(numel))))
        cases.append(
            (
                "reduction",
                lambda numel=numel: partial(aten.sum.dim_IntList, torch.randn(numel // 64, 64), [-1], True),
            )
        )
        cases.append(
            (
                "softmax",
                lambda numel=numel: partial(aten._softmax.default, torch.randn(numel // 64, 64), -1, False),
            )
        )
        cases.append(
            (
                "norm",
                lambda numel=numel: partial(
                    aten.native_layer_norm.default,
                    torch.randn(numel // 64, 64),
                    [64],
                    torch.ones(64),
                    torch.zeros(64),
                    1e-5,
                ),
            )
        )
        cases.append(
            (
                "embedding",
                lambda numel=numel: partial(
                    aten.embedding.default,
                    torch.randn(512, 64),
                    torch.randint(0, 512, (max(1, numel // 64),)),
                ),
            )
        )
    for b, h, s, d in [(1, 2, 16, 8), (2, 4, 32, 16), (2, 8, 64, 16), (2, 8, 128, 32)]:
        cases.append(
            (
                "attention",
                lambda b=b, h=h, s=s, d=d: partial(
                    aten._scaled_dot_product_flash_attention_for_cpu.default,
                    torch.randn(b, h, s, d),
                    torch.randn(b, h, s, d),
                    torch.randn(b, h, s, d),
                    0.0,
                    True,
                ),
            )
        )
        cases.append(("attention_bw", lambda b=b, h=h, s=s, d=d: _sdpa_backward_call(b, h, s, d)))
    cases.append(("view", lambda: partial(aten.view.default, torch.randn(64, 64), [4096])))
    return cases


def _sdpa_backward_call(b: int, h: int, s: int, d: int) -> Callable[[], object]:
    aten = torch.ops.aten
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, True)
    g = torch.randn_like(out)
    return lambda: aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        g, q, k, v, out, lse, 0.0, True
    )


FLOP_FAMILIES = ("matmul", "attention", "attention_bw")


def _units(family: str, call: Callable[[], object]) -> float:
    """FLOPs (matmul, attention) or bytes (the rest) of one call, counted by op_cost."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda: call())()
    costs = [op_cost(n) for n in gm.graph.nodes if n.op == "call_function"]
    if family in FLOP_FAMILIES:
        return float(sum(c.flops for c in costs))
    return float(sum(c.bytes for c in costs))


def measure_compute_job(warmup: int, reps: int) -> list[list]:
    """Rank job: ``[[family, units, [time_us per rep]], ...]``."""
    torch.set_num_threads(1)
    out = []
    for family, build in _compute_cases():
        call = build()
        units = _units(family, call)
        for _ in range(warmup):
            call()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e6)
        out.append([family, units, times])
    return out


def _synthetic_graph():
    """A synthetic two-block pre-norm transformer, forward *and* backward (the joint graph
    ``torch.func.grad`` traces to ATen): the op mix an eager training graph executes,
    backward ops, transposes and views included. Deliberately not one of the example
    models (LayerNorm, GELU, fused QKV, shapes 3 x 24 x 48, 3 heads)."""
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx

    B, S, D, H = 3, 24, 48, 3

    def loss(ws, x):
        for i in range(2):
            w_qkv, w_o, w1, w2, g1, g2 = ws[6 * i : 6 * i + 6]
            h = F.layer_norm(x, [D], g1)
            q, k, v = (h @ w_qkv).split(D, dim=-1)
            q, k, v = (t.view(B, S, H, D // H).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, D)
            x = x + a @ w_o
            x = x + F.gelu(F.layer_norm(x, [D], g2) @ w1) @ w2
        return x.pow(2).mean()

    ws = []
    for _ in range(2):
        ws += [
            torch.randn(D, 3 * D) * 0.1,
            torch.randn(D, D) * 0.1,
            torch.randn(D, 2 * D) * 0.1,
            torch.randn(2 * D, D) * 0.1,
            torch.ones(D),
            torch.ones(D),
        ]
    args = (ws, torch.randn(B, S, D))
    return make_fx(torch.func.grad(loss))(*args), args


def _view_graph():
    """A graph of view/metadata ops only (the kinds AOT graphs are full of), as a graph runs them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def body(x, w):
        outs = []
        for _ in range(20):
            a = x.view(4, 8, 16)
            b = a.transpose(0, 1)
            c = w.t()
            d = c.unsqueeze(0)
            e = d.expand(3, -1, -1)
            f = a[:, 2:6]
            g = a.permute(2, 0, 1)
            h, i = x.split(16, dim=0)
            outs += [b, e, f, g, h, i]
        return outs

    args = (torch.randn(32, 16), torch.randn(16, 24))
    return make_fx(body)(*args), args


def _time_graph(gm, args, reps: int, inner: int = 5) -> list[float]:
    for _ in range(3):
        gm(*args)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            gm(*args)
        times.append((time.perf_counter() - t0) * 1e6 / inner)  # us per call
    return times


def measure_graph_job(reps: int) -> dict:
    """Rank job: ``{"joint": us per run of the synthetic fw+bw graph, "views": us per run of
    the view graph}`` (samples), every rank running at once, one thread each."""
    torch.set_num_threads(1)
    out = {}
    for name, (gm, args) in (("joint", _synthetic_graph()), ("views", _view_graph())):
        out[name] = _time_graph(gm, args, reps)
    return out


def fit_view_us(view_graph_times_us: Sequence[float]) -> float:
    """Time of one view/metadata op as a graph runs it (Python call from the graph's code,
    dispatch, a new TensorImpl): the view graph's time spread over its view ops
    (``getitem`` of a split is a Python index: counted as free)."""

    gm, _ = _view_graph()
    views = sum(1 for n in gm.graph.nodes if n.op == "call_function" and op_cost(n).family == "view")
    return statistics.median(view_graph_times_us) / max(views, 1)


def fit_graph_overhead(graph_times_us: Sequence[float], compute: ComputeParams) -> float:
    """Per-op overhead of running ops from an FX graph (frame, allocation, freeing, cold
    caches) beyond what the op micro-benchmarks measured, from the synthetic fw+bw graph:
    its measured time minus the per-op fits (views at ``compute.view_us``), spread over
    its non-view ops."""

    gm, _ = _synthetic_graph()
    model = ComputeModel(Topology.preset("cpu-gloo"), compute.model_copy(update={"overhead_us": 0.0}))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    predicted = sum(model.time_us(n) for n in nodes)
    ops = sum(1 for n in nodes if op_cost(n).family not in ("free", "view"))
    return max(0.0, (statistics.median(graph_times_us) - predicted) / max(ops, 1))


def measure_contention_job(reps: int) -> float:
    """Rank job: κ = (matmul time while a gloo all_reduce is in flight) / (alone) - 1."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    buf = torch.ones(1 << 20)

    def mm_time() -> float:
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        return time.perf_counter() - t0

    alone, busy = [], []
    for _ in range(reps):
        dist.barrier()
        alone.append(mm_time())
        dist.barrier()
        work = dist.all_reduce(buf, async_op=True)
        busy.append(mm_time())
        work.wait()
    return max(0.0, statistics.median(busy) / statistics.median(alone) - 1.0)


# ------------------------------------------------------------------ collectives inside a graph
IN_GRAPH_KINDS = (K.ALL_REDUCE, K.ALL_GATHER, K.REDUCE_SCATTER, K.ALL_TO_ALL)
IN_GRAPH_ROWS = (16, 128)  # activation rows of width 64: 4 KiB and 32 KiB collectives
IN_GRAPH_GAPS = (1, 2, 4)  # MLP blocks between two collectives: ~50-400 us of compute
IN_GRAPH_COLLECTIVES = 12


def _interleaved_graph(kind: CollectiveKind, rows: int, gap: int, count: int, world: int, with_comm: bool):
    """A synthetic graph of ``count`` segments, each ``gap`` small MLP blocks (layer norm,
    matmul, GELU, matmul, residual; weights of its own, like the layers of a model) whose
    output goes through one collective + its wait (the wait right after the start, as
    DTensor's graphs have them) into the next segment; or the same compute without the
    collectives. The collective's message is the activation just computed (``rows`` x 64
    fp32); all_gather's output is sliced back and reduce_scatter's concatenated back."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx

    f = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    D = 64

    def coll(h):
        if kind is K.ALL_REDUCE:
            return f.wait_tensor(f.all_reduce(h, "sum", group)) * (1.0 / world)
        if kind is K.ALL_GATHER:
            return f.wait_tensor(f.all_gather_into_tensor(h, world, group))[:rows]
        if kind is K.REDUCE_SCATTER:
            r = f.wait_tensor(f.reduce_scatter_tensor(h, "sum", world, group))
            return torch.cat([r] * world) * (1.0 / world)
        splits = [rows // world] * world
        return f.wait_tensor(f.all_to_all_single(h, splits, splits, group))

    def body(x, ws):
        h = x
        for i in range(count):
            for j in range(gap):
                a, b = ws[2 * ((i * gap + j) % (len(ws) // 2)) :][:2]
                h = h + F.gelu(F.layer_norm(h, [D]) @ a) @ b
            if with_comm:
                h = coll(h)
        return h

    g = torch.Generator().manual_seed(0)
    ws = [
        torch.randn(D, 2 * D, generator=g) / 8 if i % 2 == 0 else torch.randn(2 * D, D, generator=g) / 11
        for i in range(2 * count * gap)
    ]
    args = (torch.randn(rows, D, generator=g), ws)
    return make_fx(body)(*args), args


def _message_bytes(kind: CollectiveKind, rows: int, world: int) -> int:
    """nccl-tests size of the collective of ``_interleaved_graph`` (AG: total output)."""
    return rows * 64 * 4 * (world if kind is K.ALL_GATHER else 1)


def measure_in_graph_collectives_job(
    reps: int,
    kinds: Sequence[str] = tuple(k.value for k in IN_GRAPH_KINDS),
    rows: Sequence[int] = IN_GRAPH_ROWS,
    gaps: Sequence[int] = IN_GRAPH_GAPS,
    count: int = IN_GRAPH_COLLECTIVES,
) -> list[list]:
    """Rank job: ``[[kind, bytes, gap, [us with collectives per rep], [us compute only per rep]], ...]``.

    Each repetition runs the graph once after a barrier, as a training step runs its
    graphs; the compute-only twin is timed in the same way right after it."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    world = dist.get_world_size()
    out = []
    for kind in kinds:
        for r in rows:
            for gap in gaps:
                with_c, args = _interleaved_graph(K(kind), r, gap, count, world, True)
                without, _ = _interleaved_graph(K(kind), r, gap, count, world, False)
                for _ in range(3):
                    with_c(*args)
                    without(*args)
                tw, tc = [], []
                for _ in range(reps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    with_c(*args)
                    tw.append((time.perf_counter() - t0) * 1e6)
                    dist.barrier()
                    t0 = time.perf_counter()
                    without(*args)
                    tc.append((time.perf_counter() - t0) * 1e6)
                out.append([kind, _message_bytes(K(kind), r, world), gap, tw, tc])
    return out


@dataclass
class InGraphSample:
    kind: str
    size: int
    gap: int
    with_us: list[float]  # per rep, slowest rank
    compute_us: list[float]
    count: int = IN_GRAPH_COLLECTIVES

    def per_collective_us(self) -> float:
        """Measured cost of one collective in the graph: (graph - its compute-only twin) / count."""
        return (statistics.median(self.with_us) - statistics.median(self.compute_us)) / self.count


def merge_in_graph(per_rank: list[list[list]], count: int = IN_GRAPH_COLLECTIVES) -> list[InGraphSample]:
    out = []
    for rows in zip(*per_rank, strict=True):
        kind, size, gap = rows[0][:3]
        out.append(
            InGraphSample(
                kind,
                size,
                gap,
                [max(ts) for ts in zip(*(r[3] for r in rows), strict=True)],
                [max(ts) for ts in zip(*(r[4] for r in rows), strict=True)],
                count,
            )
        )
    return out


def fit_in_graph_latency(
    samples: Sequence[InGraphSample], collectives: CollectiveParams, world: int
) -> float:
    """``collective_in_graph_us``: median over the configurations of (measured per-collective
    cost in the graph - the back-to-back fit's price at that kind and size), at least 0.
    The one or two cheap ops that bring a collective's output back to the activation's
    shape (a scale, a slice, a concatenation: a few us) count as the collective's."""

    model = CollectiveModel(Topology.preset("cpu-gloo"), "gloo", collectives)
    extras = [s.per_collective_us() - model.time(K(s.kind), s.size, world).time_us for s in samples]
    return max(0.0, statistics.median(extras)) if extras else 0.0


# ------------------------------------------------------------------ runtime of a training step
STEP_PARAM_COUNTS = (2, 8, 24)


class _ParamChain(torch.nn.Module):
    """``n`` trainable vectors multiplied into the input: no collectives, almost no compute,
    so a step's time outside its graphs is the runtime's. With a mesh, the parameters are
    replicated DTensors and the module takes and returns plain tensors (as a parallelised
    model with ``use_local_output`` does)."""

    def __init__(self, n: int, dim: int, mesh=None) -> None:
        super().__init__()
        self.mesh = mesh
        params = []
        for _ in range(n):
            w = torch.randn(dim) * 0.1 + 1.0
            if mesh is not None:
                from torch.distributed.tensor import Replicate, distribute_tensor

                w = distribute_tensor(w, mesh, [Replicate()])
            params.append(torch.nn.Parameter(w))
        self.ws = torch.nn.ParameterList(params)

    def forward(self, x):
        if self.mesh is not None:
            from torch.distributed.tensor import DTensor, Replicate

            x = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        for w in self.ws:
            x = x * w
        return x.to_local() if self.mesh is not None else x


def measure_step_runtime_job(reps: int, counts: Sequence[int] = STEP_PARAM_COUNTS) -> list[list]:
    """Rank job: ``[[dtensor?, n_params, [step us per rep], [us inside the two graphs per rep]], ...]``.

    Compiled as the validation compiles a model (AOTAutograd, boxed forward/backward
    graphs run as they are, min-cut partition); a step is forward, ``out.sum()``,
    backward, gradients set to None, after a barrier."""
    import torch.distributed as dist
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    torch.set_num_threads(1)
    world = dist.get_world_size()
    out = []
    for dtensor in (False, True):
        for n in counts:
            torch._dynamo.reset()
            mesh = None
            if dtensor:
                from torch.distributed.device_mesh import init_device_mesh

                mesh = init_device_mesh("cpu", (world,))
            model = _ParamChain(n, 16, mesh)
            x = torch.randn(4, 16)
            inside = [0.0]

            def compiler(gm, _inputs):
                def run(*a):
                    t0 = time.perf_counter()
                    r = gm(*a)
                    inside[0] += time.perf_counter() - t0  # noqa: B023 - compiled and run within this iteration
                    return r

                return priv.make_boxed_func(run)

            compiled = torch.compile(
                model,
                backend=priv.aot_autograd(
                    fw_compiler=compiler,
                    bw_compiler=compiler,
                    partition_fn=min_cut_rematerialization_partition,
                ),
            )

            def step(model=model, compiled=compiled, x=x):  # bound, though only called in this iteration
                for p in model.parameters():
                    p.grad = None
                compiled(x).sum().backward()

            for _ in range(5):
                step()
            ts, gs = [], []
            for _ in range(reps):
                dist.barrier()
                inside[0] = 0.0
                t0 = time.perf_counter()
                step()
                ts.append((time.perf_counter() - t0) * 1e6)
                gs.append(inside[0] * 1e6)
            out.append([dtensor, n, ts, gs])
    torch._dynamo.reset()
    return out


def fit_step_runtime(per_rank: list[list[list]]) -> tuple[float, float, float]:
    """``(step_fixed_us, param_us, dtensor_param_us)`` by least squares (each >= 0) on the
    time outside the graphs: per configuration the median over reps of step - graphs on
    each rank, the slowest rank's."""
    rows = []
    for cfg in zip(*per_rank, strict=True):
        dtensor, n = cfg[0][0], cfg[0][1]
        outside = max(statistics.median(t - g for t, g in zip(r[2], r[3], strict=True)) for r in cfg)
        rows.append((1.0, 0.0 if dtensor else float(n), float(n) if dtensor else 0.0, outside))
    return _nnls3(rows)


def _nnls3(rows: Sequence[tuple[float, float, float, float]]) -> tuple[float, float, float]:
    """Least squares ``y = a + b x1 + c x2`` over rows ``(1, x1, x2, y)``, every coefficient
    >= 0 (the best over the active sets: three unknowns, so trying them all is cheap)."""
    import itertools

    best, best_err = (0.0, 0.0, 0.0), float("inf")
    for active in itertools.product((True, False), repeat=3):
        idx = [i for i in range(3) if active[i]]
        coef = [0.0, 0.0, 0.0]
        if idx:
            A = [[r[i] for i in idx] for r in rows]
            y = [r[3] for r in rows]
            sol = _lstsq(A, y)
            if sol is None or any(v < 0 for v in sol):
                continue
            for i, v in zip(idx, sol, strict=True):
                coef[i] = v
        err = sum((r[3] - sum(c * r[i] for i, c in enumerate(coef))) ** 2 for r in rows)
        if err < best_err:
            best, best_err = (coef[0], coef[1], coef[2]), err
    return best


def _lstsq(A: Sequence[Sequence[float]], y: Sequence[float]) -> Optional[list[float]]:
    """Normal equations, Gaussian elimination (tiny systems); None when singular."""
    m = len(A[0])
    M = [
        [sum(A[r][i] * A[r][j] for r in range(len(A))) for j in range(m)]
        + [sum(A[r][i] * y[r] for r in range(len(A)))]
        for i in range(m)
    ]
    for c in range(m):
        piv = max(range(c, m), key=lambda r: abs(M[r][c]))
        if abs(M[piv][c]) < 1e-12:
            return None
        M[c], M[piv] = M[piv], M[c]
        for r in range(m):
            if r != c:
                f = M[r][c] / M[c][c]
                M[r] = [a - f * b for a, b in zip(M[r], M[c], strict=True)]
    return [M[i][m] / M[i][i] for i in range(m)]


# ------------------------------------------------------------------ fitting
def fit_alpha_beta(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares of ``y = a + b x`` on relative error, a, b >= 0."""
    w = [1.0 / (y * y) for y in ys]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs, strict=True))
    sy = sum(wi * y for wi, y in zip(w, ys, strict=True))
    sxx = sum(wi * x * x for wi, x in zip(w, xs, strict=True))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys, strict=True))
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det if det else 0.0
    a = (sy - b * sx) / sw
    if b < 0:  # flat: pure latency
        return sy / sw, 0.0
    if a < 0:  # through the origin
        return 0.0, sxy / sxx
    return a, b


def fit_collectives(samples: Sequence[Sample], group_size: int) -> CollectiveParams:
    fits = []
    for kind in sorted({s.key for s in samples}):
        pts = [s for s in samples if s.key == kind]
        a, b = fit_alpha_beta([s.x for s in pts], [s.median for s in pts])
        fits.append(
            AlphaBeta(
                kind=K(kind),
                group_size=group_size,
                alpha_us=a,
                beta_us_per_byte=b,
                min_bytes=int(min(s.x for s in pts)),
                max_bytes=int(max(s.x for s in pts)),
            )
        )
    return CollectiveParams(fits=fits)


def fit_compute(samples: Sequence[Sample]) -> ComputeParams:
    fits, view_us = {}, 0.0
    for family in sorted({s.key for s in samples}):
        pts = [s for s in samples if s.key == family]
        if family == "view":
            view_us = statistics.median(s.median for s in pts)
            continue
        if len({s.x for s in pts}) > 1:
            a, b = fit_alpha_beta([s.x for s in pts], [s.median for s in pts])
        else:  # one size says nothing of a fixed cost: the time scales with the work
            x = pts[0].x
            a, b = 0.0, (statistics.median(s.median for s in pts) / x if x > 0 else 0.0)
        fits[family] = FamilyFit(
            a_us=a, b_us_per_unit=b, unit="flops" if family in FLOP_FAMILIES else "bytes"
        )
    # Families without a representative op of their own borrow the closest measured one.
    for family, like in (("memory", "pointwise"), ("unknown", "pointwise"), ("conv", "matmul")):
        if like in fits and family not in fits:
            fits[family] = fits[like]
    return ComputeParams(fits=fits, view_us=view_us)


# ------------------------------------------------------------------ driver
@dataclass
class CalibrationResult:
    profile: "object"  # CostProfile
    collective_samples: list[Sample]
    compute_samples: list[Sample]
    kappa: float
    in_graph_samples: list[InGraphSample] = field(default_factory=list)
    step_runtime_rows: list = field(default_factory=list)  # per rank, measure_step_runtime_job's rows


def calibrate(
    world_size: int = 2,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    warmup: int = 3,
    reps: int = 15,
    kinds: Sequence[CollectiveKind] = COLLECTIVE_KINDS,
    timeout: float = 900.0,
    log: Optional[Callable[[str], None]] = print,
) -> CalibrationResult:
    """Run the sweeps on a pool of ``world_size`` gloo ranks and fit a ``cpu-gloo`` profile."""

    pool = get_pool(world_size)
    if log:
        log("calibrate: compute ops (every rank at once, one thread each)")
    comp_rows = pool.run(measure_compute_job, warmup, reps, timeout=timeout)[0]
    comp = [Sample(f, u, t) for f, u, t in comp_rows]
    compute = fit_compute(comp)
    if log:
        log("calibrate: synthetic graphs (fw+bw transformer, views)")
    # a graph run is ~1 ms: four times the repetitions cost a fraction of a second
    graph_times = pool.run(measure_graph_job, 4 * reps, timeout=timeout)[0]
    compute = compute.model_copy(update={"view_us": fit_view_us(graph_times["views"])})
    compute = compute.model_copy(update={"overhead_us": fit_graph_overhead(graph_times["joint"], compute)})
    kappa = statistics.median(pool.run(measure_contention_job, reps, timeout=timeout))
    if log:
        log("calibrate: collectives between compute ops of a graph")
    in_graph = merge_in_graph(pool.run(measure_in_graph_collectives_job, reps, timeout=timeout))
    if log:
        log("calibrate: runtime of a synthetic compiled training step (plain and DTensor parameters)")
    step_rows = pool.run(measure_step_runtime_job, reps, timeout=timeout)
    fixed, per_param, per_dtensor = fit_step_runtime(step_rows)
    # The back-to-back sweep runs last: the ranks are then in the state of a training job
    # (Dynamo, AOTAutograd and DTensor loaded, a model compiled), as the steps it prices
    # and the validation's own sweep are. Measured first in fresh ranks, every later
    # measurement of the same collectives came out 15-20% slower here.
    if log:
        log(
            f"calibrate: collectives {[k.value for k in kinds]} x {len(sizes)} sizes on {world_size} gloo ranks"
        )
    coll = merge_ranks(
        pool.run(
            measure_collectives_job, [k.value for k in kinds], list(sizes), warmup, reps, timeout=timeout
        )
    )
    collective = fit_collectives(coll, world_size)
    runtime = RuntimeParams(
        collective_in_graph_us=fit_in_graph_latency(in_graph, collective, world_size),
        step_fixed_us=fixed,
        param_us=per_param,
        dtensor_param_us=per_dtensor,
    )
    profile = CostProfile(
        topology="cpu-gloo",
        num_nodes=1,
        backend="gloo",
        collective=collective,
        compute=compute,
        contention_kappa=kappa,
        runtime=runtime,
        provenance=Provenance.here(
            notes=f"{world_size} gloo ranks, 1 thread each, {reps} reps, sizes {min(sizes)}..{max(sizes)} B"
        ),
    )
    return CalibrationResult(profile, coll, comp, kappa, in_graph, step_rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``commfuse calibrate`` options (see :func:`run`)."""
    p.add_argument("--out", default="commfuse-profile.json", help="profile file to write")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (processes) to measure on")
    p.add_argument("--reps", type=int, default=15, help="timed repetitions per measurement")
    p.add_argument("--warmup", type=int, default=3, help="untimed repetitions before each measurement")
    p.add_argument(
        "--max-bytes",
        type=int,
        default=max(DEFAULT_SIZES),
        help="largest collective message measured, in bytes",
    )


def run(a: argparse.Namespace) -> int:
    """Measure collectives and compute on this machine (gloo, CPU) and write a cost profile every rank loads."""
    if a.world_size < 2 or a.reps < 2:
        raise ConfigError("--world-size and --reps must be at least 2")
    sizes = [s for s in DEFAULT_SIZES if s <= a.max_bytes]
    if not sizes:
        raise ConfigError(
            f"--max-bytes {a.max_bytes} is below the smallest size measured ({min(DEFAULT_SIZES)})"
        )
    res = calibrate(a.world_size, sizes=sizes, warmup=a.warmup, reps=a.reps)
    res.profile.save(a.out)
    for f in res.profile.collective.fits:
        print(f"  {f.kind.value:<16} alpha {f.alpha_us:8.1f} us  beta {f.beta_us_per_byte * 1e3:8.4f} us/KB")
    for fam, f in sorted(res.profile.compute.fits.items()):
        print(f"  {fam:<16} a {f.a_us:8.2f} us  b {f.b_us_per_unit:.3e} us/{f.unit}")
    print(
        f"  view ops {res.profile.compute.view_us:.2f} us; per-op graph overhead "
        f"{res.profile.compute.overhead_us:.2f} us; contention kappa {res.kappa:.3f}"
    )
    rt = res.profile.runtime
    print(
        f"  collective in a graph +{rt.collective_in_graph_us:.1f} us; step runtime {rt.step_fixed_us:.0f} us "
        f"+ {rt.param_us:.1f} us/parameter + {rt.dtensor_param_us:.1f} us/DTensor parameter"
    )
    print(f"wrote {a.out}")
    return 0
