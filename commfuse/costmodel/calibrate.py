"""`commfuse calibrate`: measure this machine, fit the cost model, write a profile.

What it measures (2 gloo ranks on CPU, one intra-op thread each, or NCCL when the
process group is NCCL; ranks run the same sweep at the same time, so what is measured
includes the contention the two ranks cause each other, as in a training step):

* every collective kind the gloo model distinguishes (all_reduce, all_gather,
  reduce_scatter, all_to_all, broadcast) over a size sweep (nccl-tests size
  conventions, see :mod:`.collectives`); per size the median over ``reps`` timed
  calls, each started after a barrier and timed to its end on the slowest rank;
* compute, per op family, on representative ATen ops called through the dispatcher
  exactly as an eager FX graph calls them: ``mm`` sweeps (matmul), ``bmm``
  (matmul too), add/mul/silu (pointwise), sum (reduction), softmax, layer norm,
  embedding, CPU flash attention, and a view (dispatch cost of metadata ops);
* the contention factor κ: a matmul timed alone and while a gloo all_reduce runs.

What it fits: per collective kind ``time = alpha + beta x size`` by least squares
on relative error (so small and large messages count alike); per compute family
``time = a + b x flops`` (matmul, attention) or ``a + b x bytes`` (the memory-bound
families), with the unit and FLOP/byte counts of :func:`.compute.op_cost` so the fit
and the model agree on what a unit is.

The profile it writes (:class:`.profile.CostProfile`) is the one file every rank then
loads: same file, same decisions.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..ir.kinds import CollectiveKind
from .collectives import AlphaBeta, CollectiveParams
from .compute import ComputeParams, FamilyFit

K = CollectiveKind
COLLECTIVE_KINDS = (K.ALL_REDUCE, K.ALL_GATHER, K.REDUCE_SCATTER, K.ALL_TO_ALL, K.BROADCAST)
DEFAULT_SIZES = tuple(4 ** i * 1024 for i in range(0, 8))  # 1 KiB .. 16 MiB


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
    for rows in zip(*per_rank):
        kind, size = rows[0][0], rows[0][1]
        times = [max(ts) for ts in zip(*(r[2] for r in rows))]
        samples.append(Sample(kind, float(size), times))
    return samples


# ------------------------------------------------------------------ compute (runs on every rank)
def _compute_cases() -> list[tuple[str, Callable[[], Callable[[], object]]]]:
    """(family, builder) pairs; a builder returns the zero-argument call to time."""
    aten = torch.ops.aten
    cases: list[tuple[str, Callable[[], Callable[[], object]]]] = []
    for m, k, n in [(16, 32, 32), (64, 64, 64), (64, 128, 256), (256, 128, 128), (128, 256, 512),
                    (256, 512, 512), (512, 512, 512), (512, 1024, 512)]:
        cases.append(("matmul", lambda m=m, k=k, n=n: (lambda a=torch.randn(m, k), b=torch.randn(k, n):
                                                       aten.mm.default(a, b))))
    for b, m, k, n in [(4, 16, 16, 16), (8, 64, 32, 64), (8, 128, 64, 128)]:
        cases.append(("matmul", lambda b=b, m=m, k=k, n=n: (
            lambda x=torch.randn(b, m, k), y=torch.randn(b, k, n): aten.bmm.default(x, y))))
    for numel in [256, 4096, 65536, 262144, 1048576]:
        cases.append(("pointwise", lambda numel=numel: (
            lambda x=torch.randn(numel), y=torch.randn(numel): aten.add.Tensor(x, y))))
        cases.append(("pointwise", lambda numel=numel: (lambda x=torch.randn(numel): aten.silu.default(x))))
        cases.append(("reduction", lambda numel=numel: (
            lambda x=torch.randn(numel // 64, 64): aten.sum.dim_IntList(x, [-1], True))))
        cases.append(("softmax", lambda numel=numel: (
            lambda x=torch.randn(numel // 64, 64): aten._softmax.default(x, -1, False))))
        cases.append(("norm", lambda numel=numel: (
            lambda x=torch.randn(numel // 64, 64), w=torch.ones(64), b=torch.zeros(64):
            aten.native_layer_norm.default(x, [64], w, b, 1e-5))))
        cases.append(("embedding", lambda numel=numel: (
            lambda w=torch.randn(512, 64), i=torch.randint(0, 512, (max(1, numel // 64),)):
            aten.embedding.default(w, i))))
    for b, h, s, d in [(1, 2, 16, 8), (2, 4, 32, 16), (2, 8, 64, 16), (2, 8, 128, 32)]:
        cases.append(("attention", lambda b=b, h=h, s=s, d=d: (
            lambda q=torch.randn(b, h, s, d), k=torch.randn(b, h, s, d), v=torch.randn(b, h, s, d):
            aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, True))))
    cases.append(("view", lambda: (lambda x=torch.randn(64, 64): aten.view.default(x, [4096]))))
    return cases


def _units(family: str, call: Callable[[], object]) -> float:
    """FLOPs (matmul, attention) or bytes (the rest) of one call, counted by op_cost."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from .compute import op_cost

    gm = make_fx(lambda: call())()
    costs = [op_cost(n) for n in gm.graph.nodes if n.op == "call_function"]
    if family in ("matmul", "attention"):
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
    """A small transformer-like chain traced to ATen: what an eager FX graph executes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def body(x, w1, w2, g):
        for _ in range(6):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g
            a = torch.nn.functional.silu(h.view(-1, 64) @ w1) * (h.view(-1, 64) @ w1)
            x = x + (a @ w2).view(x.shape)
        return x.sum()

    args = (torch.randn(2, 32, 64), torch.randn(64, 128), torch.randn(128, 64), torch.ones(64))
    return make_fx(body)(*args), args


def measure_graph_job(reps: int) -> list:
    """Rank job: ``[median us of one gm.forward, us predicted by the per-op fits of this rank]``
    is computed by the caller; here: ``[graph time samples, node list description]``."""
    torch.set_num_threads(1)
    gm, args = _synthetic_graph()
    for _ in range(5):
        gm(*args)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(10):
            gm(*args)
        times.append((time.perf_counter() - t0) * 1e5)  # us per call
    return times


def fit_graph_overhead(graph_times_us: Sequence[float], compute: ComputeParams) -> float:
    """Per-op overhead of running ops from an FX graph (frame, allocation, freeing) beyond
    what the op micro-benchmarks measured: spread over the graph's non-view ops."""
    from .compute import ComputeModel, op_cost
    from .topology import Topology

    gm, _ = _synthetic_graph()
    model = ComputeModel(Topology.preset("cpu-gloo"), compute)
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


