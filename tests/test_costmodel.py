"""Cost model: topology presets/detect, collective, compute, contention models, profile file."""

from __future__ import annotations

import json
import math

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from commfuse.costmodel import (
    PRESETS,
    AlphaBeta,
    AnalyticCostModel,
    CollectiveModel,
    CollectiveParams,
    CommResources,
    ComputeEstimate,
    ComputeModel,
    ComputeParams,
    ContentionModel,
    CostProfile,
    FamilyFit,
    OpCost,
    Provenance,
    Topology,
    bus_factor,
    busbw_GBps,
    op_cost,
)
from commfuse.costmodel.collectives import concrete
from commfuse.core.errors import ConfigError
from commfuse.ir import CollectiveIR, CollectiveKind
from commfuse.testing.fake_pg import fake_process_group

from _graphs import trace_all_kinds

K = CollectiveKind
MiB = 1 << 20


# --------------------------------------------------------------------------- topology


@pytest.mark.parametrize("name", ["dgx-a100", "dgx-h100", "pcie-8gpu", "a40-pcie", "cpu-gloo"])
def test_presets_valid(name):
    assert name in PRESETS
    for nodes in (1, 2):
        t = Topology.preset(name, num_nodes=nodes)
        assert t.name == name and t.num_nodes == nodes and t.world_size == nodes * t.ranks_per_node
        assert t.intra_node_groups()[-1][-1] == t.world_size - 1
        assert t.peak_tflops("bf16") == t.peak_tflops_bf16 and t.peak_tflops("fp32") == t.peak_tflops_fp32
        assert t.is_gpu == (name != "cpu-gloo")
    assert Topology.preset("cpu-gloo").contention_kappa > 0


def test_detect_is_pure_and_consistent():
    a = Topology.detect(16, 8, "NVIDIA H100 80GB HBM3")
    assert a == Topology.detect(16, 8, "NVIDIA H100 80GB HBM3")
    assert (a.name, a.num_nodes, a.ranks_per_node) == ("dgx-h100", 2, 8)
    assert Topology.detect(8, 8, "NVIDIA A100-SXM4-80GB").name == "dgx-a100"
    assert Topology.detect(16, 8, "NVIDIA A40").name == "a40-pcie"
    assert Topology.detect(8, 8, "NVIDIA GeForce RTX 4080").name == "pcie-8gpu"
    t = Topology.detect(2, 2, "cpu")
    assert (t.name, t.num_nodes, t.ranks_per_node, t.world_size) == ("cpu-gloo", 1, 2, 2)
    # ranks_per_node comes from the job, not the preset
    assert Topology.detect(8, 4, "H100").ranks_per_node == 4


@pytest.mark.parametrize(
    "args, match",
    [
        ((16, 3, "cpu"), "world_size 16 is not divisible by local_world_size 3"),
        ((0, 1, "cpu"), "world_size must be a positive int"),
        ((4, -2, "cpu"), "local_world_size must be a positive int"),
        ((2, 2, ""), "device_name must be a non-empty string"),
        ((2, 2, "RTX A4000"), "device_name 'RTX A4000' matches no preset"),
    ],
)
def test_detect_errors(args, match):
    with pytest.raises(ConfigError, match=match):
        Topology.detect(*args)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(peak_tflops_bf16=0), "peak_tflops_bf16"),
        (dict(memory_bandwidth_GBps=-1), "memory_bandwidth_GBps"),
        (dict(num_sms=-1), "num_sms"),
        (dict(contention_kappa=-0.1), "contention_kappa"),
        (dict(num_sms=8, nccl_channels=8), "nccl_channels"),
    ],
)
def test_topology_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Topology(**kwargs)


def test_topology_file_errors_name_file_and_field(tmp_path):
    p = tmp_path / "t.json"
    Topology.preset("a40-pcie", num_nodes=2).save(p)
    assert Topology.load(p) == Topology.preset("a40-pcie", num_nodes=2)
    p.write_text(json.dumps({"num_nodes": 1, "peak_tflops_fp32": "fast"}))
    with pytest.raises(ConfigError, match=r"t\.json.*'peak_tflops_fp32'"):
        Topology.load(p)


# --------------------------------------------------------------------------- collectives


def test_busbw_factors_exact():
    n = 8
    assert bus_factor(K.ALL_REDUCE, n) == 2 * 7 / 8
    assert (
        bus_factor(K.ALL_GATHER, n) == bus_factor(K.REDUCE_SCATTER, n) == bus_factor(K.ALL_TO_ALL, n) == 7 / 8
    )
    assert bus_factor(K.BROADCAST, n) == bus_factor(K.SEND, n) == 1.0
    t = Topology.preset("dgx-h100")
    m = CollectiveModel(t)
    # the bandwidth term of a ring is size x factor / busbw: the marginal time per byte is exact
    for kind in (K.ALL_REDUCE, K.ALL_GATHER, K.REDUCE_SCATTER):
        t1 = m.time(kind, 64 * MiB, n, algorithm="ring").time_us
        t2 = m.time(kind, 128 * MiB, n, algorithm="ring").time_us
        assert math.isclose((t2 - t1), 64 * MiB * bus_factor(kind, n) / (t.intra_node_bandwidth_GBps * 1e3))
        # and busbw at a huge size approaches the link's bus bandwidth
        big = m.time(kind, 1 << 34, n).time_us
        assert 0.99 < busbw_GBps(kind, 1 << 34, n, big) / t.intra_node_bandwidth_GBps <= 1
    # ring wire bytes follow commfuse.ir.volume's ring conventions
    assert m.time(K.ALL_REDUCE, 800, n, algorithm="ring").wire_bytes == 1400
    assert m.time(K.ALL_GATHER, 800, n).wire_bytes == 700


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
@pytest.mark.parametrize("nodes", [1, 2])
def test_time_monotone_in_bytes(backend, nodes):
    t = Topology.preset("dgx-h100" if backend == "nccl" else "cpu-gloo", num_nodes=nodes)
    m = CollectiveModel(t, backend)
    n = t.world_size
    for kind in CollectiveKind:
        prev = 0.0
        for s in [1 << k for k in range(6, 32, 3)]:
            e = m.time(kind, s, n)
            assert e.time_us >= prev and e.time_us > 0, (kind, s)
            prev = e.time_us
            for name, c in m.candidates(kind, s, n).items():
                assert c.time_us > 0 and c.algorithm == name
        assert m.time(kind, 1 << 20, 1) == m.time(kind, 0, n)  # trivial: local, free
        assert m.time(kind, 1 << 20, 1).algorithm == "local"


def test_ring_tree_hierarchical():
    one, two = Topology.preset("dgx-h100"), Topology.preset("dgx-h100", num_nodes=2)
    m1, m2 = CollectiveModel(one), CollectiveModel(two)
    assert set(m1.candidates(K.ALL_REDUCE, MiB, 8)) == {"ring", "tree"}
    assert set(m2.candidates(K.ALL_REDUCE, MiB, 16)) == {"ring", "tree", "hierarchical"}
    assert set(m2.candidates(K.ALL_GATHER, MiB, 8, ranks=range(8))) == {"ring"}  # one node: no hierarchy
    assert set(m2.candidates(K.REDUCE_SCATTER, MiB, 16)) == {"ring", "hierarchical"}
    # inside a node the tree (a chain) never beats the ring; across nodes it wins small messages
    assert all(m1.time(K.ALL_REDUCE, 1 << s, 8).algorithm == "ring" for s in range(10, 31, 4))
    assert m2.time(K.ALL_REDUCE, 64 << 10, 16).algorithm in ("tree", "hierarchical")
    assert m2.time(K.ALL_REDUCE, 1 << 30, 16).algorithm == "ring"
    assert m2.time(K.ALL_GATHER, MiB, 16).algorithm == "hierarchical"
    # spanning the nodes makes the inter-node link the bottleneck
    for kind in (K.ALL_REDUCE, K.ALL_GATHER):
        assert m2.time(kind, 1 << 30, 16).time_us > m1.time(kind, 1 << 30, 8).time_us
    # a flat ring over one rank per node gets one NIC: busbw = the per-rank inter-node bandwidth
    e = m2.time(K.ALL_REDUCE, 1 << 34, 2, ranks=(0, 8), algorithm="ring")
    assert 0.99 < busbw_GBps(K.ALL_REDUCE, 1 << 34, 2, e.time_us) / two.inter_node_bandwidth_GBps <= 1
    # hierarchical wire bytes: intra RS+AG plus the inter-node AR of 1/a of the data
    h = m2.time(K.ALL_REDUCE, 16 * 800, 16, algorithm="hierarchical")
    assert h.wire_bytes == round(2 * 7 / 8 * 12800 + 2 * 1 / 2 * 12800 / 8)
    with pytest.raises(ConfigError, match="algorithm 'tree' not available for all_gather"):
        m2.time(K.ALL_GATHER, MiB, 16, algorithm="tree")