# ------------------------------------------------------------------ fitting
def fit_alpha_beta(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares of ``y = a + b x`` on relative error, a, b >= 0."""
    w = [1.0 / (y * y) for y in ys]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs))
    sy = sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
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
        fits.append(AlphaBeta(kind=K(kind), group_size=group_size, alpha_us=a, beta_us_per_byte=b,
                              min_bytes=int(min(s.x for s in pts)), max_bytes=int(max(s.x for s in pts))))
    return CollectiveParams(fits=fits)


def fit_compute(samples: Sequence[Sample]) -> ComputeParams:
    fits, view_us = {}, 0.0
    for family in sorted({s.key for s in samples}):
        pts = [s for s in samples if s.key == family]
        if family == "view":
            view_us = statistics.median(s.median for s in pts)
            continue
        a, b = fit_alpha_beta([s.x for s in pts], [s.median for s in pts])
        fits[family] = FamilyFit(a_us=a, b_us_per_unit=b,
                                 unit="flops" if family in ("matmul", "attention") else "bytes")
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


def calibrate(world_size: int = 2, *, sizes: Sequence[int] = DEFAULT_SIZES, warmup: int = 3, reps: int = 15,
              kinds: Sequence[CollectiveKind] = COLLECTIVE_KINDS, timeout: float = 900.0,
              log: Optional[Callable[[str], None]] = print) -> CalibrationResult:
    """Run the sweeps on a pool of ``world_size`` gloo ranks and fit a ``cpu-gloo`` profile."""
    from ..testing.rank_pool import get_pool
    from .profile import CostProfile, Provenance

    pool = get_pool(world_size)
    if log:
        log(f"calibrate: collectives {[k.value for k in kinds]} x {len(sizes)} sizes on {world_size} gloo ranks")
    coll = merge_ranks(pool.run(measure_collectives_job, [k.value for k in kinds], list(sizes), warmup, reps,
                                timeout=timeout))
    if log:
        log("calibrate: compute ops (every rank at once, one thread each)")
    comp_rows = pool.run(measure_compute_job, warmup, reps, timeout=timeout)[0]
    comp = [Sample(f, u, t) for f, u, t in comp_rows]
    compute = fit_compute(comp)
    graph_times = pool.run(measure_graph_job, reps, timeout=timeout)[0]
    compute = compute.model_copy(update={"overhead_us": fit_graph_overhead(graph_times, compute)})
    kappa = statistics.median(pool.run(measure_contention_job, reps, timeout=timeout))
    profile = CostProfile(topology="cpu-gloo", num_nodes=1, backend="gloo",
                          collective=fit_collectives(coll, world_size), compute=compute,
                          contention_kappa=kappa,
                          provenance=Provenance.here(notes=f"{world_size} gloo ranks, 1 thread each, "
                                                           f"{reps} reps, sizes {min(sizes)}..{max(sizes)} B"))
    return CalibrationResult(profile, coll, comp, kappa)


def main(argv: Sequence[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m commfuse calibrate",
                                description="Measure collectives and compute on this machine (gloo, CPU) "
                                            "and write a cost profile every rank loads.")
    p.add_argument("--out", default="commfuse-profile.json", help="profile file to write")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-bytes", type=int, default=max(DEFAULT_SIZES))
    a = p.parse_args(list(argv))
    if a.world_size < 2 or a.reps < 2:
        p.error("--world-size and --reps must be at least 2")
    sizes = [s for s in DEFAULT_SIZES if s <= a.max_bytes]
    res = calibrate(a.world_size, sizes=sizes, warmup=a.warmup, reps=a.reps)
    res.profile.save(a.out)
    for f in res.profile.collective.fits:
        print(f"  {f.kind.value:<16} alpha {f.alpha_us:8.1f} us  beta {f.beta_us_per_byte * 1e3:8.4f} us/KB")
    for fam, f in sorted(res.profile.compute.fits.items()):
        print(f"  {fam:<16} a {f.a_us:8.2f} us  b {f.b_us_per_unit:.3e} us/{f.unit}")
    print(f"  view ops {res.profile.compute.view_us:.2f} us; per-op graph overhead "
          f"{res.profile.compute.overhead_us:.2f} us; contention kappa {res.kappa:.3f}")
    print(f"wrote {a.out}")
    return 0