def test_gloo_reduce_scatter_costs_all_reduce():
    t = Topology.preset("cpu-gloo", num_nodes=2)
    gloo, nccl = CollectiveModel(t, "gloo"), CollectiveModel(t, "nccl")
    for s in (1 << 10, 1 << 20, 1 << 26):
        rs, ar = gloo.time(K.REDUCE_SCATTER, s, 4), gloo.time(K.ALL_REDUCE, s, 4)
        assert rs.time_us == ar.time_us and rs.wire_bytes == ar.wire_bytes
        assert rs.algorithm == "gloo-allreduce-emulation"
        assert nccl.time(K.REDUCE_SCATTER, s, 4).time_us < nccl.time(K.ALL_REDUCE, s, 4).time_us
    assert set(gloo.candidates(K.ALL_REDUCE, 1 << 20, 4)) == {"ring"}  # gloo: no tree, no hierarchy
    assert gloo.time(K.BROADCAST, 1 << 20, 4).algorithm == "binomial-tree"


def test_params_fits_take_precedence_and_multipliers():
    t = Topology.preset("cpu-gloo")
    params = CollectiveParams(
        fits=[
            AlphaBeta(kind=K.ALL_REDUCE, group_size=2, alpha_us=100.0, beta_us_per_byte=0.001),
            AlphaBeta(kind=K.ALL_GATHER, alpha_us=7.0, beta_us_per_byte=0.0),
        ],
        bandwidth_multiplier={K.ALL_TO_ALL: 2.0},
        latency_multiplier={K.ALL_TO_ALL: 0.0},
    )
    m, plain = CollectiveModel(t, "gloo", params), CollectiveModel(t, "gloo")
    e = m.time(K.ALL_REDUCE, 10_000, 2)
    assert e.time_us == 100.0 + 10.0 and e.algorithm == "fitted:ring"
    assert e.wire_bytes == plain.time(K.ALL_REDUCE, 10_000, 2).wire_bytes
    assert m.time(K.REDUCE_SCATTER, 10_000, 2).time_us == 110.0  # gloo RS: the AR fit
    assert m.time(K.ALL_REDUCE, 10_000, 4) == plain.time(K.ALL_REDUCE, 10_000, 4)  # no fit for n=4
    assert m.time(K.ALL_GATHER, 1 << 20, 4).time_us == 7.0  # group_size=None: any size
    a2a = m.time(K.ALL_TO_ALL, 1 << 20, 2).time_us
    bw_term = plain.time(K.ALL_TO_ALL, 1 << 20, 2).time_us - t.collective_launch_us - t.intra_node_latency_us
    assert math.isclose(a2a, t.collective_launch_us + bw_term / 2)
    with pytest.raises(ValueError, match="duplicate fit"):
        CollectiveParams(fits=[AlphaBeta(kind=K.SEND, alpha_us=1, beta_us_per_byte=0)] * 2)
    with pytest.raises(ConfigError, match="backend must be one of"):
        CollectiveModel(t, "mpi")


def test_m2ms_pieces_and_p2p():
    t = Topology.preset("pcie-8gpu")
    m = CollectiveModel(t)
    bw = t.intra_node_bandwidth_GBps * 1e3
    e = m.time(K.M2MS, 0, 8, pieces=[1000, 3000, 0, 4000])  # three peers get something
    assert math.isclose(e.time_us, t.collective_launch_us + 3 * t.intra_node_latency_us + 8000 / bw)
    assert e.wire_bytes == 8000 and e.algorithm == "m2ms"
    s, r = m.time(K.SEND, 4096, 8), m.time(K.RECV, 4096, 8)
    assert s.time_us == r.time_us and s.wire_bytes == 4096 and r.wire_bytes == 0
    two = CollectiveModel(Topology.preset("pcie-8gpu", num_nodes=2))
    assert two.time(K.SEND, 1 << 20, 16).time_us > m.time(K.SEND, 1 << 20, 8).time_us  # peer across nodes


def test_concrete_sizes():
    s = sympy.Symbol("s0", positive=True, integer=True)
    assert concrete(4 * s + 8, symbol_hint=10) == 48 and concrete(7) == 7 and concrete(None) is None


def test_concrete_symint_sizes():
    """A SymInt has a size, an unbacked one the flat hint (torch 2.13 renamed the symbolic-shape
    hint functions concrete() imported: the import failed and every SymInt was "unknown")."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(8, ConstantSource("s")), hint=8)
    assert isinstance(concrete(2 * s + 1), int)
    assert concrete(env.create_unbacked_symint(), symbol_hint=4096) == 4096


# --------------------------------------------------------------------------- compute


def _nodes(gm, name):
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "__name__", "").startswith(name)
    ]


def test_compute_flops_exact_mm_bmm_linear():
    def f(a, b, x, y, w, bias):
        return a @ b, torch.bmm(x, y), F.linear(a, w, bias), a.t().contiguous().view(-1)

    args = (
        torch.randn(6, 10),
        torch.randn(10, 12),
        torch.randn(3, 4, 5),
        torch.randn(3, 5, 7),
        torch.randn(9, 10),
        torch.randn(9),
    )
    gm = make_fx(f, tracing_mode="fake")(*args)
    (mm,), (bmm,), (addmm,) = _nodes(gm, "mm.default"), _nodes(gm, "bmm"), _nodes(gm, "addmm")
    assert op_cost(mm).flops == 2 * 6 * 10 * 12 and op_cost(mm).family == "matmul"
    assert op_cost(bmm).flops == 2 * 3 * 4 * 5 * 7
    assert op_cost(addmm).flops == 2 * 6 * 10 * 9
    assert op_cost(mm).bytes == 4 * (6 * 10 + 10 * 12 + 6 * 12)
    # agrees with torch.utils.flop_counter
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        f(*args)
    assert fc.get_total_flops() == sum(op_cost(n).flops for n in (mm, bmm, addmm))
    for n in _nodes(gm, "t.default") + _nodes(gm, "view"):
        assert op_cost(n).family == "view" and ComputeModel(Topology.preset("dgx-h100")).time_us(n) == 0
        assert ComputeModel(Topology.preset("dgx-h100"), ComputeParams(view_us=3.0)).time_us(n) == 3.0


def test_compute_flops_exact_sdpa_fwd_bwd():
    b, h, L, S, E = 2, 3, 8, 8, 16

    def loss(q, k, v):
        return F.scaled_dot_product_attention(q, k, v).sum()

    q, k, v = (torch.randn(b, h, n, E) for n in (L, S, S))
    fwd = make_fx(lambda q, k, v: F.scaled_dot_product_attention(q, k, v))(q, k, v)
    bwd = make_fx(torch.func.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    (f_node,) = [n for n in fwd.graph.nodes if "attention" in str(n.target)]
    (b_node,) = [n for n in bwd.graph.nodes if "attention" in str(n.target) and "backward" in str(n.target)]
    assert op_cost(f_node).flops == 4 * b * h * L * S * E and op_cost(f_node).family == "attention"
    assert op_cost(b_node).flops == 10 * b * h * L * S * E


def test_roofline_params_and_unknown_ops():
    def f(a, b, x):
        return a @ b, torch.relu(x), torch.linalg.det(a[:4, :4])

    gm = make_fx(f, tracing_mode="fake")(torch.randn(256, 256), torch.randn(256, 256), torch.randn(1 << 16))
    t = Topology.preset("dgx-h100")
    m = ComputeModel(t)
    (mm,), (relu,) = _nodes(gm, "mm"), _nodes(gm, "relu")
    e = m.estimate(relu)
    assert e.family == "pointwise" and e.bound == "memory"
    assert math.isclose(e.time_us, 2 * 4 * (1 << 16) / (t.memory_bandwidth_GBps * 1e3))
    em = m.estimate(mm)
    assert math.isclose(em.time_us, max(em.flops / (t.peak_tflops_fp32 * 1e6), em.bytes / 3350e3))
    unknown = [m.estimate(n) for n in gm.graph.nodes if n.op == "call_function" and m.estimate(n).flagged]
    assert unknown and all(u.family == "unknown" and u.time_us > 0 for u in unknown)
    p = ComputeParams(
        multiplier={"pointwise": 3.0},
        fits={"matmul": FamilyFit(a_us=5.0, b_us_per_unit=1e-6)},
        overhead_us=1.0,
    )
    mp = ComputeModel(t, p)
    assert math.isclose(mp.time_us(relu), 3 * e.time_us + 1.0)
    assert math.isclose(mp.time_us(mm), 5.0 + 1e-6 * em.flops + 1.0) and mp.estimate(mm).bound == "fitted"
    with pytest.raises(ValueError, match="unknown op families"):
        ComputeParams(multiplier={"gemm": 2.0})


# --------------------------------------------------------------------------- contention


def _est(family, flops, nbytes, out_numel, t):
    return ComputeModel(t).estimate_cost(OpCost(flops, nbytes, family, "bf16", out_numel))


@pytest.mark.parametrize("preset", ["dgx-h100", "dgx-a100", "pcie-8gpu", "a40-pcie"])
def test_lagom_slowdown_at_least_one_and_monotone_in_nc(preset):
    t = Topology.preset(preset)
    cm = ContentionModel(t, "nccl")
    kernels = [
        _est("matmul", 2 * 4096**3, 3 * 2 * 4096**2, 4096**2, t),  # compute-bound GEMM
        _est("pointwise", 1 << 26, 3 * 2 << 26, 1 << 26, t),  # memory-bound
        _est("matmul", 2 * 300 * 300 * 64, 2 * 300 * 364, 300 * 300, t),
    ]  # few tiles
    for k in kernels:
        assert cm.slowdown(k, None) == 1.0
        prev = 1.0
        for nc in range(0, t.num_sms - 1, 3):
            f = cm.slowdown(k, CommResources(channels=nc))
            assert f >= prev >= 1.0, (k.family, nc)
            prev = f
        assert prev > 1.0
        small, large = (cm.slowdown(k, CommResources(t.nccl_channels, c)) for c in (16 << 10, 8 << 20))
        assert 1.0 <= small <= large  # bigger chunks move more bytes per channel
    assert cm.slowdown(kernels[0], object()) == cm.slowdown(kernels[0], cm.default_resources())
    # several collectives in flight (the simulator's hook passes a list): channels add up
    one, two = cm.slowdown(kernels[1], [object()]), cm.slowdown(kernels[1], [object(), object()])
    assert one == cm.slowdown(kernels[1], object()) and two >= one and cm.slowdown(kernels[1], []) == 1.0
    with pytest.raises(ConfigError, match="SMs"):
        cm.slowdown(kernels[0], CommResources(channels=t.num_sms))


def test_cpu_gloo_kappa():
    t = Topology.preset("cpu-gloo")
    k = _est("matmul", 10**9, 10**6, 10**4, t)
    assert ContentionModel(t, "gloo").slowdown(k, object()) == 1.0 + t.contention_kappa
    assert ContentionModel(t, "gloo", kappa=0.5).slowdown(k, object()) == 1.5
    assert ContentionModel(t, "gloo", kappa=0.5).slowdown(k, None) == 1.0
    assert ContentionModel(t, "gloo", kappa=0.5).slowdown(k, [object(), object()]) == 1.5
    # gloo on a GPU machine: the CPU model too
    assert ContentionModel(Topology.preset("dgx-h100"), "gloo", kappa=0.2).slowdown(k, object()) == 1.2
    free = ComputeEstimate(0.0, 0, 0, "free", "free", False)
    assert ContentionModel(t, "gloo").slowdown(free, object()) == 1.0


# --------------------------------------------------------------------------- profile


def _profile() -> CostProfile:
    return CostProfile(
        topology="cpu-gloo",
        backend="gloo",
        contention_kappa=0.25,
        collective=CollectiveParams(
            fits=[
                AlphaBeta(
                    kind=K.ALL_REDUCE,
                    group_size=2,
                    alpha_us=80.0,
                    beta_us_per_byte=2e-3,
                    min_bytes=1024,
                    max_bytes=1 << 24,
                )
            ],
            bandwidth_multiplier={K.ALL_TO_ALL: 0.8},
            latency_multiplier={K.SEND: 2.0},
        ),
        compute=ComputeParams(
            fits={"matmul": FamilyFit(a_us=3.0, b_us_per_unit=2e-5)}, multiplier={"norm": 1.5}
        ),
        provenance=Provenance.here("test"),
    )


def test_profile_round_trip(tmp_path):
    p = _profile()
    path = tmp_path / "sub" / "profile.json"
    p.save(path)
    q = CostProfile.load(path)
    assert q == p and q.fingerprint() == p.fingerprint()
    assert (
        q.collective.bandwidth_multiplier == {K.ALL_TO_ALL: 0.8} and '"all_to_all": 0.8' in path.read_text()
    )
    assert q.provenance.torch_version == torch.__version__ and q.provenance.date
    m = q.build_model()
    assert isinstance(m, AnalyticCostModel) and m.backend == "gloo" and m.contention.kappa == 0.25
    assert m.collectives.time(K.ALL_REDUCE, 1000, 2).time_us == 82.0
    assert CostProfile.load(path).build_model().collectives.time(K.REDUCE_SCATTER, 1000, 2).time_us == 82.0
    spec = CostProfile(
        topology="measured",
        topology_spec=Topology(name="measured", ranks_per_node=2),
        backend="gloo",
        num_nodes=3,
    )
    assert spec.resolve_topology().world_size == 6


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "cannot read profile file"),
        ("{not json", "cannot read profile file"),
        ("[1, 2]", "must hold a JSON object"),
        (lambda d: d["collective"]["fits"][0].update(alpha_us=-1), r"'collective\.fits\.0\.alpha_us'"),
        (lambda d: d.update(backend="mpi"), r"'backend'"),
        (lambda d: d.update(topology="dgx-z"), r"topology 'dgx-z' is not a preset"),
        (
            lambda d: d["compute"].update(multiplier={"gemm": 2}),
            r"'compute\.multiplier'.*unknown op families",
        ),
        (lambda d: d.update(extra_field=1), r"'extra_field'"),
    ],
)
def test_profile_bad_files_name_file_and_field(tmp_path, content, match):
    path = tmp_path / "bad.json"
    if callable(content):
        d = json.loads(_profile().model_dump_json())
        content(d)
        path.write_text(json.dumps(d))
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match="bad.json") as ei:
        CostProfile.load(path)
    assert ei.match(match)


# --------------------------------------------------------------------------- the estimator on a graph


@pytest.mark.parametrize(
    "preset, backend", [("dgx-h100", "nccl"), ("cpu-gloo", "gloo"), ("pcie-8gpu", "nccl")]
)
def test_analytic_model_answers_every_collective(preset, backend):
    with fake_process_group(8):
        gm = trace_all_kinds()
        ir = CollectiveIR(gm)
    topo = Topology.preset(preset, num_nodes=8 // Topology.preset(preset).ranks_per_node or 1)
    model = AnalyticCostModel(topo, backend)
    assert {c.kind for c in ir.collectives} == set(CollectiveKind) - {K.BATCH_P2P, K.M2MS, K.REDUCE, K.P2P}
    for c in ir.collectives:
        e = model.collective(c)
        assert 0 < e.time_us < 1e6 and e.wire_bytes >= 0 and e.algorithm, c.name
        if backend == "nccl" and not topo.spans_nodes(tuple(range(8))):
            # single node, tiny sizes: ring conventions everywhere -> the IR's wire bytes exactly
            assert e.wire_bytes == c.wire_bytes, (c.name, e)
        if backend == "gloo" and c.kind is K.REDUCE_SCATTER:
            assert e.algorithm == "gloo-allreduce-emulation"
    for n in gm.graph.nodes:
        t = model.compute_time_us(n)
        assert t >= 0
        if n in {c.start for c in ir.collectives} or n.op != "call_function":
            assert t == 0
    assert model.slowdown(next(n for n in gm.graph.nodes if n.op == "placeholder"), object()) == 1.0


# --------------------------------------------------------------------------- step runtime terms, calibration fits


def test_profile_runtime_terms_round_trip_and_old_profiles_load(tmp_path):
    from pathlib import Path

    from commfuse.costmodel import RuntimeParams

    rt = RuntimeParams(collective_in_graph_us=120.0, step_fixed_us=400.0, param_us=4.0, dtensor_param_us=30.0)
    p = _profile().model_copy(update={"runtime": rt})
    p.save(tmp_path / "p.json")
    q = CostProfile.load(tmp_path / "p.json")
    assert q.runtime == rt and q.build_model().runtime == rt and q.fingerprint() != _profile().fingerprint()
    # a profile written before the runtime terms existed still loads: every term 0 (not modelled)
    old = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "cpu-gloo-profile-2026-11-21.json"
    assert "runtime" not in json.loads(old.read_text())
    assert not CostProfile.load(old).runtime.modelled
    with pytest.raises(ConfigError, match="step_fixed_us"):
        d = json.loads(p.model_dump_json())
        d["runtime"]["step_fixed_us"] = -1
        (tmp_path / "bad.json").write_text(json.dumps(d))
        CostProfile.load(tmp_path / "bad.json")


def test_in_graph_collective_latency_prices_graph_collectives_only():
    from commfuse.costmodel import RuntimeParams

    with fake_process_group(2):
        gm = trace_all_kinds()
        ir = CollectiveIR(gm)
    base = _profile().build_model()
    extra = (
        _profile().model_copy(update={"runtime": RuntimeParams(collective_in_graph_us=50.0)}).build_model()
    )
    for c in ir.collectives:
        b, e = base.collective(c), extra.collective(c)
        assert e.time_us == pytest.approx(b.time_us + 50.0) and e.wire_bytes == b.wire_bytes, c.name
    # the raw collective model (what a back-to-back sweep measures) is unchanged
    assert extra.collectives.time(K.ALL_REDUCE, 1000, 2).time_us == 82.0


def test_attention_backward_is_its_own_family_and_falls_back_to_attention():
    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))
    bwd = make_fx(
        torch.func.grad(lambda q, k, v: F.scaled_dot_product_attention(q, k, v).sum(), argnums=(0, 1, 2))
    )(q, k, v)
    (b_node,) = [n for n in bwd.graph.nodes if "attention" in str(n.target) and "backward" in str(n.target)]
    c = op_cost(b_node)
    assert c.family == "attention_bw"
    t = Topology.preset("cpu-gloo")
    only_fw = ComputeParams(fits={"attention": FamilyFit(a_us=10.0, b_us_per_unit=1e-6)})
    assert ComputeModel(t, only_fw).time_us(b_node) == pytest.approx(10.0 + 1e-6 * c.flops)
    both = ComputeParams(
        fits={
            "attention": FamilyFit(a_us=10.0, b_us_per_unit=1e-6),
            "attention_bw": FamilyFit(a_us=30.0, b_us_per_unit=2e-6),
        }
    )
    assert ComputeModel(t, both).time_us(b_node) == pytest.approx(30.0 + 2e-6 * c.flops)
    assert ComputeModel(t, ComputeParams(multiplier={"attention": 2.0})).time_us(b_node) == pytest.approx(
        2 * ComputeModel(t).time_us(b_node)
    )


def test_step_runtime_fit_recovers_the_terms():
    from commfuse.tools.calibrate import _nnls3, fit_step_runtime

    fixed, per, per_dt = 350.0, 4.0, 28.0
    rows = [(1.0, float(n), 0.0, fixed + per * n) for n in (2, 8, 24)] + [
        (1.0, 0.0, float(n), fixed + per_dt * n) for n in (2, 8, 24)
    ]
    assert _nnls3(rows) == pytest.approx((fixed, per, per_dt))
    # negative least-squares solutions are clamped to the best non-negative one
    assert _nnls3([(1.0, 1.0, 0.0, 10.0), (1.0, 2.0, 0.0, 5.0), (1.0, 0.0, 1.0, 7.0)])[1] == 0.0

    def rank(noise):  # measure_step_runtime_job's rows: [dtensor, n, step us, graph us]
        return [
            [dt, n, [fixed + (per_dt if dt else per) * n + 100.0 + noise] * 3, [100.0] * 3]
            for dt in (False, True)
            for n in (2, 8, 24)
        ]

    assert fit_step_runtime([rank(0.0), rank(-5.0)]) == pytest.approx((fixed, per, per_dt))  # slowest rank


def test_in_graph_latency_fit_is_the_median_excess_over_the_sweep_fit():
    from commfuse.tools.calibrate import fit_in_graph_latency, merge_in_graph

    params = CollectiveParams(
        fits=[
            AlphaBeta(kind=k, group_size=2, alpha_us=100.0, beta_us_per_byte=0.0)
            for k in (K.ALL_REDUCE, K.ALL_GATHER)
        ]
    )
    count = 4
    # per collective 100 (fit) + excess; graph = compute 50 + count x (100 + excess)
    rows = [
        [k, 4096, gap, [50.0 + count * (100.0 + ex)] * 3, [50.0] * 3]
        for k, gap, ex in (("all_reduce", 3, 20.0), ("all_reduce", 10, 40.0), ("all_gather", 3, 60.0))
    ]
    samples = merge_in_graph([rows, rows], count=count)
    assert [s.per_collective_us() for s in samples] == pytest.approx([120.0, 140.0, 160.0])
    assert fit_in_graph_latency(samples, params, 2) == pytest.approx(40.0)
    faster = [[k, s, g, [50.0 + count * 90.0] * 3, [50.0] * 3] for k, s, g, *_ in rows]
    assert fit_in_graph_latency(merge_in_graph([faster], count=count), params, 2) == 0.0


def test_calibration_graphs_are_synthetic_and_priced():
    from collections import Counter

    from commfuse.tools.calibrate import _synthetic_graph, _view_graph, fit_graph_overhead, fit_view_us

    gm, args = _synthetic_graph()
    fams = Counter(op_cost(n).family for n in gm.graph.nodes if n.op == "call_function")
    assert {"matmul", "attention", "attention_bw", "norm", "pointwise", "view"} <= set(fams)
    assert len(gm(*args)) == 12  # a gradient per weight: forward and backward in one graph
    vm, _ = _view_graph()
    views = sum(1 for n in vm.graph.nodes if n.op == "call_function" and op_cost(n).family == "view")
    assert views > 100 and all(
        op_cost(n).family in ("view", "free") for n in vm.graph.nodes if n.op == "call_function"
    )
    assert fit_view_us([2.0 * views] * 3) == pytest.approx(2.0)
    params = ComputeParams(view_us=1.0)
    ops = sum(v for f, v in fams.items() if f not in ("free", "view"))
    base = sum(ComputeModel(Topology.preset("cpu-gloo"), params).time_us(n) for n in gm.graph.nodes)
    assert fit_graph_overhead([base + 3.0 * ops], params) == pytest.approx(3.0)
